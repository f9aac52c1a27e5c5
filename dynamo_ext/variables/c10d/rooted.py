"""Polyfills of the rooted c10d collectives and ``barrier``, written with functional collectives.

- ``broadcast`` is ``_c10d_functional.broadcast`` (its ``src`` is a group rank,
  so a global ``src`` is translated first).
- ``scatter`` and ``gather`` are one ``all_to_all_single`` whose split sizes
  are zero except towards (from) the root: the same bytes move as in eager
  (plus, for scatter, a leaf's copy to itself, see :func:`scatter_splits`).
  The root and the split sizes are constants of the trace (ranks are folded
  and guarded), so each rank's graph has its own sizes.
- ``reduce`` is an ``all_reduce`` whose result only the destination copies
  into its tensor.  Eager leaves the tensor of the other ranks unspecified
  (gloo writes partial sums into it); here it keeps its value.  It moves more
  data than a tree reduce; no functional reduce exists.
- ``barrier``: NOTE [barrier in a graph].  A barrier has no data, but its
  meaning, "no rank goes on before every rank has arrived", is exactly what
  waiting on an all-reduce gives: no rank's ``wait_tensor`` returns before
  every rank has contributed.  So ``barrier()`` is an ``all_reduce`` of a
  one-element zero tensor on the device eager would use, followed by
  ``wait_tensor``, kept in training graphs too (NOTE [keep-alive]).
  Tracing it as a no-op would silently drop the synchronisation that code
  after the graph (file writes, timing) relies on.  Within a graph, compute
  that does not depend on the barrier may move across it, as it may move
  across any collective; a per-call ``timeout`` cannot be honoured and is a
  graph break (``collectives.UNSUPPORTED_ARGS``).

Only some ranks use each of these results (the root, the leaves), so their
works keep them alive (NOTE [keep-alive] in ``work``).

Argument checks raise what eager raises (``ValueError`` for a missing or
misplaced list, a root given twice or outside the group; ``RuntimeError`` for
sizes), in eager's order, so a rank outside the group fails or returns
``None`` exactly where eager does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .args import barrier_device, group_info, group_peer, not_in_group, reduce_op_name
from .breaks import unsupported
from .work import FunctionalWork, finish, plain

ReduceOp = dist.ReduceOp
_C = torch.ops._c10d_functional


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    root = group_peer(group, src, group_src, "dist.broadcast")
    if not_in_group(group):
        return None
    name, _, me = group_info(group)
    out = _C.broadcast(plain(tensor), root, name)
    # The root's tensor already holds the value; only the others copy.
    return finish(FunctionalWork([out], [[] if me == root else [tensor]], keep=True), async_op)


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    root = group_peer(group, dst, group_dst, "dist.reduce")
    if not_in_group(group):
        return None
    name, _, me = group_info(group)
    out = _C.all_reduce(plain(tensor), reduce_op_name(op), name)
    return finish(FunctionalWork([out], [[tensor] if me == root else []], keep=True), async_op)


def scatter_splits(n: int, root: int, me: int, world: int) -> tuple[list[int], list[int], int]:
    """``(output splits, input splits, start)`` of a scatter of ``n`` elements per rank from ``root``.

    A leaf sends its own ``n`` elements to itself and keeps the root's part,
    from element ``start`` of the output: FakeProcessGroup rejects an empty
    input next to a non-empty output, and a copy to oneself moves no data.
    """
    if me == root:
        return [n if r == root else 0 for r in range(world)], [n] * world, 0
    out_splits = [n if r in (root, me) else 0 for r in range(world)]
    return out_splits, [n if r == me else 0 for r in range(world)], 0 if root < me else n


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    call = "dist.scatter"
    scatter_list = list(scatter_list) if scatter_list else []
    for t in scatter_list:
        if t.dtype != tensor.dtype:
            raise ValueError(
                f"{call}: Invalid usage of tensors with different dtypes. Found {t.dtype} and {tensor.dtype}"
            )
    if src is None and group_src is None:
        src = 0
    root = group_peer(group, src, group_src, call)
    if not_in_group(group):
        return None
    name, world, me = group_info(group)
    n = tensor.numel()
    if me == root:
        if not scatter_list:
            raise ValueError("Argument ``scatter_list`` must be specified on source rank.")
        if len(scatter_list) != world:
            raise RuntimeError(
                f"{call}: Incorrect input list size {len(scatter_list)}. "
                f"Input list size should be {world}, same as size of the process group."
            )
        for t in scatter_list:
            if t.numel() != n:
                unsupported(call, "scatter_list tensors of a size other than the output tensor's")
        inp = torch.cat([t.reshape(-1) for t in scatter_list])
    else:
        if scatter_list:
            raise ValueError("Argument ``scatter_list`` must NOT be specified on non-source ranks.")
        inp = tensor.reshape(-1)
    out_splits, in_splits, start = scatter_splits(n, root, me, world)
    out = _C.all_to_all_single(plain(inp), out_splits, in_splits, name)
    return finish(FunctionalWork([out], [[tensor]], start=start, keep=True), async_op)


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    call = "dist.gather"
    gather_list = list(gather_list) if gather_list else []
    for t in gather_list:
        if t.dtype != tensor.dtype:
            raise ValueError(
                f"{call}: Invalid usage of tensors with different dtypes. Found {t.dtype} and {tensor.dtype}"
            )
    if not_in_group(group):
        return None
    if dst is None and group_dst is None:
        dst = 0
    root = group_peer(group, dst, group_dst, call)
    name, world, me = group_info(group)
    n = tensor.numel()
    if me == root:
        if not gather_list:
            raise ValueError("Argument ``gather_list`` must be specified on destination rank.")
        if len(gather_list) != world:
            raise RuntimeError(
                f"{call}: Incorrect output list size {len(gather_list)}. Output list size should be {world}, same as size of the process group."
            )
        for t in gather_list:
            if t.numel() != n:
                unsupported(call, "gather_list tensors of a size other than the input tensor's")
        out_splits = [n] * world
    elif gather_list:
        raise ValueError("Argument ``gather_list`` must NOT be specified on non-destination ranks.")
    else:
        out_splits = [0] * world
    in_splits = [n if r == root else 0 for r in range(world)]
    out = _C.all_to_all_single(plain(tensor.reshape(-1)), out_splits, in_splits, name)
    return finish(FunctionalWork([out], [gather_list], keep=True), async_op)


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    if not_in_group(group):
        return None
    name, _, _ = group_info(group)
    token = torch.zeros(1, device=barrier_device(group, device_ids))
    out = _C.all_reduce(token, "sum", name)
    return finish(FunctionalWork([out], [[]], keep=True), async_op)
