"""Insert the all-reduces a data-parallel step needs into its traced graph.

NOTE [DDP's averaging]
Each rank runs the single-device graph on its local batch, so a mean loss is
the mean over the local samples and its gradient is that of the local mean;
values that mix samples (the sample count a mean divides by, BatchNorm's
batch statistics) are each rank's own, as under ``DistributedDataParallel``
(NOTE [reduction edges]).  DDP averages each gradient across ranks as soon as
autograd has accumulated it, dividing by the world size and then summing;
this pass does the same:

1. each parameter's gradient (the node autograd accumulated into ``.grad``,
   found by :func:`.step_trace.trace_step`) that the analysis found Partial is
   divided by the world size and all-reduced (``sum``) right after it is
   computed, and every later reader (the optimizer, gradient clipping,
   ``.grad`` after the step) reads the result, with the ``wait_tensor`` right
   before the first of them: the collective overlaps the rest of the backward;
2. any other Partial value that is still read whole afterwards (a returned
   mean loss, a Partial value that does not come from a gradient) is averaged
   the same way before its readers, issued as soon as the value exists (for
   a ``detach`` of a Partial value, as soon as what it detaches exists, so a
   returned ``loss.detach()`` is averaged during the backward).  With equal local batch sizes and a
   mean loss that is the full-batch value; a returned sum comes back as the
   mean over ranks of the local sums.

NOTE [reduction after in-place updates]
In step 2, a Partial value can be updated in place between two readers.  A
reader sees the value as of its last in-place update before it, so readers are
grouped by that version and each group gets its own all-reduce, issued right
after the update (or the value's creation).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial

log = logging.getLogger(__name__)

c10d = torch.ops._c10d_functional
_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


@dataclasses.dataclass
class Reduction:
    """One inserted all-reduce of ``source``, divided by the world size first (DDP's average).

    ``wait`` is what the readers now read.
    """

    source: torch.fx.Node
    collective: torch.fx.Node
    wait: torch.fx.Node
    gradient: bool
    """The gradient of a parameter (step 1 of NOTE [DDP's averaging]); these are bucketed."""


def mutated_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes ``node`` updates in place (arguments its schema marks as written)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        values = value if isinstance(value, list | tuple) else [value]
        out.extend(v for v in values if isinstance(v, torch.fx.Node))
    return out


def _average(
    graph: torch.fx.Graph, source: torch.fx.Node, after: torch.fx.Node, group_name: str, world_size: int
) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``div`` + ``all_reduce`` inserted after ``after``; returns ``(collective, wait)`` (the wait not yet placed)."""
    with graph.inserting_after(after):
        scaled = graph.call_function(torch.ops.aten.div.Tensor, (source, world_size))
    with graph.inserting_after(scaled):
        collective = graph.call_function(c10d.all_reduce.default, (scaled, "sum", group_name))
    with graph.inserting_after(collective):
        wait = graph.call_function(c10d.wait_tensor.default, (collective,))
    scaled.meta["val"] = collective.meta["val"] = wait.meta["val"] = source.meta.get("val")
    return collective, wait


def insert_reductions(
    gm: torch.fx.GraphModule,
    layouts: dict[str, Any],
    reduce_before: dict[str, list[str]],
    local_reads: dict[str, list[str]],
    *,
    gradients: list[torch.fx.Node],
    group_name: str,
    world_size: int,
) -> list[Reduction]:
    """Average across ranks every Partial gradient, and every other Partial value read whole (NOTE [DDP's averaging]).

    Args:
        gm: the traced step (see :mod:`.step_trace`).
        layouts, reduce_before, local_reads: from :func:`.batch_dim.analyze_step`.
        gradients: the nodes of the parameters' accumulated gradients.
        group_name: the data-parallel process group's name.
        world_size: its size.

    Returns:
        The inserted reductions, in graph order of their collectives.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    local_edges = {(by_name[r], by_name[i]) for r, ins in local_reads.items() for i in ins}
    reductions = []

    def partial(n: Any) -> bool:
        return isinstance(n, torch.fx.Node) and isinstance(layouts.get(n.name), Partial)

    # 1. gradients: reduced where they are born; every later reader but a local one reads the average.
    for g in sorted({g for g in gradients if partial(g)}, key=pos.__getitem__):
        readers = [u for u in g.users if (u, g) not in local_edges]
        if not readers:
            continue
        first = min(readers, key=pos.__getitem__)
        collective, wait = _average(graph, g, g, group_name, world_size)
        first.prepend(wait)
        for u in readers:
            u.replace_input_with(g, wait)
        reductions.append(Reduction(g, collective, wait, True))
    # 2. Partial values still partial after that (not fed by a reduced gradient), read whole.
    averaged = {r.wait for r in reductions}
    still: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if partial(n):
            ins = [i for i in n.all_input_nodes if partial(i) or i in averaged]
            if not ins or any(i in still for i in ins):
                still.add(n)
    readers_of: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for name, inputs in reduce_before.items():
        for i in inputs:
            if by_name[i] in still and by_name[i] in by_name[name].all_input_nodes:  # not already fed an average
                readers_of.setdefault(by_name[i], []).append(by_name[name])
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for a in output.args[0]:
        if a in still:
            readers_of.setdefault(a, []).append(output)
    mutations: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    mutated_anywhere: set[torch.fx.Node] = set()
    for n in graph.nodes:
        for m in mutated_inputs(n):
            mutated_anywhere.add(m)
            if m in readers_of:
                mutations.setdefault(m, []).append(n)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    for source in sorted(readers_of, key=pos.__getitem__):
        versions: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for reader in sorted(set(readers_of[source]), key=pos.__getitem__):
            earlier = [m for m in mutations.get(source, []) if pos[m] < pos[reader]]
            versions.setdefault(earlier[-1] if earlier else source, []).append(reader)
        if len(versions) == 1 and source not in mutations:
            # A detach of a Partial value (``return loss.detach()``, made after the optimizer step) holds
            # the same numbers as what it detaches: average that as soon as it exists.
            read = source
            while read.target in _ALIASES and read.args[0] not in mutated_anywhere and partial(read.args[0]):
                read = read.args[0]
            collective, wait = _average(graph, read, read, group_name, world_size)
            group = next(iter(versions.values()))
            group[0].prepend(wait)
            for reader in group:
                reader.replace_input_with(source, wait)
            reductions.append(Reduction(source, collective, wait, False))
            continue
        for version, group in versions.items():
            collective, wait = _average(graph, source, version, group_name, world_size)
            group[0].prepend(wait)
            for reader in group:
                reader.replace_input_with(source, wait)
            reductions.append(Reduction(source, collective, wait, False))
    graph.lint()
    gm.recompile()
    order = {n: i for i, n in enumerate(graph.nodes)}
    reductions.sort(key=lambda r: order[r.collective])
    log.debug("inserted %d all-reduces: %s", len(reductions), [(r.source.name, r.gradient) for r in reductions])
    return reductions
