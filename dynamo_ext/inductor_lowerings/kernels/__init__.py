"""Triton kernels for fused collectives: launcher + ``_<op>_kernel`` file + PyTorch reference.

Importing this package needs nothing; the launcher modules import triton when
they are imported themselves (only on the CUDA path, in tests and benchmarks).
"""
