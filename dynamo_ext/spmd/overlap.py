"""Gradient buckets and the split that lets each bucket's all-reduce overlap the rest of the backward.

NOTE [gradient buckets]
DDP (its C++ Reducer) and Dynamo's DDPOptimizer
(``torch/_dynamo/backends/distributed.py``) group parameters into buckets in
reverse order, closing a bucket once it holds ``bucket_cap_mb`` (25 MiB; the
first bucket ``first_bucket_mb``, 1 MiB, so the first all-reduce starts
early): reverse parameter order approximates the order the backward produces
gradients.  Here the traced step *is* the backward, so gradients are taken in
the order the graph computes them, with the same caps.  A bucket is ready at
its last gradient; its members' all-reduces are moved there and merged by the
collective bucketing of :mod:`dynamo_ext.inductor_lowerings.bucketing` (one
pack ``cat``, one all-reduce, views to unpack), and the merged collective's
wait moves to the first reader of any member (the optimizer).

NOTE [split for overlap]
Inductor's bucketing pass, given the whole step as one graph, would merge every
gradient's all-reduce into one collective at the end of the backward (their
readers all sit in the optimizer), and Inductor schedules within a graph as it
likes.  So, as DDPOptimizer does, the graph is cut with
``torch.fx.passes.split_module`` right after each bucket's collective: submodule
``k`` computes bucket ``k``'s gradients and ends by issuing its all-reduce;
submodule ``k + 1`` (the next bucket's backward) runs while it is in flight; the
waits and the optimizer are in the last submodule.  Each submodule is compiled
on its own.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from ..inductor_lowerings.bucketing import bucket_collectives
from .reductions import Reduction, mutated_inputs

log = logging.getLogger(__name__)

c10d = torch.ops._c10d_functional


@dataclasses.dataclass
class GradientBucket:
    """Reductions issued together once the last of them is computed."""

    members: list[Reduction]
    nbytes: int
    collectives: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    """After :func:`merge_buckets`: the collectives that carry the bucket (one when all members merged)."""


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
        return 0
    return val.numel() * val.element_size()


def plan_buckets(
    graph: torch.fx.Graph, reductions: list[Reduction], *, bucket_cap_mb: float = 25, first_bucket_mb: float = 1
) -> list[GradientBucket]:
    """Group the gradient reductions into buckets (NOTE [gradient buckets]), in the order they become ready.

    A reduction joins the open bucket only if, for every member, its first
    reader comes after the point where the bucket would become ready and
    nothing updates it in place before that point (so moving the collectives
    there reads the same values); otherwise it starts a new one.
    """
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    cap, first_cap = int(bucket_cap_mb * 2**20), int(first_bucket_mb * 2**20)
    buckets: list[GradientBucket] = []
    for r in (r for r in reductions if r.gradient):
        nbytes = _nbytes(r.source)
        open_ = buckets[-1] if buckets else None
        if open_ is not None:
            limit = first_cap if len(buckets) == 1 else cap
            ready = max(pos[m.collective] for m in [*open_.members, r])
            fits = open_.nbytes < limit and all(
                pos[m.wait] > ready and not _updated_between(nodes, _reduced(m), pos[m.collective], ready)
                for m in [*open_.members, r]
            )
            if fits:
                open_.members.append(r)
                open_.nbytes += nbytes
                continue
        buckets.append(GradientBucket([r], nbytes))
    log.debug("gradient buckets (bytes): %s", [b.nbytes for b in buckets])
    return buckets


def _reduced(r: Reduction) -> torch.fx.Node:
    """The node ``r``'s all-reduce reads (the averaged gradient)."""
    x = r.collective.args[0]
    assert isinstance(x, torch.fx.Node), r.collective.format_node()
    return x


def _updated_between(nodes: list[torch.fx.Node], source: torch.fx.Node, start: int, stop: int) -> bool:
    """Whether a node in ``nodes[start:stop]`` updates ``source`` in place (moving its collective would miss it)."""
    return any(source in mutated_inputs(n) for n in nodes[start:stop])


