"""Collective bucketing: merge independent small collectives (all-reduce, all-gather, reduce-scatter) into one per bucket.

NOTE [all-reduce bucketing order]
Candidates are visited in graph order; a candidate joins the open bucket when
it has the bucket's key (kind, group, reduce op, dtype; group size for
all-gather / reduce-scatter), unless its input is computed from a result
already in the bucket, or a node that cannot move (one with side effects) reads
such a result before it.  Any other communication op closes the open bucket
(NOTE [buckets keep the communication order]).  The merged collective then
sits where the last member's collective was: every member's input exists
there; the compute that read a member's result before that point moves after
the merged collective's unpacking, in its order.  Collectives are never moved
earlier.

NOTE [buckets keep the communication order]
A bucket's members are consecutive in the order the program issues its
communication: point-to-point ops, barriers, collectives of another key or
group, collectives the pass leaves alone, our own communicating ops and the
symmetric-memory ops (NOTE [communication ops], :func:`~dynamo_ext.fx.collectives.is_communication`)
each close the open bucket.  Moving a member's collective to the last member's
place then moves it across compute and waits only, so every rank issues its
communication in its program's order whatever it plans: merged, unmerged
(NOTE [buckets only where ranks agree]) or not bucketed at all.  Before, a
bucket could move an all-reduce across a blocking ``send`` on the ranks whose
plan merged it and not on the others (their data flow kept it apart), and the
ranks waited for each other (one in the ``send``, the other in the all-reduce);
and collectives of two keys, interleaved, were issued in another order on a
rank whose data flow split one of the buckets.  The price: interleaved keys
(float32 and bfloat16 gradients in turn) bucket only in runs of one key.

NOTE [rank-invariant first use]
Ranks do not compile identical graphs: the plugin folds the rank to a constant,
so ``if rank == 0: log(y.sum())`` reads an all-reduce's result early on rank 0
only; with uneven shards (FSDP2 pads 10 rows over 4 ranks to 3, 3, 3, 1) the
slice that takes a rank's rows out of a reduce-scatter's result is a no-op,
removed by Inductor, on the ranks whose shard is whole, and a real node right
after the wait on the others.  A plan that let such a read split the bucket
would split it on some ranks only, and the ranks would issue different
collectives and hang (this happened).  So the plan depends only on what every
rank agrees on: the collective sequence (op, group, reduce op, shapes, dtypes,
order: what the collective check compares across ranks, NOTE [collective
fingerprint]) and the data flow between collectives.  Plain compute that reads
a result, whatever the rank does with it, never splits a bucket; it moves after
the merged collective.  What remains rank-dependent is a program whose data
flow between its collectives differs per rank (rank 0 feeds a reduced result
into the next collective, rank 1 does not), or where a node that cannot move (a
mutation, a random op) reads a result early on some ranks only: the collectives
still agree on op, shape and order (the collective check, which compares the
graphs before this pass, passes them), but nothing short of asking the other
ranks could make the buckets agree: so the pass emits each bucket in a form
that runs merged only where the ranks agree, decided per run by the
collective check (NOTE [buckets only where ranks agree]); elsewhere it runs as
the separate collectives.

The merged all-reduce reads one flat buffer built by ``cat`` of the flattened
inputs, which Inductor lowers to a single pack kernel with the inputs' pointwise
producers (a scale, a cast) computed straight into their slice; the results are
``view``s of slices of the reduced buffer, so unpacking costs no kernel at all
(Inductor emits ``reinterpret_tensor``).

NOTE [all-gather / reduce-scatter buckets]
Only dim-0 (FSDP-style) calls on static, contiguous tensors join: an all-gather
whose output is ``(W * s0, *rest)`` for an input ``(s0, *rest)``, a reduce-scatter
whose output is ``(s0 // W, *rest)`` with ``W`` dividing ``s0``.  Anything else is
left alone.  Sizes (small threshold, bucket cap) count the unsharded side.

* All-gather of ``x_1 .. x_n`` (``n_i`` elements, ``N = sum n_i``): pack the flat
  inputs into one ``(N,)`` buffer (one ``cat``, one pack kernel), gather it into
  ``(W * N,)``, i.e. a ``(W, N)`` matrix whose row ``r`` is rank ``r``'s packed
  buffer.  Output ``i`` is column block ``[:, off_i : off_i + n_i]`` made
  contiguous: rank 0's slice, then rank 1's, ..., which is exactly what a lone
  all-gather returns.  That re-assembly is a copy; the blocks are written by one
  ``cat`` into one ``(W * N,)`` buffer (one unpack kernel), and each output is a
  ``view`` of its contiguous ``W * n_i`` slice.
* Reduce-scatter of ``y_1 .. y_n`` (``W * c_i`` elements): rank ``r`` receives chunk
  ``r`` of the packed input, so the packed input is ``cat([y_i.view(W, c_i)], dim=1)``
  (one pack kernel): row ``r`` holds every tensor's ``r``-th chunk, in member
  order.  The ``(C,)`` result (``C = sum c_i``) is then sliced and ``view``ed per
  member, with no unpack kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.node import Target

from .. import _compat
from ..fx import collectives as fx_collectives
from ..fx.nodes import example_value, static_contiguous
from . import bucket_op, options
from .graph_edit import call
from .registry import package_sources

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"


@dataclasses.dataclass
class _Member:
    collective: torch.fx.Node
    wait: torch.fx.Node
    numel: int
    """Elements of the collective's input."""
    shape: tuple[int, ...]
    """Shape of the collective's result (what the wait's users see)."""


