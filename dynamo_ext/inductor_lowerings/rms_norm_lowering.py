"""Lowerings for the residual RMSNorm fusion's ops (NOTE [residual rms norm chain] in rms_norm_fusion.py).

- ``dynamo_ext::residual_rms_norm``: fast path recomputes the residual sum inside the
  reduction and inside the normalization (one loop nest per row); the fallback is the
  structure stock Inductor builds (the sum realized once and re-read).
- ``dynamo_ext::one_shot_all_reduce_residual_rms_norm``: fast path is one
  ``_CollectiveKernel`` over a symmetric-memory comm buffer (Inductor's comm reordering
  sees a collective); the fallback is stock all-reduce + wait + the epilogue above.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from .. import _compat
from . import decisions, ops, options
from .registry import LoweringRule

log = logging.getLogger(__name__)
aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional


def _lower(op: Any, *args: Any) -> Any:
    return _compat.lowering_table()[op](*args)


def _epilogue(
    summed: Any,
    weight: Any,
    eps: float,
    upcast: torch.dtype | None,
    mid_dtype: torch.dtype | None,
    out_dtype: torch.dtype | None,
) -> tuple[Any, Any]:
    """Inductor IR for the norm part; ``summed()`` gives the residual sum each time it is called."""

    def upcasted() -> Any:
        s = summed()
        return _lower(prims.convert_element_type.default, s, upcast) if upcast is not None else s

    mean = _lower(aten.mean.dim, _lower(aten.pow.Tensor_Scalar, upcasted(), 2), [-1], True)
    rstd = _lower(aten.rsqrt.default, _lower(aten.add.Scalar, mean, eps))
    y = _lower(aten.mul.Tensor, upcasted(), rstd)
    if mid_dtype is not None:
        y = _lower(prims.convert_element_type.default, y, mid_dtype)
    if weight is not None:
        y = _lower(aten.mul.Tensor, y, weight)
    if out_dtype is not None:
        y = _lower(prims.convert_element_type.default, y, out_dtype)
    return y, rstd


def _realize_loops(x: Any) -> Any:
    ir = _compat.ir_module()
    if isinstance(x, ir.TensorBox) and isinstance(x.data, ir.StorageBox) and isinstance(x.data.data, ir.Loops):
        x.realize()
    return x


def _rounded(x: Any) -> Any:
    """``x`` rounded to its fp16/bf16 dtype even when fused into an fp32 consumer.

    Stock stores the sum and re-reads it, so the norm sees the rounded value, as eager
    does.  Recomputed in registers it would not be: the CPU backend keeps fp16/bf16
    intermediates in fp32 and drops a down-and-up cast unless the upcast names its
    source dtype (``legalize_lowp_fp_dtype_loopbody`` in codegen/cpp.py treats such a
    cast as a low-precision sink), so we name it, and the downcast must not enter the
    kernel's cast cache (``use_compute_types=False``, as Inductor's own
    ``low_precision_pointwise_barrier`` emulation does), or the upcast is served the
    unrounded value from it.
    """
    dtype = x.get_dtype()
    if dtype not in (torch.float16, torch.bfloat16):
        return x
    ir, ops_ = _compat.ir_module(), _compat.ops_handler()
    load = x.make_loader()

    def inner_fn(index: Any) -> Any:
        low = ops_.to_dtype(load(index), dtype, use_compute_types=False)  # no cast-cache entry
        return ops_.to_dtype(low, torch.float32, src_dtype=dtype)

    return ir.Pointwise.create(device=x.get_device(), dtype=dtype, inner_fn=inner_fn, ranges=x.get_size())


def should_lower_residual_rms_norm_row_fused(
    input: Any, residual: Any, weight: Any, eps: float, upcast: Any, mid_dtype: Any, out_dtype: Any
) -> bool:
    """Recompute the sum per row only where a row is static, modest, and the shapes agree."""
    hidden = input.get_size()[-1]
    return (
        list(input.get_size()) == list(residual.get_size())
        and getattr(hidden, "is_number", False)
        and int(hidden) <= options.row_fused_max_hidden
    )


def lower_residual_rms_norm_row_fused(
    input: Any, residual: Any, weight: Any, eps: float, upcast: Any, mid_dtype: Any, out_dtype: Any
) -> tuple[Any, Any, Any]:
    """Fast path: a fresh (unrealized) sum for the reduction, the normalization and the output."""
    input, residual = _realize_loops(input), _realize_loops(residual)

    def summed() -> Any:
        return _rounded(_lower(aten.add.Tensor, input, residual))

    y, rstd = _epilogue(summed, weight, eps, upcast, mid_dtype, out_dtype)
    return summed(), y, rstd


def lower_residual_rms_norm_stock(
    input: Any, residual: Any, weight: Any, eps: float, upcast: Any, mid_dtype: Any, out_dtype: Any
) -> tuple[Any, Any, Any]:
    """Fallback: what stock Inductor builds, the sum realized once and re-read."""
    s = _lower(aten.add.Tensor, input, residual)
    s.realize()
    y, rstd = _epilogue(lambda: s, weight, eps, upcast, mid_dtype, out_dtype)
    return s, y, rstd


RESIDUAL_RMS_NORM_RULE = LoweringRule(
    name="residual_rms_norm",
    op=None,  # filled in by rules() once the op is defined
    predicate=should_lower_residual_rms_norm_row_fused,
    fast_path=lower_residual_rms_norm_row_fused,
    fallback=lower_residual_rms_norm_stock,
)


def should_lower_one_shot_collective(
    input: Any, residual: Any, weight: Any, eps: float, upcast: Any, mid_dtype: Any, out_dtype: Any, group_name: str
) -> bool:
    """Lowering-time check (as stock's one-shot lowering does): device, comm buffers, static shapes.

    Like the pass's, it reads only what every rank shares; a ``False`` is logged with
    the first condition that failed, and the op then lowers to stock all-reduce + our epilogue.
    """
    device = input.get_device()
    checks = (
        (lambda: device is not None, "the input has no device"),
        (
            lambda: device.type in options.one_shot_device_types,
            f"device {device} is not in options.one_shot_device_types {options.one_shot_device_types}",
        ),
        (lambda: _compat.comm_buffer_api() is not None, "this Inductor has no symmetric-memory comm buffers"),
        (lambda: _compat.symm_mem_route() != "none", "this torch build has no symmetric memory"),
        (lambda: all(getattr(s, "is_number", False) for s in input.get_size()), "the input's shape is symbolic"),
        (lambda: list(input.get_size()) == list(residual.get_size()), "input and residual shapes differ"),
    )
    for ok, reason in checks:
        if not ok():
            decisions.not_applied(log, fusion="one_shot_all_reduce lowering", node=group_name, reason=reason)
            return False
    return True


def _contiguous_storage(x: Any) -> bool:
    """``x`` is a whole buffer (no view) whose layout, if already fixed, is contiguous."""
    ir = _compat.ir_module()
    if not isinstance(x, ir.TensorBox) or not isinstance(x.data, ir.StorageBox):
        return False  # a view (transpose, slice, ...): its strides are not the buffer's
    data = x.data.data
    if isinstance(data, ir.Loops):
        return True  # realized below with a fresh, contiguous layout
    layout = data.get_output_spec() if hasattr(data, "get_output_spec") else None
    return bool(getattr(layout, "is_contiguous", lambda: False)())


def _into_comm_buffer(x: Any, group_name: str) -> Any:
    """``x`` realized as a contiguous symmetric-memory comm buffer; copied into one when we do not own it.

    Every layout is handled here, before lowering finishes: an input buffer, a view or a
    buffer frozen with non-contiguous strides becomes a contiguous copy, so the kernel's
    launcher never sees a layout it refuses.
    """
    can, realize, symm = _compat.comm_buffer_api()  # type: ignore[misc]
    ir = _compat.ir_module()
    if not (_contiguous_storage(x) and can(x, symm)):
        x.realize()
        x = ir.Pointwise.create(
            device=x.get_device(), dtype=x.get_dtype(), inner_fn=x.make_loader(), ranges=x.get_size()
        )
    realize(x, symm, group_name)
    return x


def lower_one_shot_collective(
    input: Any, residual: Any, weight: Any, eps: float, upcast: Any, mid_dtype: Any, out_dtype: Any, group_name: str
) -> list[Any]:
    """Fast path: one ``_CollectiveKernel`` whose input is a symmetric-memory comm buffer."""
    ir = _compat.ir_module()
    input = _into_comm_buffer(input, group_name)
    residual = ir.ExternKernel.require_contiguous(residual)
    if weight is not None:
        weight = ir.ExternKernel.require_contiguous(weight)
    outs = _compat.collective_kernel_cls().create_out_of_place(
        ops.one_shot_op(), input, residual, weight, eps, upcast, mid_dtype, out_dtype, group_name
    )
    return [ir.TensorBox.create(o) for o in outs]


def lower_one_shot_as_all_reduce(
    input: Any, residual: Any, weight: Any, eps: float, upcast: Any, mid_dtype: Any, out_dtype: Any, group_name: str
) -> list[Any]:
    """Fallback: stock all-reduce + wait, then our epilogue lowering."""
    reduced = _lower(c10d.wait_tensor.default, _lower(c10d.all_reduce.default, input, "sum", group_name))
    return list(RESIDUAL_RMS_NORM_RULE(reduced, residual, weight, eps, upcast, mid_dtype, out_dtype))


def rules() -> list[LoweringRule]:
    """The lowering rules of the residual RMSNorm fusion's ops (call after :func:`ops.define_ops`)."""
    return [
        dataclasses.replace(RESIDUAL_RMS_NORM_RULE, op=ops.residual_rms_norm_op()),
        LoweringRule(
            name="one_shot_all_reduce_residual_rms_norm",
            op=ops.one_shot_op(),
            predicate=should_lower_one_shot_collective,
            fast_path=lower_one_shot_collective,
            fallback=lower_one_shot_as_all_reduce,
        ),
    ]
