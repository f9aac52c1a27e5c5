"""Launcher and PyTorch references for the one-shot all-reduce + residual add + RMSNorm kernel.

The kernel (``_one_shot_all_reduce_rms_norm_kernel.py``) reads every peer's copy of
the input straight from the peer's buffer, so the all-reduce, the residual add and
the norm take one pass and one launch.  :func:`reference` replays the exact dtype
semantics of ``dynamo_ext::residual_rms_norm`` after a sum-reduce;
:func:`reference_float64` is the same math without any rounding, for tests.
"""

from __future__ import annotations

import torch

from ._one_shot_all_reduce_rms_norm_kernel import _one_shot_all_reduce_residual_rms_norm_kernel
from .peer_buffers import PeerBuffers
from .reference import residual_rms_norm_reference

_LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tl_dtype(dtype: torch.dtype | None) -> object:
    import triton.language as tl

    return {None: None, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def output_dtypes(
    input_dtype: torch.dtype,
    weight_dtype: torch.dtype | None,
    *,
    upcast: torch.dtype | None,
    mid_dtype: torch.dtype | None,
    out_dtype: torch.dtype | None,
) -> tuple[torch.dtype | None, torch.dtype | None, torch.dtype]:
    """``(mid rounding, product rounding, output dtype)`` the aten chain implies; ValueError if unsupported."""
    compute = upcast or input_dtype
    if compute != torch.float32:
        raise ValueError(f"the one-shot kernel computes the norm in float32; got compute dtype {compute}")
    y = mid_dtype or compute
    product = None
    if weight_dtype is not None:
        y = torch.promote_types(y, weight_dtype)
        product = y if y in _LOW_PRECISION else None
    final = out_dtype or y
    if product is not None and final != product:
        raise ValueError(f"a {product} product cast to {final} would round twice; not supported by the kernel")
    mid = mid_dtype if mid_dtype in _LOW_PRECISION else None
    return mid, product, final


def check_arguments(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    upcast: torch.dtype | None,
    mid_dtype: torch.dtype | None,
    out_dtype: torch.dtype | None,
) -> tuple[torch.dtype | None, torch.dtype | None, torch.dtype]:
    """Shapes, dtypes and layouts the kernels take; :func:`output_dtypes` of them, or TypeError/ValueError."""
    if input.dtype not in SUPPORTED_DTYPES or residual.dtype != input.dtype:
        raise TypeError(
            f"input {input.dtype} / residual {residual.dtype}: expected one dtype of {SUPPORTED_DTYPES} for both"
        )
    if input.shape != residual.shape or not (input.is_contiguous() and residual.is_contiguous()):
        raise ValueError(
            f"input {tuple(input.shape)} and residual {tuple(residual.shape)} must have one shape and be contiguous"
        )
    n_cols = input.shape[-1]
    if weight is not None and (weight.numel() != n_cols or not weight.is_contiguous()):
        raise ValueError(f"weight {tuple(weight.shape)}: expected {n_cols} contiguous elements")
    return output_dtypes(
        input.dtype,
        None if weight is None else weight.dtype,
        upcast=upcast,
        mid_dtype=mid_dtype,
        out_dtype=out_dtype,
    )


MAX_BLOCK_N = 4096
"""Longest row chunk a program keeps in registers: 8 fp32 values per thread per tensor at 16 warps."""


def launch_config(
    peers: PeerBuffers, input: torch.Tensor, out_dtype: torch.dtype, *, max_block_n: int = MAX_BLOCK_N
) -> dict[str, int]:
    """Constexprs and warps for a launch over ``input`` ``[..., n_cols]``: ``PEERS``, ``BLOCK_N``, ``N_CHUNKS``,
    ``VEC``, ``num_warps``.

    Rows longer than ``max_block_n`` (a power of two) are walked in chunks (two passes,
    see ``_fused_row``).  ``VEC`` is the elements of one 16-byte read when every buffer is
    16-byte aligned and rows and the input's offset are multiples of it (then
    ``tl.multiple_of`` lets peer reads vectorize), else 1; counted in the narrower of
    the input and output dtypes, so rows of either start 16-byte aligned (the two-shot
    kernel reads peers' staged outputs too).
    """
    import triton

    n_cols = input.shape[-1]
    block_n = min(triton.next_power_of_2(n_cols), max_block_n)
    vec = 16 // min(input.element_size(), out_dtype.itemsize)
    if not (peers.aligned and n_cols % vec == 0 and peers.element_offset(input) % vec == 0):
        vec = 1
    return {
        "PEERS": triton.next_power_of_2(peers.world_size),
        "BLOCK_N": block_n,
        "N_CHUNKS": -(-n_cols // block_n),
        "VEC": vec,
        "num_warps": max(1, min(16, block_n // 256)),
    }


def one_shot_all_reduce_residual_rms_norm(
    peers: PeerBuffers,
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    eps: float,
    upcast: torch.dtype | None = None,
    mid_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    max_blocks: int | None = None,
    max_block_n: int = MAX_BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input summed over ranks + residual, its RMSNorm [* weight], rstd)``.

    ``input`` must live in ``peers``' local buffer at the same offset on every rank;
    every rank of ``peers`` must call this with the same shapes and ``max_blocks`` /
    ``max_block_n`` (it is a collective: the grid, ``min(rows, peers.max_blocks,
    max_blocks)``, must be the same everywhere).  Raises TypeError / ValueError for
    layouts the kernel does not take (:func:`check_arguments`).
    """
    mid, product, final = check_arguments(
        input, residual, weight, upcast=upcast, mid_dtype=mid_dtype, out_dtype=out_dtype
    )
    n_cols = input.shape[-1]
    n_rows = input.numel() // max(n_cols, 1)
    summed = torch.empty_like(input)
    normed = torch.empty(input.shape, dtype=final, device=input.device)
    rstd = torch.empty((*input.shape[:-1], 1), dtype=torch.float32, device=input.device)
    if n_rows == 0 or n_cols == 0:
        return summed, normed, rstd
    config = launch_config(peers, input, final, max_block_n=max_block_n)
    grid = (max(1, min(n_rows, peers.max_blocks, max_blocks or peers.max_blocks)),)
    _one_shot_all_reduce_residual_rms_norm_kernel[grid](
        peers.buffer_ptrs,
        peers.signal_pad_ptrs,
        peers.element_offset(input),
        residual,
        weight if weight is not None else residual,  # never read without HAS_WEIGHT
        summed,
        normed,
        rstd,
        n_rows,
        n_cols,
        float(eps),
        peers.rank,
        WORLD_SIZE=peers.world_size,
        HAS_WEIGHT=weight is not None,
        MID_DTYPE=_tl_dtype(mid),
        PRODUCT_DTYPE=_tl_dtype(product),
        **config,
    )
    return summed, normed, rstd


def reference(
    inputs: list[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    eps: float,
    upcast: torch.dtype | None = None,
    mid_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's input summed (fp32 accumulate, one rounding), then the aten epilogue."""
    reduced = torch.stack([x.float() for x in inputs]).sum(0).to(inputs[0].dtype)
    return residual_rms_norm_reference(reduced, residual, weight, eps, upcast, mid_dtype, out_dtype)


def reference_float64(
    inputs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor | None, *, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same math in float64 with no intermediate rounding (the ground truth tests compare to)."""
    summed = torch.stack([x.double() for x in inputs]).sum(0) + residual.double()
    rstd = torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps)
    normed = summed * rstd
    if weight is not None:
        normed = normed * weight.double()
    return summed, normed, rstd
