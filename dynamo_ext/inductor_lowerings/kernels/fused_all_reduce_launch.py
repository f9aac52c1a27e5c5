"""What the one-shot and two-shot all-reduce + residual add + RMSNorm launchers share.

Both kernels take the same tensors and produce the same outputs (the two-shot one
only moves the data differently, NOTE [two-shot all-reduce]): argument checks,
output dtypes, output allocation, and the constexprs of a launch live here once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .peer_buffers import PeerBuffers

_LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tl_dtype(dtype: torch.dtype | None) -> object:
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


@dataclasses.dataclass(frozen=True)
class FusedLaunch:
    """One launch's outputs and constexprs (:func:`prepare_launch`).

    ``summed`` ``[..., n_cols]`` of the input dtype, ``normed`` of the output dtype,
    ``rstd`` ``[..., 1]`` fp32; ``constexprs``: the kernel's keyword arguments
    (``WORLD_SIZE``, ``HAS_WEIGHT``, ``MID_DTYPE``, ``PRODUCT_DTYPE`` and :func:`launch_config`'s);
    ``None`` when there is nothing to launch (no rows or no columns).
    """

    n_rows: int
    n_cols: int
    out_dtype: torch.dtype
    summed: torch.Tensor
    normed: torch.Tensor
    rstd: torch.Tensor
    constexprs: dict[str, Any] | None

    @property
    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(summed, normed, rstd)``: what the launchers return."""
        return self.summed, self.normed, self.rstd


def prepare_launch(
    peers: PeerBuffers,
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    upcast: torch.dtype | None,
    mid_dtype: torch.dtype | None,
    out_dtype: torch.dtype | None,
    max_block_n: int,
) -> FusedLaunch:
    """Check the arguments (:func:`check_arguments`: TypeError / ValueError), allocate the outputs, and work out
    the constexprs of a launch over ``input`` ``[..., n_cols]``."""
    mid, product, final = check_arguments(
        input, residual, weight, upcast=upcast, mid_dtype=mid_dtype, out_dtype=out_dtype
    )
    n_cols = input.shape[-1]
    n_rows = input.numel() // max(n_cols, 1)
    summed = torch.empty_like(input)
    normed = torch.empty(input.shape, dtype=final, device=input.device)
    rstd = torch.empty((*input.shape[:-1], 1), dtype=torch.float32, device=input.device)
    constexprs = None
    if n_rows and n_cols:
        constexprs = {
            "WORLD_SIZE": peers.world_size,
            "HAS_WEIGHT": weight is not None,
            "MID_DTYPE": tl_dtype(mid),
            "PRODUCT_DTYPE": tl_dtype(product),
            **launch_config(peers, input, final, max_block_n=max_block_n),
        }
    return FusedLaunch(n_rows, n_cols, final, summed, normed, rstd, constexprs)
