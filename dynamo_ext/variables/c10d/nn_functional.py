"""``torch.distributed.nn.functional`` collectives traced with eager's autograd.

Eager implements each of these as an ``autograd.Function`` around a c10d
call; under ``torch.compile`` stock torch raises (2.12+) or traces a wrong
backward (2.11).  Here each is an ``autograd.Function`` around functional
collectives, which Dynamo traces forward and backward; each backward is the
one eager's Function computes:

==================  ====================================================
all_reduce          all_reduce of the gradient with the same op
all_gather          reduce_scatter (sum) of the stacked gradients
reduce_scatter      all_gather of the gradient (whatever the op, as eager)
all_to_all(_single) all_to_all of the gradients with the splits swapped
broadcast           sum of the gradients on the source, zero elsewhere
reduce              broadcast of the gradient from the destination
gather / scatter    scatter / gather of the gradients from / to the root
==================  ====================================================

The Functions return the collective's raw output and the polyfills reshape,
unbind or copy it outside them, so outputs are ordinary autograd views.
Where eager writes into a user tensor (``reduce_scatter``, ``all_to_all``,
``all_to_all_single``) the polyfill does too, with a differentiable ``copy_``,
and returns that tensor.  ``reduce`` keeps the input value on ranks other
than the destination (eager leaves it unspecified).  ``_all_gather_base``'s
backward is the reduce-scatter eager runs on NCCL (eager gloo raises there).
A double backward is not supported (the backwards call functional ops directly).
What a rank returns without using the collective's result (zeros off the
root) still depends on it, see :func:`_after`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .args import group_info, group_peer, reduce_op_name
from .collectives import split_sizes
from .rooted import scatter_splits
from .work import wait_tensor

ReduceOp = dist.ReduceOp
_C = torch.ops._c10d_functional


def _all_reduce(t, op, name):
    return wait_tensor(_C.all_reduce(t.contiguous(), op, name))


def _a2a(t, out_splits, in_splits, name):
    return wait_tensor(_C.all_to_all_single(t.contiguous(), out_splits, in_splits, name))


def _after(t, result):
    """``t``, data-dependent on ``result`` (one byte of it) so training graphs keep its collective.

    NOTE [keep-alive] in ``work``: inside an ``autograd.Function`` no global
    token can be written, so the value a rank returns carries the dependency
    (``& 0`` keeps it exact, whatever the byte).
    """
    return t + (result.reshape(-1)[:1].view(torch.uint8).sum() & 0)


def _to_root(n, root, world, is_root):
    """(out_splits, in_splits) of a gather of ``n`` elements per rank to ``root``."""
    return ([n] * world if is_root else [0] * world), [n if r == root else 0 for r in range(world)]


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name):
        ctx.op, ctx.name = op, name
        return _all_reduce(tensor, op, name)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.op, ctx.name), None, None


class _AllGather(torch.autograd.Function):
    """``(world, *shape)`` from each rank's ``shape``."""

    @staticmethod
    def forward(ctx, tensor, world, name):
        ctx.world, ctx.name = world, name
        return wait_tensor(_C.all_gather_into_tensor(tensor.unsqueeze(0).contiguous(), world, name))

    @staticmethod
    def backward(ctx, grad):
        out = wait_tensor(_C.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.world, ctx.name))
        return out.squeeze(0), None, None


class _ReduceScatter(torch.autograd.Function):
    """``(1, *shape)`` from each rank's stacked ``(world, *shape)``."""

    @staticmethod
    def forward(ctx, stacked, op, world, name):
        ctx.world, ctx.name = world, name
        return wait_tensor(_C.reduce_scatter_tensor(stacked.contiguous(), op, world, name))

    @staticmethod
    def backward(ctx, grad):
        return wait_tensor(_C.all_gather_into_tensor(grad.contiguous(), ctx.world, ctx.name)), None, None, None


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, out_splits, in_splits, name):
        ctx.out_splits, ctx.in_splits, ctx.name = out_splits, in_splits, name
        return _a2a(tensor, out_splits, in_splits, name)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, ctx.in_splits, ctx.out_splits, ctx.name), None, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, is_root, name):
        ctx.is_root, ctx.name = is_root, name
        return wait_tensor(_C.broadcast(tensor.contiguous(), root, name))

    @staticmethod
    def backward(ctx, grad):
        total = _all_reduce(grad, "sum", ctx.name)
        return (total if ctx.is_root else _after(torch.zeros_like(total), total)), None, None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, root, is_root, name):
        ctx.root, ctx.name = root, name
        total = _all_reduce(tensor, op, name)
        return total if is_root else _after(tensor.clone(), total)

    @staticmethod
    def backward(ctx, grad):
        return wait_tensor(_C.broadcast(grad.contiguous(), ctx.root, ctx.name)), None, None, None, None


class _Gather(torch.autograd.Function):
    """The root gets every rank's flattened tensor, ``(world * n,)``; the others zeros."""

    @staticmethod
    def forward(ctx, flat, root, me, world, name):
        ctx.root, ctx.me, ctx.world, ctx.name = root, me, world, name
        out_splits, in_splits = _to_root(flat.numel(), root, world, me == root)
        out = _a2a(flat, out_splits, in_splits, name)
        return out if me == root else _after(flat.new_zeros(world * flat.numel()), out)

    @staticmethod
    def backward(ctx, grad):
        n = grad.numel() // ctx.world
        out_splits, in_splits, start = scatter_splits(n, ctx.root, ctx.me, ctx.world)
        out = _a2a(grad if ctx.me == ctx.root else grad[:n], out_splits, in_splits, ctx.name)
        return out[start : start + n], None, None, None, None


