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
from .fused_all_reduce_launch import MAX_BLOCK_N, prepare_launch
from .peer_buffers import PeerBuffers
from .reference import residual_rms_norm_reference


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
    layouts the kernel does not take (:func:`.fused_all_reduce_launch.check_arguments`).
    """
    launch = prepare_launch(
        peers, input, residual, weight, upcast=upcast, mid_dtype=mid_dtype, out_dtype=out_dtype, max_block_n=max_block_n
    )
    if launch.constexprs is None:
        return launch.outputs
    grid = (max(1, min(launch.n_rows, peers.max_blocks, max_blocks or peers.max_blocks)),)
    _one_shot_all_reduce_residual_rms_norm_kernel[grid](
        peers.buffer_ptrs,
        peers.signal_pad_ptrs,
        peers.element_offset(input),
        residual,
        weight if weight is not None else residual,  # never read without HAS_WEIGHT
        *launch.outputs,
        launch.n_rows,
        launch.n_cols,
        float(eps),
        peers.rank,
        **launch.constexprs,
    )
    return launch.outputs


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
