"""FSDP2's gradient reduction as the backward of the traced all-gather.

NOTE [FSDP2 gradients in traced graphs]
Eager FSDP2 all-gathers a parameter in its pre-forward hook and, in its
post-backward hook, reduce-scatters the unsharded gradient the way
``foreach_reduce`` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)
does: cast to ``reduce_dtype``, divide by ``predivide_factor``, reduce-scatter
with ``ReduceOp.AVG``/``SUM``/``PREMUL_SUM(1/factor)``, divide by
``postdivide_factor``, cast to the parameter's original dtype, and accumulate
into the sharded parameter's ``.grad``.  The factors and ops come from FSDP's
own ``_get_gradient_divide_factors`` (gradient divide factor, reduce dtype,
``set_force_sum_reduction_for_comms``).

A traced forward cannot run those hooks, so the plugin derives the same
reduction from autograd, as SimpleFSDP does (torchtitan,
``torchtitan/experiments/simple_fsdp/simple_fsdp.py``: the all-gather's
backward is the averaged reduce-scatter): :class:`FSDPAllGather` is an
``autograd.Function`` whose forward casts the local shard to ``param_dtype``
and all-gathers it along dim 0, and whose backward is ``foreach_reduce``'s
sequence on that parameter.  Its input is the sharded parameter's local tensor
(through ``DTensor.to_local``), so autograd accumulates the result into the
sharded ``.grad`` as a DTensor with the parameter's placements, exactly where
eager FSDP2 puts it, and a second backward accumulates into it as
``foreach_reduce`` does (``grad._local_tensor += new``).  The reduce-scatter is
per parameter rather than over one flat buffer per group; each element is the
same reduction of the same values.  A group's parameters are all-gathered in
one collective (NOTE [FSDP2 gathers per group] in ``unshard.py``), each
parameter's rows then passing through :class:`GatheredParam`, whose backward
is the same reduction.

Only configurations whose eager reduction is this sequence are traced (see
``hooks.untraced_reasons``); the others break the graph so FSDP2's own hooks run.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ... import _compat
from ..c10d.work import wait_tensor

log = logging.getLogger(__name__)
_C = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class GradReduction:
    """How one FSDP2 parameter's gradient is reduced (all fields are trace-time constants).

    Attributes:
        group_name: the shard process group's name (the functional collectives' group).
        world: the shard group's size W; the gathered tensor has ``W x`` the local rows.
        param_dtype: dtype the local shard is cast to before the all-gather (``None``: its own).
        reduce_dtype: dtype the gradient is reduced in (``None``: the gradient's own).
        op: the reduce-scatter's op, ``"avg"`` or ``"sum"``.
        premul: factor the gradient is multiplied by before a ``"sum"`` (``PREMUL_SUM``), or ``None``.
        pre_factor: divisor applied before the reduce-scatter, or ``None``.
        post_factor: divisor applied after it, or ``None``.
    """

    group_name: str
    world: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    op: str
    premul: float | None
    pre_factor: float | None
    post_factor: float | None


def plan(fsdp_param: Any, param_group: Any) -> GradReduction:
    """The reduction eager FSDP2 applies to ``fsdp_param``'s gradient in ``param_group``.

    Raises ``ValueError`` for a reduce op other than SUM, AVG or PREMUL_SUM
    (FSDP2 returns no other).
    """
    group = fsdp_param.mesh_info.shard_process_group
    grad_dtype = fsdp_param.param_dtype or fsdp_param.orig_dtype
    reduce_dtype = fsdp_param.reduce_dtype or grad_dtype
    factor = getattr(param_group, "gradient_divide_factor", None)
    force_sum = bool(getattr(param_group, "force_sum_reduction_for_comms", False))
    pre, post, op = _compat.fsdp_gradient_divide_factors(group, reduce_dtype, factor, force_sum)
    premul = None
    if op == torch.distributed.ReduceOp.AVG:
        name = "avg"
    elif op == torch.distributed.ReduceOp.SUM:
        name = "sum"
    elif factor is not None:  # PREMUL_SUM(1 / factor)
        name, premul = "sum", 1.0 / factor
    else:
        raise ValueError(f"FSDP2 chose reduce-scatter op {op!r}, which dynamo-ext cannot trace")
    return GradReduction(
        group_name=group.group_name,
        world=group.size(),
        param_dtype=fsdp_param.param_dtype,
        reduce_dtype=fsdp_param.reduce_dtype,
        op=name,
        premul=premul,
        pre_factor=pre if pre not in (None, 1) else None,
        post_factor=post if post not in (None, 1) else None,
    )


class FSDPAllGather(torch.autograd.Function):
    """Dim-0 all-gather of a (padded) local shard whose backward is FSDP2's reduction.

    ``forward(local, *fields of GradReduction)``: ``local`` is ``[R, ...]`` in the
    parameter's original dtype; returns ``[W * R, ...]`` in ``param_dtype``.
    ``backward``: the ``[W * R, ...]`` gradient reduced to ``[R, ...]`` in the
    original dtype (NOTE [FSDP2 gradients in traced graphs]).
    """

    @staticmethod
    def forward(ctx, local, group_name, world, param_dtype, reduce_dtype, op, premul, pre_factor, post_factor):
        ctx.orig_dtype = local.dtype
        ctx.reduction = (group_name, world, reduce_dtype, op, premul, pre_factor, post_factor)
        if param_dtype is not None:
            local = local.to(param_dtype)
        return wait_tensor(_C.all_gather_into_tensor(local.contiguous(), world, group_name))

    @staticmethod
    def backward(ctx, grad):
        return _reduced(grad, ctx.reduction, ctx.orig_dtype), None, None, None, None, None, None, None, None


def _reduced(grad: torch.Tensor, reduction: tuple[Any, ...], orig_dtype: torch.dtype) -> torch.Tensor:
    """FSDP2's reduction of one unsharded gradient ``[W * R, ...]`` to this rank's ``[R, ...]`` in ``orig_dtype``."""
    group_name, world, reduce_dtype, op, premul, pre_factor, post_factor = reduction
    if reduce_dtype is not None:
        grad = grad.to(reduce_dtype)
    if premul is not None:
        grad = grad * premul
    if pre_factor is not None:
        grad = grad / pre_factor
    out = wait_tensor(_C.reduce_scatter_tensor(grad.contiguous(), op, world, group_name))
    if post_factor is not None:
        out = out / post_factor
    return out.to(orig_dtype)


class GatheredParam(torch.autograd.Function):
    """One parameter's rows of a group's all-gather: identity on ``gathered`` in forward; backward: FSDP2's
    reduction of its gradient, into ``local`` (NOTE [FSDP2 gathers per group] in ``unshard.py``).

    ``forward(local, gathered, *fields of GradReduction)``: ``local`` is the padded shard ``[R, ...]`` in the
    parameter's original dtype, ``gathered`` its gather ``[W * R, ...]`` in ``param_dtype`` (gathered without
    autograd); returns ``gathered``.  A parameter the forward does not use gets no gradient (``None``, as eager
    FSDP2 leaves it), which one reduction of the whole group's buffer could not give.
    """

    @staticmethod
    def forward(
        ctx, local, gathered, group_name, world, param_dtype, reduce_dtype, op, premul, pre_factor, post_factor
    ):
        ctx.orig_dtype = local.dtype
        ctx.reduction = (group_name, world, reduce_dtype, op, premul, pre_factor, post_factor)
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad):
        return _reduced(grad, ctx.reduction, ctx.orig_dtype), None, None, None, None, None, None, None, None, None


def gather_group(padded: list[torch.Tensor], reduction: GradReduction) -> tuple[torch.Tensor, ...]:
    """All-gather several padded shards (``[R_i, ...]``) in one collective; each result ``[W * R_i, ...]``.

    The shards are flattened into one buffer, gathered to ``(W, N)`` and split by columns (NOTE [FSDP2 gathers
    per group] in ``unshard.py``); each result's gradient is reduced on its own by :class:`GatheredParam`.
    """
    r = reduction
    flat = torch.cat([t.detach().reshape(-1) for t in padded])
    if r.param_dtype is not None:
        flat = flat.to(r.param_dtype)
    full = wait_tensor(_C.all_gather_into_tensor(flat, r.world, r.group_name)).view(r.world, -1)
    fields = (r.group_name, r.world, r.param_dtype, r.reduce_dtype, r.op, r.premul, r.pre_factor, r.post_factor)
    out = []
    offset = 0
    for t in padded:
        # narrow, not split: one op per parameter, no tuple (compiled autograd's copies of AOT backward graphs
        # are traced op by op in the order the graph has them, NOTE [AOT backward copies traced as one call])
        rows = torch.narrow(full, 1, offset, t.numel()).reshape(r.world * t.size(0), *t.shape[1:])
        out.append(GatheredParam.apply(t, rows, *fields))
        offset += t.numel()
    return tuple(out)


def gather(local: torch.Tensor, reduction: GradReduction) -> torch.Tensor:
    """All-gather ``local`` (``[R, ...]``) over the shard group with FSDP2's backward."""
    r = reduction
    return FSDPAllGather.apply(
        local, r.group_name, r.world, r.param_dtype, r.reduce_dtype, r.op, r.premul, r.pre_factor, r.post_factor
    )


class AllReduceGrad(torch.autograd.Function):
    """Identity in forward; in backward, the gradient summed over one more process group.

    ``forward(t, group_name)``.  An spmd_types parameter's gradient is ``Partial`` on a non-DP mesh axis
    (TP, for a parameter replicated there) and eager FSDP2 all-reduces it over that axis before the DP
    reduce-scatter (``fsdp_spmd_types_reductions``; NOTE [FSDP2 over an SPMD mesh] in ``hooks.py``): applied to
    the gathered parameter, this runs at that point of its backward, in the gradient's own dtype.
    """

    @staticmethod
    def forward(ctx, t, group_name):
        ctx.group_name = group_name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return wait_tensor(_C.all_reduce(grad.contiguous(), "sum", ctx.group_name)), None


def reduce_outside_dp(t: torch.Tensor, groups: tuple[tuple[str, int], ...]) -> torch.Tensor:
    """``t``, with its gradient summed over each of ``groups`` (``(group name, size)``) in backward, in order."""
    for group_name, _size in reversed(groups):  # the last applied is the first to see the gradient
        t = AllReduceGrad.apply(t, group_name)
    return t
