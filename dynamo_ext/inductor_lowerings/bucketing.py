"""Fusion 2: merge independent small all-reduces into one.

NOTE [all-reduce bucketing order]
Every rank compiles the same graph and this pass is a pure function of it, so
buckets, and the position of each merged collective, are the same on every rank.
Candidates are visited in graph order; a candidate joins the open bucket of its
key (group, reduce op, dtype) only if it comes before the first use of any
result already in the bucket.  The merged collective then sits where the last
member's collective was: every member's input exists there, and no member's
result is read before it.  Collectives are never moved earlier, and no two
buckets swap order.

The merged collective reads one flat buffer built by ``cat`` of the flattened
inputs, which Inductor lowers to a single pack kernel with the inputs' pointwise
producers (a scale, a cast) computed straight into their slice; the results are
``view``s of slices of the reduced buffer, so unpacking costs no kernel at all
(Inductor emits ``reinterpret_tensor``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from . import _compat
from .options import options

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass
class _Member:
    all_reduce: torch.fx.Node
    wait: torch.fx.Node
    numel: int
    shape: tuple[int, ...]


@dataclasses.dataclass
class _Bucket:
    key: tuple[Any, ...]
    members: list[_Member]
    first_use: int
    nbytes: int


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def bucket_key(all_reduce: torch.fx.Node) -> tuple[str, str, torch.dtype] | None:
    """``(group, reduce op, dtype)`` of a bucketable all-reduce, None when it is not one."""
    if all_reduce.op != "call_function" or all_reduce.target is not c10d.all_reduce.default:
        return None
    if len(all_reduce.users) != 1:
        return None
    wait = next(iter(all_reduce.users))
    if wait.target is not c10d.wait_tensor.default or not wait.users:
        return None
    val = _val(all_reduce.args[0])
    if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
        return None
    if not val.is_contiguous() or val.numel() * val.element_size() > options.bucket_small_bytes:
        return None
    return (str(all_reduce.args[2]), str(all_reduce.args[1]), val.dtype)


def plan_buckets(graph: torch.fx.Graph) -> list[list[_Member]]:
    """Buckets of two or more all-reduces, in graph order (NOTE [all-reduce bucketing order])."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    open_buckets: dict[tuple[Any, ...], _Bucket] = {}
    done: list[_Bucket] = []
    for node in graph.nodes:
        key = bucket_key(node)
        if key is None:
            continue
        wait = next(iter(node.users))
        val = _val(node.args[0])
        member = _Member(node, wait, val.numel(), tuple(val.shape))
        nbytes = val.numel() * val.element_size()
        first_use = min(pos[u] for u in wait.users)
        bucket = open_buckets.get(key)
        if bucket is not None and pos[node] < bucket.first_use and bucket.nbytes + nbytes <= options.bucket_cap_bytes:
            bucket.members.append(member)
            bucket.first_use = min(bucket.first_use, first_use)
            bucket.nbytes += nbytes
            continue
        if bucket is not None:
            done.append(bucket)
        open_buckets[key] = _Bucket(key, [member], first_use, nbytes)
    done.extend(open_buckets.values())
    ordered = sorted(done, key=lambda b: pos[b.members[0].all_reduce])
    return [b.members for b in ordered if len(b.members) > 1]


def _call(graph: torch.fx.Graph, target: Any, args: tuple[Any, ...], origin: torch.fx.Node) -> torch.fx.Node:
    node = graph.call_function(target, args)
    vals = pytree.tree_map_only(torch.fx.Node, _val, args)
    mode = _compat.detect_fake_mode([v for v in pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*vals)
    node.meta["original_aten"] = target
    if "stack_trace" in origin.meta:
        node.meta["stack_trace"] = origin.meta["stack_trace"]
    return node


def merge_bucket(graph: torch.fx.Graph, members: list[_Member]) -> torch.fx.Node:
    """Replace the members by pack -> one all-reduce -> wait -> views; return the new all-reduce."""
    last = members[-1].all_reduce
    _, reduce_op, group_name = last.args
    with graph.inserting_before(last):
        flats = [_call(graph, aten.view.default, (m.all_reduce.args[0], [m.numel]), m.all_reduce) for m in members]
        packed = _call(graph, aten.cat.default, (flats, 0), last)
        merged = _call(graph, c10d.all_reduce.default, (packed, reduce_op, group_name), last)
        reduced = _call(graph, c10d.wait_tensor.default, (merged,), last)
        offset = 0
        for m in members:
            piece = _call(graph, aten.slice.Tensor, (reduced, 0, offset, offset + m.numel), m.wait)
            out = _call(graph, aten.view.default, (piece, list(m.shape)), m.wait)
            m.wait.replace_all_uses_with(out)
            offset += m.numel
    for m in members:
        graph.erase_node(m.wait)
        graph.erase_node(m.all_reduce)
    return merged


def bucket_all_reduces(graph: torch.fx.Graph) -> int:
    """Merge every planned bucket; return the number of collectives removed."""
    if not options.bucket_all_reduces:
        return 0
    removed = 0
    for members in plan_buckets(graph):
        merge_bucket(graph, members)
        removed += len(members) - 1
    if removed:
        graph.lint()
    return removed


class AllReduceBucketingPass(_compat.custom_graph_pass_base()):  # type: ignore[misc]
    """Post-grad pass for fusion 2 (see NOTE [all-reduce bucketing order])."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        bucket_all_reduces(graph)

    def uuid(self) -> Any:
        return _compat.hash_for_files((__file__,), extra=options.cache_key())
