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

import logging

import torch

from .. import _compat
from .._patching import Patcher
from . import options
from .kernels.reference import residual_rms_norm_reference

log = logging.getLogger(__name__)
NAMESPACE = "dynamo_ext"

_EPILOGUE_ARGS = "Tensor input, Tensor residual, Tensor? weight, float eps, ScalarType? upcast, ScalarType? mid_dtype, ScalarType? out_dtype"
RESIDUAL_RMS_NORM_SCHEMA = f"residual_rms_norm({_EPILOGUE_ARGS}) -> (Tensor, Tensor, Tensor)"
ONE_SHOT_SCHEMA = f"one_shot_all_reduce_residual_rms_norm({_EPILOGUE_ARGS}, str group_name) -> Tensor[]"


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


def kernel_refusal(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    upcast: torch.dtype | None = None,
    mid_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> str | None:
    """None when the fused kernels take these tensors' layouts, else why not (checked before any launch).

    Only shapes, dtypes and strides, which every rank shares, so a refusal sends every
    rank to the fallback together.  The compiled path never meets one: its lowering
    hands the op a contiguous comm buffer and contiguous residual and weight.
    """
    from .kernels.fused_all_reduce_launch import check_arguments

    try:
        check_arguments(input, residual, weight, upcast=upcast, mid_dtype=mid_dtype, out_dtype=out_dtype)
    except (TypeError, ValueError) as e:  # the launchers' own checks, as words
        return str(e)
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
    """CUDA: the one-shot or two-shot Triton kernel when ``input`` lives in symmetric memory, else the fallback.

    Which path runs depends only on what every rank shares (NOTE [symmetric memory
    route] in _compat/symm_mem.py): the layouts (:func:`kernel_refusal`) and whether the input
    is a symmetric-memory allocation, which the compiled graph makes it on every rank
    and an eager call on none.  A rendezvous that then fails raises: falling back on
    this rank alone would leave the others waiting in the kernel's barrier.
    """
    from .kernels import fused_all_reduce_launch as fused_launch
    from .kernels import one_shot_all_reduce_rms_norm as launcher
    from .kernels import two_shot_all_reduce_rms_norm as two_shot
    from .kernels.peer_buffers import PeerBuffers

    refusal = kernel_refusal(input, residual, weight, upcast, mid_dtype, out_dtype)
    if refusal is not None or _compat.is_symm_mem_tensor(input) is False:
        log.debug("fused all-reduce kernel not used at run time: %s", refusal or "input not in symmetric memory")
        return _one_shot_fallback(input, residual, weight, eps, upcast, mid_dtype, out_dtype, group_name)
    try:
        peers = PeerBuffers.from_symmetric_memory(input, group_name)
    except RuntimeError as e:
        raise RuntimeError(
            f"dynamo_ext: rendezvous of a symmetric-memory input on group {group_name!r} failed on this rank; "
            "the other ranks run the fused kernel, so this rank cannot fall back alone"
        ) from e
    casts = {"eps": eps, "upcast": upcast, "mid_dtype": mid_dtype, "out_dtype": out_dtype}
    if peers.world_size > 1 and fused_all_reduce_algorithm(input.numel() * input.element_size()) == "two_shot":
        final = fused_launch.check_arguments(
            input, residual, weight, upcast=upcast, mid_dtype=mid_dtype, out_dtype=out_dtype
        )[2]
        # The workspace is the same size on every rank (a collective call).  It cannot grow during
        # CUDA graph capture, which every rank is in or none is: the one-shot kernel needs no workspace.
        try:
            staging = PeerBuffers.symmetric_workspace(
                group_name, two_shot.staging_nbytes(tuple(input.shape), input.dtype, final), input.device
            )
        except RuntimeError:
            if not torch.cuda.is_current_stream_capturing():
                raise
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
