"""The custom ops our post-grad passes put into the graph, and their PyTorch references.

``dynamo_ext::residual_rms_norm`` is the add+RMSNorm epilogue of an all-reduce;
``dynamo_ext::one_shot_all_reduce_residual_rms_norm`` also does the all-reduce (on CUDA,
the one-shot kernel, or the two-shot kernel for larger inputs: :func:`fused_all_reduce_algorithm`).
Both are defined by :func:`define_ops` at install time on one
``torch.library.Library`` that uninstall destroys, so nothing is left in
``torch.ops`` afterwards.

The optional casts reproduce the decomposed chains exactly (see
NOTE [residual rms norm chain] in rms_norm_fusion.py): ``upcast`` is applied to
the residual sum before squaring, ``mid_dtype`` to the normalized value before
the weight, ``out_dtype`` after the weight.
"""

from __future__ import annotations

import torch

from .._patching import Patcher
from . import _compat
from .options import options

NAMESPACE = "dynamo_ext"

_EPILOGUE_ARGS = "Tensor input, Tensor residual, Tensor? weight, float eps, ScalarType? upcast, ScalarType? mid_dtype, ScalarType? out_dtype"
RESIDUAL_RMS_NORM_SCHEMA = f"residual_rms_norm({_EPILOGUE_ARGS}) -> (Tensor, Tensor, Tensor)"
ONE_SHOT_SCHEMA = f"one_shot_all_reduce_residual_rms_norm({_EPILOGUE_ARGS}, str group_name) -> Tensor[]"


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


def _one_shot_fallback(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    upcast: torch.dtype | None,
    mid_dtype: torch.dtype | None,
    out_dtype: torch.dtype | None,
    group_name: str,
) -> list[torch.Tensor]:
    """Any device: a functional all-reduce, then the reference epilogue."""
    c10d = torch.ops._c10d_functional
    reduced = c10d.wait_tensor(c10d.all_reduce(input, "sum", group_name))
    return list(residual_rms_norm_reference(reduced, residual, weight, eps, upcast, mid_dtype, out_dtype))


def fused_all_reduce_algorithm(nbytes: int) -> str | None:
    """Which kernel fuses an all-reduce of ``nbytes`` input bytes: "one_shot", "two_shot", or None (too big).

    One-shot reads every peer's whole input (``world x nbytes`` per rank, one
    barrier): best while latency dominates.  Two-shot reads ``nbytes / world`` from
    each peer and gathers the finished rows (``2 x nbytes`` per rank, three barriers):
    best once bandwidth does.  Larger all-reduces stay stock collectives.
    """
    if nbytes <= options.one_shot_max_bytes:
        return "one_shot"
    if nbytes <= options.two_shot_max_bytes:
        return "two_shot"
    return None


def _one_shot_cuda(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    upcast: torch.dtype | None,
    mid_dtype: torch.dtype | None,
    out_dtype: torch.dtype | None,
    group_name: str,
) -> list[torch.Tensor]:
    """CUDA: the one-shot or two-shot Triton kernel when ``input`` lives in symmetric memory, else the fallback."""
    from .kernels import one_shot_all_reduce_rms_norm as launcher
    from .kernels import two_shot_all_reduce_rms_norm as two_shot
    from .kernels.peer_buffers import PeerBuffers

    try:
        peers = PeerBuffers.from_symmetric_memory(input, group_name)
    except RuntimeError:  # not a symmetric-memory allocation (an eager call): plain collective
        return _one_shot_fallback(input, residual, weight, eps, upcast, mid_dtype, out_dtype, group_name)
    casts = {"eps": eps, "upcast": upcast, "mid_dtype": mid_dtype, "out_dtype": out_dtype}
    if peers.world_size > 1 and fused_all_reduce_algorithm(input.numel() * input.element_size()) == "two_shot":
        final = launcher.check_arguments(
            input, residual, weight, upcast=upcast, mid_dtype=mid_dtype, out_dtype=out_dtype
        )[2]
        try:  # the results are staged in the group's workspace (same size on every rank: a collective call)
            staging = PeerBuffers.symmetric_workspace(
                group_name, two_shot.staging_nbytes(tuple(input.shape), input.dtype, final), input.device
            )
        except RuntimeError:  # it would have to grow during CUDA graph capture: one-shot needs no workspace
            staging = None
        if staging is not None:
            return list(
                two_shot.two_shot_all_reduce_residual_rms_norm(peers, input, residual, weight, staging=staging, **casts)
            )
    return list(launcher.one_shot_all_reduce_residual_rms_norm(peers, input, residual, weight, **casts))


def _one_shot_fake(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    upcast: torch.dtype | None,
    mid_dtype: torch.dtype | None,
    out_dtype: torch.dtype | None,
    group_name: str,
) -> list[torch.Tensor]:
    return list(residual_rms_norm_reference(input, residual, weight, eps, upcast, mid_dtype, out_dtype))


def define_ops(patches: Patcher) -> None:
    """Define both ops (reference, CUDA and fake implementations); destroyed again on undo."""
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    patches.on_undo(lambda: _compat.destroy_library(lib))
    lib.define(RESIDUAL_RMS_NORM_SCHEMA)
    lib.impl("residual_rms_norm", residual_rms_norm_reference, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::residual_rms_norm", residual_rms_norm_reference, lib=lib)
    lib.define(ONE_SHOT_SCHEMA)
    lib.impl("one_shot_all_reduce_residual_rms_norm", _one_shot_fallback, "CompositeExplicitAutograd")
    lib.impl("one_shot_all_reduce_residual_rms_norm", _one_shot_cuda, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::one_shot_all_reduce_residual_rms_norm", _one_shot_fake, lib=lib)


def residual_rms_norm_op() -> torch._ops.OpOverload:
    return torch.ops.dynamo_ext.residual_rms_norm.default


def one_shot_op() -> torch._ops.OpOverload:
    return torch.ops.dynamo_ext.one_shot_all_reduce_residual_rms_norm.default
