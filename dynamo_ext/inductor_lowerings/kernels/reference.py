"""The plain PyTorch reference of the residual add + RMSNorm epilogue, shared by the ops and the kernels.

Here, beside the kernels, so that ``kernels/`` never imports ``ops.py`` (``ops.py``
imports the kernels' launchers; the arrow points one way).
"""

from __future__ import annotations

import torch


def residual_rms_norm_reference(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    upcast: torch.dtype | None = None,
    mid_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input + residual, rms_norm(input + residual) [* weight], rstd)`` in plain PyTorch.

    The same aten ops, in the same order and dtypes, as the chain the pass replaces.
    """
    summed = input + residual
    h = summed.to(upcast) if upcast is not None else summed
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = h * rstd
    if mid_dtype is not None:
        y = y.to(mid_dtype)
    if weight is not None:
        y = y * weight
    if out_dtype is not None:
        y = y.to(out_dtype)
    return summed, y, rstd