_KINDS: dict[Target, str] = {
    c10d.all_reduce.default: ALL_REDUCE,
    c10d.all_gather_into_tensor.default: ALL_GATHER,
    c10d.reduce_scatter_tensor.default: REDUCE_SCATTER,
}
# Positional arguments of each kind's op (the mergers unpack them); a call with fewer or with keywords is left alone.
_ARITY = {ALL_REDUCE: 3, ALL_GATHER: 3, REDUCE_SCATTER: 4}


def _enabled(kind: str) -> bool:
    return options.bucket_all_reduces if kind == ALL_REDUCE else options.bucket_all_gathers_reduce_scatters


def _candidate(node: torch.fx.Node) -> tuple[tuple[Any, ...], int] | None:
    """``(bucket key, bytes counted against the limits)`` of a bucketable collective, or None.

    The predicate of the pass: a collective (not a barrier) whose only user is its ``wait_tensor``,
    whose input and result are static and contiguous, and (all-gather,
    reduce-scatter) whose shapes follow the dim-0 rule of NOTE [all-gather /
    reduce-scatter buckets].  Anything it does not recognise is left alone.
    The collective is read by :func:`dynamo_ext.fx.collectives.read` (NOTE [one collective reader]).
    """
    kind = _KINDS.get(node.target) if node.op == "call_function" else None
    if kind is None or node.kwargs or len(node.args) != _ARITY[kind] or not _enabled(kind):
        return None
    coll = fx_collectives.read(node)
    if coll is None or len(node.users) != 1 or fx_collectives.is_barrier(node):
        return None  # a barrier stays where the program put it (NOTE [buckets keep the communication order])
    wait = next(iter(node.users))
    if wait.target is not c10d.wait_tensor.default or not wait.users:
        return None
    val, out = coll.input, coll.output
    if not static_contiguous(val) or not static_contiguous(out) or out.dtype != val.dtype or val.numel() == 0:
        return None
    nbytes = coll.bytes_in
    if kind == ALL_REDUCE:
        if tuple(out.shape) != tuple(val.shape):
            return None
        key: tuple[Any, ...] = (kind, coll.group, coll.reduce_op, val.dtype)
    else:
        size = coll.arguments["group_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or val.dim() < 1:
            return None
        s0, rest = val.shape[0], tuple(val.shape[1:])
        if kind == ALL_GATHER:
            expected = (size * s0, *rest)
            nbytes *= size
            key = (kind, coll.group, size, val.dtype)
        else:
            if s0 % size:
                return None
            expected = (s0 // size, *rest)
            key = (kind, coll.group, size, coll.reduce_op, val.dtype)
        if tuple(out.shape) != expected:
            return None
    if nbytes > options.bucket_small_bytes:
        return None
    return key, nbytes


def bucket_key(node: torch.fx.Node) -> tuple[Any, ...] | None:
    """The bucket key of a bucketable collective, None when it is not one.

    All-reduce: ``("all_reduce", group, reduce op, dtype)``; all-gather:
    ``("all_gather", group, group size, dtype)``; reduce-scatter:
    ``("reduce_scatter", group, group size, reduce op, dtype)``.
    """
    found = _candidate(node)
    return None if found is None else found[0]


# Namespaces whose ops are collectives or waits: never moved across a merged collective.
_COLLECTIVE_NAMESPACES = fx_collectives.NAMESPACES | fx_collectives.COMMUNICATION_NAMESPACES


def _movable(node: torch.fx.Node) -> bool:
    """Whether ``node`` may move later, past a merged collective: pure compute, no collective or wait."""
    if node.op != "call_function" or node.is_impure():
        return False
    return getattr(node.target, "namespace", None) not in _COLLECTIVE_NAMESPACES


@dataclasses.dataclass
class _OpenBucket:
    key: tuple[Any, ...]
    members: list[_Member]
    nbytes: int
    tainted: set[torch.fx.Node]
    """Nodes computed from a member's result (NOTE [all-reduce bucketing order])."""
    closed: bool = False
    """A node that cannot move reads a member's result: no later candidate may join."""


def plan_buckets(graph: torch.fx.Graph) -> list[list[_Member]]:
    """Buckets of two or more collectives, in graph order (NOTE [all-reduce bucketing order]).

    A pure function of the communication sequence (NOTE [buckets keep the
    communication order]) and the data flow between the collectives, not of
    where compute reads their results (NOTE [rank-invariant first use]).
    """
    done: list[_OpenBucket] = []
    bucket: _OpenBucket | None = None
    waits: set[torch.fx.Node] = set()
    for node in graph.nodes:
        found = _candidate(node)
        if found is None:
            if node in waits:
                continue  # a member's own wait: the source of its bucket's taint, not a reader
            if bucket is not None and fx_collectives.is_communication(node):
                done.append(bucket)  # NOTE [buckets keep the communication order]
                bucket = None
            elif bucket is not None and any(a in bucket.tainted for a in node.all_input_nodes):
                bucket.tainted.add(node)
                bucket.closed = bucket.closed or not _movable(node)
            continue
        key, nbytes = found
        wait = next(iter(node.users))
        waits.add(wait)
        member = _Member(node, wait, example_value(node.args[0]).numel(), tuple(example_value(node).shape))
        joins = (
            bucket is not None
            and bucket.key == key
            and not bucket.closed
            and not any(a in bucket.tainted for a in node.all_input_nodes)
            and bucket.nbytes + nbytes <= options.bucket_cap_bytes
        )
        if joins and bucket is not None:
            bucket.members.append(member)
            bucket.nbytes += nbytes
            bucket.tainted.add(wait)
            continue
        if bucket is not None:
            done.append(bucket)
        bucket = _OpenBucket(key, [member], nbytes, {wait})
    if bucket is not None:
        done.append(bucket)
    return [b.members for b in done if len(b.members) > 1]


def _readers_before(members: list[_Member], anchor: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes before ``anchor`` computed from a member's result (other than the waits), in graph order."""
    waits = {m.wait for m in members}
    tainted: set[torch.fx.Node] = set(waits)
    out: list[torch.fx.Node] = []
    node = members[0].collective
    while node is not anchor:
        if node not in waits and any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
            out.append(node)
        node = node.next
    return out


def _replace(graph: torch.fx.Graph, m: _Member, flat: torch.fx.Node, start: int, stop: int) -> None:
    """Point ``m``'s result users at ``flat[start:stop]`` viewed as ``m.shape``."""
    piece = call(graph, aten.slice.Tensor, (flat, 0, start, stop), m.wait)
    out = call(graph, aten.view.default, (piece, list(m.shape)), m.wait)
    m.wait.replace_all_uses_with(out)


def _issue(
    graph: torch.fx.Graph, kind: str, args: tuple[Any, ...], sizes: list[int], last: torch.fx.Node, switchable: bool
) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``(collective, waited result)`` of a merged bucket: the stock collective and its wait, or, switchable, one
    ``dynamo_ext::bucketed_collective`` that runs merged or unmerged per run (NOTE [buckets only where ranks agree])."""
    packed, group_name = args[0], args[-1]
    if switchable:
        reduce_op = "" if kind == ALL_GATHER else args[1]
        size = 1 if kind == ALL_REDUCE else args[1] if kind == ALL_GATHER else args[2]
        node = call(graph, bucket_op.bucketed_collective_op(), (packed, kind, sizes, reduce_op, size, group_name), last)
        return node, node
    target = {
        ALL_REDUCE: c10d.all_reduce.default,
        ALL_GATHER: c10d.all_gather_into_tensor.default,
        REDUCE_SCATTER: c10d.reduce_scatter_tensor.default,
    }[kind]
    merged = call(graph, target, args, last)
    return merged, call(graph, c10d.wait_tensor.default, (merged,), last)


def _merge_all_reduce(graph: torch.fx.Graph, members: list[_Member], switchable: bool) -> torch.fx.Node:
    last = members[-1].collective
    _, reduce_op, group_name = last.args
    flats = [call(graph, aten.view.default, (m.collective.args[0], [m.numel]), m.collective) for m in members]
    packed = call(graph, aten.cat.default, (flats, 0), last)
    sizes = [m.numel for m in members]
    merged, reduced = _issue(graph, ALL_REDUCE, (packed, reduce_op, group_name), sizes, last, switchable)
    offset = 0
    for m in members:
        _replace(graph, m, reduced, offset, offset + m.numel)
        offset += m.numel
    return merged


def _merge_all_gather(graph: torch.fx.Graph, members: list[_Member], switchable: bool) -> torch.fx.Node:
    """NOTE [all-gather / reduce-scatter buckets]: pack, gather, re-assemble rank order."""
    last = members[-1].collective
    _, size, group_name = last.args
    assert isinstance(size, int), size  # the group size: an int in the op's schema
    total = sum(m.numel for m in members)
    flats = [call(graph, aten.view.default, (m.collective.args[0], [m.numel]), m.collective) for m in members]
    packed = call(graph, aten.cat.default, (flats, 0), last)
    sizes = [m.numel for m in members]
    merged, gathered = _issue(graph, ALL_GATHER, (packed, size, group_name), sizes, last, switchable)
    rows = call(graph, aten.view.default, (gathered, [size, total]), last)  # row r: rank r's packed buffer
    blocks = []
    offset = 0
    for m in members:
        block = call(graph, aten.slice.Tensor, (rows, 1, offset, offset + m.numel), m.wait)
        block = call(graph, aten.clone.default, (block,), m.wait)  # (W, n_i), now contiguous
        blocks.append(call(graph, aten.view.default, (block, [size * m.numel]), m.wait))
        offset += m.numel
    unpacked = call(graph, aten.cat.default, (blocks, 0), last)
    offset = 0
    for m in members:
        _replace(graph, m, unpacked, offset, offset + size * m.numel)
        offset += size * m.numel
    return merged


def _merge_reduce_scatter(graph: torch.fx.Graph, members: list[_Member], switchable: bool) -> torch.fx.Node:
    """NOTE [all-gather / reduce-scatter buckets]: rank r's chunk holds every member's r-th chunk."""
    last = members[-1].collective
    _, reduce_op, size, group_name = last.args
    assert isinstance(size, int), size  # the group size: an int in the op's schema
    chunks = [m.numel // size for m in members]
    blocks = [
        call(graph, aten.view.default, (m.collective.args[0], [size, c]), m.collective) for m, c in zip(members, chunks)
    ]
    packed = call(graph, aten.cat.default, (blocks, 1), last)  # (W, C)
    flat = call(graph, aten.view.default, (packed, [size * sum(chunks)]), last)
    merged, reduced = _issue(graph, REDUCE_SCATTER, (flat, reduce_op, size, group_name), chunks, last, switchable)
    offset = 0
    for m, c in zip(members, chunks):
        _replace(graph, m, reduced, offset, offset + c)
        offset += c
    return merged


_MERGERS: dict[Target, Callable[[torch.fx.Graph, list[_Member], bool], torch.fx.Node]] = {
    c10d.all_reduce.default: _merge_all_reduce,
    c10d.all_gather_into_tensor.default: _merge_all_gather,
    c10d.reduce_scatter_tensor.default: _merge_reduce_scatter,
}


def merge_bucket(graph: torch.fx.Graph, members: list[_Member], *, switchable: bool = False) -> torch.fx.Node:
    """Replace the members by pack -> one collective -> wait -> unpack; return the new collective.

    ``switchable``: the collective and its wait are one ``dynamo_ext::bucketed_collective``
    that runs merged only where the ranks agree (NOTE [buckets only where ranks agree]).
    """
    anchor = members[-1].collective
    readers = _readers_before(members, anchor)
    with graph.inserting_before(anchor):
        merged = _MERGERS[anchor.target](graph, members, switchable)
    # NOTE [rank-invariant first use]: what read a member's result before the merged collective moves
    # after it, in order.  The unpacking nodes all sit right before the anchor, so the readers go there too.
    for reader in readers:
        anchor.prepend(reader)
    for m in members:
        graph.erase_node(m.wait)
        graph.erase_node(m.collective)
    return merged


def bucket_collectives(graph: torch.fx.Graph, *, switchable: bool = False) -> int:
    """Merge every planned bucket; return the number of collectives removed.

    ``switchable``: see :func:`merge_bucket`.  Callers whose graph is the same on
    every rank by construction (the gradient buckets of ``data_parallel``) merge
    outright; the post-grad pass, which sees one rank's graph, merges switchably.
    """
    removed = 0
    for members in plan_buckets(graph):
        merge_bucket(graph, members, switchable=switchable)
        removed += len(members) - 1
    if removed:
        graph.lint()
    return removed


class AllReduceBucketingPass(_compat.custom_graph_pass_base()):  # type: ignore[misc]
    """Post-grad pass that buckets small collectives of one group.

    NOTE [all-reduce bucketing order], NOTE [all-gather / reduce-scatter buckets].
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        bucket_collectives(graph, switchable=True)  # NOTE [buckets only where ranks agree]

    def uuid(self) -> Any:
        return _compat.hash_for_files(
            package_sources(), extra=options.get_hash().hex()
        )  # NOTE [pass identity covers the lowerings]
