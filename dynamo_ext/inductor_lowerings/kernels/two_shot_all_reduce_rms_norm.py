"""Launcher for the two-shot all-reduce + residual add + RMSNorm kernel.

The kernel (``_two_shot_all_reduce_rms_norm_kernel.py``, NOTE [two-shot all-reduce])
reduces and normalizes only this rank's slice of the rows, stages the results in this
rank's peer buffer, and gathers the other slices from the peers' staging: per rank
``2 n`` elements cross the links instead of the one-shot kernel's ``WORLD_SIZE * n``,
which pays once inputs are large.  The outputs are the one-shot kernel's, so the
references are the one-shot module's (:func:`reference`, :func:`reference_float64`).
"""

from __future__ import annotations

import torch

from ._two_shot_all_reduce_rms_norm_kernel import _two_shot_all_reduce_residual_rms_norm_kernel
from .fused_all_reduce_launch import MAX_BLOCK_N, prepare_launch
from .one_shot_all_reduce_rms_norm import reference, reference_float64
from .peer_buffers import PeerBuffers

__all__ = ["reference", "reference_float64", "staging_nbytes", "two_shot_all_reduce_residual_rms_norm"]

_ALIGN = 16


def _align(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _staging_layout(
    start: int, n_rows: int, numel: int, dtype: torch.dtype, out_dtype: torch.dtype
) -> tuple[int, int, int, int]:
    """Byte offsets ``(sum, normed, rstd, end)`` of the staging areas placed from byte ``start``."""
    sum_at = _align(start)
    norm_at = _align(sum_at + numel * dtype.itemsize)
    rstd_at = _align(norm_at + numel * out_dtype.itemsize)
    return sum_at, norm_at, rstd_at, rstd_at + n_rows * torch.float32.itemsize


def staging_nbytes(shape: tuple[int, ...], dtype: torch.dtype, out_dtype: torch.dtype) -> int:
    """Peer-buffer bytes the kernel stages its results in, besides the input (alignment included)."""
    numel = 1
    for s in shape:
        numel *= s
    n_rows = numel // max(shape[-1], 1) if shape else 1
    return _staging_layout(0, n_rows, numel, dtype, out_dtype)[3] + _ALIGN


def two_shot_all_reduce_residual_rms_norm(
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
    staging: PeerBuffers | None = None,
    staging_offset: int | None = None,
    max_block_n: int = MAX_BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input summed over ranks + residual, its RMSNorm [* weight], rstd)``, as the one-shot launcher.

    ``input`` ``[..., n_cols]`` (fp32, fp16 or bf16) must live in ``peers``' local buffer
    at the same offset on every rank; every rank must call this with the same shapes
    and arguments (it is a collective).  The results are staged from byte
    ``staging_offset`` of ``staging``'s buffers (a separate symmetric workspace of the
    same group; default 0), or without ``staging`` of ``peers``' buffers (default: just
    after the input), which needs :func:`staging_nbytes` bytes there, clear of the input.
    """
    launch = prepare_launch(
        peers, input, residual, weight, upcast=upcast, mid_dtype=mid_dtype, out_dtype=out_dtype, max_block_n=max_block_n
    )
    if launch.constexprs is None:
        return launch.outputs
    n_rows, final = launch.n_rows, launch.out_dtype
    input_offset = peers.element_offset(input)
    input_start = input_offset * input.element_size()
    input_end = input_start + input.numel() * input.element_size()
    if staging is not None and (staging.rank, staging.world_size) != (peers.rank, peers.world_size):
        raise ValueError(
            f"staging is rank {staging.rank} of {staging.world_size}, peers {peers.rank} of {peers.world_size}"
        )
    default_start = input_end if staging is None else 0
    start = default_start if staging_offset is None else staging_offset
    sum_at, norm_at, rstd_at, end = _staging_layout(start, n_rows, input.numel(), input.dtype, final)
    stage = peers if staging is None else staging
    overlaps = staging is None and start < input_end and end > input_start
    if overlaps or start < 0 or end > stage.buffer_nbytes:
        raise ValueError(
            f"staging [{sum_at}, {end}) must fit rank {stage.rank}'s buffer of {stage.buffer_nbytes} bytes "
            f"clear of the input [{input_start}, {input_end}); allocate staging_nbytes() more"
        )
    constexprs = dict(launch.constexprs)
    if not stage.aligned:
        constexprs["VEC"] = 1
    rows_per_rank = -(-n_rows // peers.world_size)
    grid = (max(1, min(rows_per_rank, peers.max_blocks, max_blocks or peers.max_blocks)),)
    _two_shot_all_reduce_residual_rms_norm_kernel[grid](
        peers.buffer_ptrs,
        peers.signal_pad_ptrs,
        stage.buffer_ptrs,
        input_offset,
        sum_at // input.element_size(),
        norm_at // final.itemsize,
        rstd_at // torch.float32.itemsize,
        residual,
        weight if weight is not None else residual,  # never read without HAS_WEIGHT
        *launch.outputs,
        n_rows,
        launch.n_cols,
        float(eps),
        peers.rank,
        **constexprs,
    )
    return launch.outputs
