"""Audit target that warns as a third-party library would: once when imported, once per rank when run.

Run as ``tests.audit_targets.noisy:main``.  The command imports a ``module:function``
target to check it, so the import-time warning is raised in the command's own
process too, as torch's "Failed to initialize NumPy" was without numpy.
"""

import warnings

import torch
import torch.distributed as dist

warnings.warn("noisy target: warning at import", UserWarning, stacklevel=1)


def step(x):
    return (x * 2).relu()


def main():
    warnings.warn(f"noisy target: warning on rank {dist.get_rank()}", UserWarning, stacklevel=1)
    torch.compile(step, backend="eager")(torch.ones(4))
