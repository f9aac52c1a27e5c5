"""``dynamo_ext::bucketed_collective``: a bucket of collectives that runs merged or as its members, decided per run.

NOTE [buckets only where ranks agree]
Ranks do not always compile the same graphs: a ``print`` on rank 0 only splits
its graph where rank 1 has one, and a rank-dependent data dependency (rank 0
feeds the first all-reduce's result into the second) keeps two all-reduces
apart on rank 0 that rank 1 may merge.  Merging on one rank and not on another
issues different collectives (gloo: "Received data size doesn't match"; NCCL:
a hang or wrong data).  No rank can tell at compile time what its peers
compiled, so the bucketing pass (:mod:`.bucketing`) emits each bucket as this
op, which takes the packed buffer (the pack kernel stays one fused kernel) and
runs either

* merged: one collective on the packed buffer, as the pass planned; or
* unmerged: one collective per member, on its segment, with the result laid
  out exactly as the merged one's, so the unpacking views are the same;

decided per run and per group by the collective check
(:func:`dynamo_ext.collective_check.merge_decision`): merged only where every
rank of the group runs, from the same stream position, a graph with the same
collectives and the same data flow between them (the graph's digest, equal
only where every rank plans the same buckets; NOTE [when the stream is
checked]).  Every rank reads the same entries to decide, so they decide alike.
Without a decision (the check switched off, a graph not checked) buckets run
unmerged.  A merged run counts its members as issued
(:func:`dynamo_ext.collective_check.stream.count_merged_away`), so stream
positions stay those of the unbucketed graph on every rank.

The unmerged path costs what the unbucketed graph would (one collective per
member) plus the pack and a copy into the result; the values are those of
separate collectives, as eager computes them.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from .._patching import Patcher

NAMESPACE = "dynamo_ext"
SCHEMA = (
    "bucketed_collective(Tensor packed, str kind, SymInt[] sizes, str reduce_op, int group_size, str group_name) "
    "-> Tensor"
)
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _c10d() -> Any:
    """The functional collectives' namespace (a function, so tests can run the layouts on a simulated world)."""
    return torch.ops._c10d_functional


def _merged(packed: torch.Tensor, kind: str, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    c10d = _c10d()
    if kind == "all_reduce":
        out = c10d.all_reduce(packed, reduce_op, group_name)
    elif kind == "all_gather":
        out = c10d.all_gather_into_tensor(packed, group_size, group_name)
    else:
        out = c10d.reduce_scatter_tensor(packed, reduce_op, group_size, group_name)
    return c10d.wait_tensor(out)


def _unmerged(
    packed: torch.Tensor, kind: str, sizes: list[int], reduce_op: str, group_size: int, group_name: str
) -> torch.Tensor:
    """One collective per member, laid out as :func:`_merged` lays out the bucket (NOTE [all-gather /
    reduce-scatter buckets])."""
    c10d = _c10d()
    if kind == "all_reduce":
        parts = [c10d.all_reduce(s, reduce_op, group_name) for s in packed.split(sizes)]
        return torch.cat([c10d.wait_tensor(p) for p in parts])
    if kind == "all_gather":
        total = sum(sizes)
        out = packed.new_empty(group_size * total)
        rows = out.view(group_size, total)
        gathered = [c10d.all_gather_into_tensor(s, group_size, group_name) for s in packed.split(sizes)]
        offset = 0
        for g, n in zip(gathered, sizes):
            rows[:, offset : offset + n] = c10d.wait_tensor(g).view(group_size, n)
            offset += n
        return out
    blocks = packed.view(group_size, sum(sizes)).split(sizes, dim=1)
    parts = [c10d.reduce_scatter_tensor(b.contiguous().view(-1), reduce_op, group_size, group_name) for b in blocks]
    return torch.cat([c10d.wait_tensor(p) for p in parts])


def bucketed_collective(
    packed: torch.Tensor, kind: str, sizes: list[int], reduce_op: str, group_size: int, group_name: str
) -> torch.Tensor:
    """Run a bucket merged or as its members (NOTE [buckets only where ranks agree]).

    Args:
        packed: 1-D, the members' inputs packed (all-reduce, all-gather: one after
            another; reduce-scatter: a ``(group_size, sum(sizes))`` matrix whose row
            ``r`` holds every member's ``r``-th chunk, flattened).
        kind: ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"``.
        sizes: per member, its input's elements (all-reduce, all-gather) or its
            result's (reduce-scatter).
        reduce_op: the reduce op (``""`` for all-gather).
        group_size: the group's size.
        group_name: the group's name.

    Returns:
        1-D, the merged collective's result: ``(N,)`` for all-reduce, ``(group_size * N,)``
        for all-gather (row ``r``: rank ``r``'s packed buffer), ``(N,)`` for reduce-scatter.
    """
    from ..collective_check import stream

    if stream.merge_decision(group_name):
        stream.count_merged_away(group_name, len(sizes) - 1)
        return _merged(packed, kind, reduce_op, group_size, group_name)
    return _unmerged(packed, kind, list(sizes), reduce_op, group_size, group_name)


def _fake(
    packed: torch.Tensor, kind: str, sizes: list[int], reduce_op: str, group_size: int, group_name: str
) -> torch.Tensor:
    total = sum(sizes)
    return packed.new_empty(group_size * total if kind == "all_gather" else total)


def define(patches: Patcher) -> None:
    """Define the op (any device, and its fake); destroyed again on undo."""
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    patches.on_undo(lambda: _compat.destroy_library(lib))
    lib.define(SCHEMA)
    lib.impl("bucketed_collective", bucketed_collective, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::bucketed_collective", _fake, lib=lib)


def bucketed_collective_op() -> torch._ops.OpOverload:
    return torch.ops.dynamo_ext.bucketed_collective.default