def _copy(graph: torch.fx.Graph, node: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node]) -> torch.fx.Node:
    new = graph.node_copy(node, lambda n: env[n])
    env[node] = new
    return new


def merge_buckets(gm: torch.fx.GraphModule, buckets: list[GradientBucket]) -> None:
    """Move each bucket's collectives to where it is ready and merge them (NOTE [gradient buckets]).

    The merge is :func:`~dynamo_ext.inductor_lowerings.bucketing.bucket_collectives`
    run on a small graph holding just the bucket's all-reduces, spliced back:
    the pack and the collective at the ready point, the wait and the unpack
    views before the first reader.  Members it leaves alone (over its size
    threshold) stay separate collectives issued at the same point.
    """
    graph = gm.graph
    for bucket in buckets:
        pos = {n: i for i, n in enumerate(graph.nodes)}
        ready = max((m.collective for m in bucket.members), key=pos.__getitem__)
        first_wait = min((m.wait for m in bucket.members), key=pos.__getitem__)
        small = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        outs = []
        for i, m in enumerate(bucket.members):
            ph = small.placeholder(f"grad_{i}")
            ph.meta["val"] = _reduced(m).meta.get("val")
            target = m.collective.target
            assert callable(target), m.collective.format_node()  # a call_function node's target
            collective = small.call_function(target, (ph, *m.collective.args[1:]))
            wait = small.call_function(c10d.wait_tensor.default, (collective,))
            collective.meta["val"] = wait.meta["val"] = ph.meta["val"]
            env[ph] = _reduced(m)
            outs.append(wait)
        small.output(tuple(outs))
        bucket_collectives(small)
        after_wait: set[torch.fx.Node] = set()
        for n in small.nodes:
            if n.target is c10d.wait_tensor.default or any(a in after_wait for a in n.all_input_nodes):
                after_wait.add(n)
        anchor = ready
        for n in small.nodes:
            if n.op in ("placeholder", "output") or n in after_wait:
                continue
            with graph.inserting_after(anchor):
                anchor = _copy(graph, n, env)
            if n.target is c10d.all_reduce.default:
                bucket.collectives.append(anchor)
        for n in small.nodes:
            if n in after_wait and n.op != "output":
                with graph.inserting_before(first_wait):
                    _copy(graph, n, env)
        results = next(n for n in small.nodes if n.op == "output").args[0]
        for m, res in zip(bucket.members, results):
            m.wait.replace_all_uses_with(env[res])
        for m in bucket.members:
            graph.erase_node(m.wait)
            graph.erase_node(m.collective)
            m.collective = m.wait = None  # type: ignore[assignment]
    graph.lint()
    gm.recompile()


def split_at_buckets(gm: torch.fx.GraphModule, buckets: list[GradientBucket]) -> torch.fx.GraphModule:
    """Cut ``gm`` right after each bucket's last collective (NOTE [split for overlap]).

    Returns a GraphModule calling ``submod_0``, ``submod_1``, ... in order; the
    collectives of bucket ``k`` are the last nodes of ``submod_k``.
    """
    cuts = set()
    for b in buckets:
        if b.collectives:
            cuts.add(max(b.collectives, key=lambda n: list(gm.graph.nodes).index(n)))
    partition: dict[torch.fx.Node, int] = {}
    current = 0
    for n in gm.graph.nodes:
        partition[n] = current
        if n in cuts:
            current += 1
    split = split_module(gm, gm, lambda n: partition[n], keep_original_order=True)
    log.debug("split the step into %d submodules", current + 1)
    return split


def submodule_calls(split: torch.fx.GraphModule) -> list[tuple[str, Any]]:
    """``(name, submodule)`` of each ``call_module`` of ``split``, in call order."""
    return [(n.target, split.get_submodule(n.target)) for n in split.graph.nodes if n.op == "call_module"]