class _Scatter(torch.autograd.Function):
    """This rank's ``n`` elements of the root's flattened ``(world * n,)``, at ``[start, start + n)`` of the output."""

    @staticmethod
    def forward(ctx, flat, root, me, world, name):
        n = flat.numel() // world
        out_splits, in_splits, start = scatter_splits(n, root, me, world)
        ctx.root, ctx.me, ctx.world, ctx.name, ctx.n, ctx.start = root, me, world, name, n, start
        return _a2a(flat if me == root else flat[:n], out_splits, in_splits, name)

    @staticmethod
    def backward(ctx, grad):
        n, is_root = ctx.n, ctx.me == ctx.root
        out_splits, in_splits = _to_root(n, ctx.root, ctx.world, is_root)
        out = _a2a(grad[ctx.start : ctx.start + n], out_splits, in_splits, ctx.name)
        return (out if is_root else _after(grad.new_zeros(ctx.world * n), out)), None, None, None, None


# ---- the polyfills: torch.distributed.nn.functional's signatures --------------
def all_reduce(tensor, op=ReduceOp.SUM, group=None):
    name, _, _ = group_info(group)
    return _AllReduce.apply(tensor, reduce_op_name(op), name)


def all_gather(tensor, group=None):
    name, world, _ = group_info(group)
    return tuple(_AllGather.apply(tensor, world, name).unbind(0))


def _all_gather_base(output_tensor, input_tensor, group=None):
    name, world, _ = group_info(group)
    gathered = _AllGather.apply(input_tensor, world, name)
    return output_tensor.copy_(gathered.view(output_tensor.shape))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None):
    name, world, _ = group_info(group)
    stacked = torch.stack([t.reshape(output.shape) for t in input_list])
    out = _ReduceScatter.apply(stacked, reduce_op_name(op), world, name)
    return output.copy_(out.view(output.shape))


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
    name, world, _ = group_info(group)
    call = "torch.distributed.nn.functional.all_to_all_single"
    out_splits = split_sizes(call, output, output_split_sizes, world, "output")
    in_splits = split_sizes(call, input, input_split_sizes, world, "input")
    out = _AllToAllSingle.apply(input, out_splits, in_splits, name)
    return output.copy_(out.view(output.shape))


def all_to_all(output_tensor_list, input_tensor_list, group=None):
    name, _, _ = group_info(group)
    flat = torch.cat([t.reshape(-1) for t in input_tensor_list])
    out_splits = [t.numel() for t in output_tensor_list]
    out = _AllToAllSingle.apply(flat, out_splits, [t.numel() for t in input_tensor_list], name)
    offset = 0
    for t, n in zip(output_tensor_list, out_splits):
        t.copy_(out[offset : offset + n].view(t.shape))
        offset += n
    return tuple(output_tensor_list)


def broadcast(tensor, src, group=None):
    root = group_peer(group, src, None, "torch.distributed.nn.functional.broadcast")
    name, _, me = group_info(group)
    return _Broadcast.apply(tensor, root, me == root, name)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None):
    root = group_peer(group, dst, None, "torch.distributed.nn.functional.reduce")
    name, _, me = group_info(group)
    return _Reduce.apply(tensor, reduce_op_name(op), root, me == root, name)


def gather(tensor, dst=0, group=None):
    root = group_peer(group, dst, None, "torch.distributed.nn.functional.gather")
    name, world, me = group_info(group)
    out = _Gather.apply(tensor.reshape(-1), root, me, world, name)
    return tuple(out.view(world, *tensor.shape).unbind(0))


def scatter(tensors, src=0, group=None):
    root = group_peer(group, src, None, "torch.distributed.nn.functional.scatter")
    name, world, me = group_info(group)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    n = flat.numel() // world
    start = scatter_splits(n, root, me, world)[2]
    return _Scatter.apply(flat, root, me, world, name)[start : start + n].view(tensors[0].shape)


# (torch.distributed.nn.functional name, polyfill, functional ops it needs)
POLYFILLS = (
    ("all_reduce", all_reduce, ("all_reduce",)),
    ("all_gather", all_gather, ("all_gather_into_tensor", "reduce_scatter_tensor")),
    ("_all_gather_base", _all_gather_base, ("all_gather_into_tensor", "reduce_scatter_tensor")),
    ("reduce_scatter", reduce_scatter, ("reduce_scatter_tensor", "all_gather_into_tensor")),
    ("all_to_all_single", all_to_all_single, ("all_to_all_single",)),
    ("all_to_all", all_to_all, ("all_to_all_single",)),
    ("broadcast", broadcast, ("broadcast", "all_reduce")),
    ("reduce", reduce, ("all_reduce", "broadcast")),
    ("gather", gather, ("all_to_all_single",)),
    ("scatter", scatter, ("all_to_all_single",)),
)
