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
   mean loss, a Partial value that does not come from a gradient) is reduced
   to its full-batch value (NOTE [full-batch values]) before its readers,
   issued as soon as the value exists (for a ``detach`` of a Partial value,
   as soon as what it detaches exists, so a returned ``loss.detach()`` is
   reduced during the backward).

NOTE [full-batch values]
Step 2 reduces a value the way its layout says the local values combine into
the full-batch one: ``Partial("avg")`` (a mean) is divided by the world size
and summed (the full-batch mean for equal local batch sizes),
``Partial("sum")`` is summed (an integer count stays an integer),
``Partial("max")``/``Partial("min")`` take the maximum/minimum of the local
ones.  Any other Partial (a norm over the batch, ``_NormPartial``) is refused
with a ``ValueError`` naming the node.  Gradients (step 1) are averaged
whatever their layout: that is DDP's contract, not a full-batch value.

NOTE [nonlinear reads of a reduction]
A node that reads a non-gradient reduction over the batch whole (``sqrt`` of
a mean loss, the square of a batch mean) computes on the full-batch value.
When that node's value reaches a gradient, the gradients are those of the
full-batch loss, where DDP's are the average of each rank's local-loss
gradients: the numbers differ, so :func:`insert_reductions` refuses the step
(``ValueError`` naming the node).  Edges into ops that read only a value's
metadata (``ones_like(loss)``, the seed of the backward) do not carry its
value.  Reads whose result only feeds outputs or buffers (a returned
``sqrt`` of the loss, BatchNorm's running statistics) are kept.

NOTE [reduction after in-place updates]
In step 2, a Partial value can be updated in place between two readers.  A
reader sees the value as of its last in-place update before it, so readers are
grouped by that version and each group gets its own all-reduce, issued right
after the update (or the value's creation).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, TypeGuard

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
    op: str = "avg"
    """How the local values combine: ``avg`` (divide by the world size, then sum), ``sum``, ``max``, ``min``."""


_REDUCE_OPS = ("avg", "sum", "max", "min")
# Ops that read only their input's shape, dtype and device, never its values.
_METADATA_ONLY = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("ones_like", "zeros_like", "empty_like", "sym_size", "sym_numel", "sym_stride")
    if hasattr(getattr(torch.ops.aten, name), "default")
)


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
    graph: torch.fx.Graph,
    source: torch.fx.Node,
    after: torch.fx.Node,
    group_name: str,
    world_size: int,
    op: str = "avg",
) -> tuple[torch.fx.Node, torch.fx.Node]:
    """The ``all_reduce`` of ``op`` (``avg``: ``div`` first, then ``sum``) inserted after ``after``.

    Returns ``(collective, wait)`` (the wait not yet placed).
    """
    reduced = source
    if op == "avg":
        with graph.inserting_after(after):
            reduced = after = graph.call_function(torch.ops.aten.div.Tensor, (source, world_size))
        reduced.meta["val"] = source.meta.get("val")
    with graph.inserting_after(after):
        collective = graph.call_function(c10d.all_reduce.default, (reduced, "sum" if op == "avg" else op, group_name))
    with graph.inserting_after(collective):
        wait = graph.call_function(c10d.wait_tensor.default, (collective,))
    collective.meta["val"] = wait.meta["val"] = source.meta.get("val")
    return collective, wait


def _reduce_op(node: torch.fx.Node, layout: Any, reader: str) -> str:
    """How ``node``'s local values combine into its full-batch value (NOTE [full-batch values])."""
    op = getattr(layout, "reduce_op", None)
    if type(layout) is Partial and op in _REDUCE_OPS:
        return op
    raise ValueError(
        f"{reader} reads node {node.name!r} ({node.format_node()}) whole, a reduction over the batch with layout "
        f"{layout!r}, which data_parallel cannot turn into its full-batch value (it reduces {', '.join(_REDUCE_OPS)} "
        "only). Return or use the per-sample values (or their sum, mean, max or min) instead."
    )


def _value_ancestors(targets: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes whose values reach ``targets`` (edges into metadata-only ops such as ``ones_like`` carry none)."""
    seen: set[torch.fx.Node] = set()
    todo = list(targets)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.target not in _METADATA_ONLY:
            todo.extend(n.all_input_nodes)
    return seen


def _refuse_nonlinear_reads(
    readers_of: dict[torch.fx.Node, list[torch.fx.Node]], layouts: dict[str, Any], gradients: list[torch.fx.Node]
) -> None:
    """NOTE [nonlinear reads of a reduction]: a gradient must not depend on a full-batch value."""
    feeds_gradient = _value_ancestors(gradients)
    for source, readers in readers_of.items():
        for reader in readers:
            if reader in feeds_gradient:
                raise ValueError(
                    f"node {reader.name!r} ({reader.format_node()}) reads {source.name!r}, a reduction over the "
                    f"batch ({layouts.get(source.name)!r}), as a whole value, and the gradients depend on the "
                    "result: the step's loss is not a sum or mean over samples (e.g. the sqrt of a mean squared "
                    "error, or a function of a batch mean). DistributedDataParallel would apply it to each rank's "
                    "local value and average the gradients; data_parallel would apply it to the full-batch value, "
                    "so the parameters would differ from DDP's. Make the loss a sum or mean of per-sample terms "
                    "(apply the nonlinearity per sample), or train this step with DistributedDataParallel."
                )


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
    """Average across ranks every Partial gradient, and reduce every other Partial value read whole.

    NOTE [DDP's averaging], NOTE [full-batch values].

    Args:
        gm: the traced step (see :mod:`.step_trace`).
        layouts, reduce_before, local_reads: from :func:`.batch_dim.analyze_step`.
        gradients: the nodes of the parameters' accumulated gradients.
        group_name: the data-parallel process group's name.
        world_size: its size.

    Returns:
        The inserted reductions, in graph order of their collectives.

    Raises:
        ValueError: a gradient depends on a reduction over the batch read whole
            (NOTE [nonlinear reads of a reduction]); a reduction read whole has a
            layout with no full-batch reduction (a norm over the batch).
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    local_edges = {(by_name[r], by_name[i]) for r, ins in local_reads.items() for i in ins}
    reductions = []

    def partial(n: Any) -> TypeGuard[torch.fx.Node]:
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
    pos = {n: i for i, n in enumerate(graph.nodes)}
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    returned: dict[torch.fx.Node, int] = {}
    for k, a in enumerate(output.args[0]):
        if a in still:
            readers_of.setdefault(a, []).append(output)
            returned.setdefault(a, k)
    _refuse_nonlinear_reads(readers_of, layouts, gradients)
    ops = {}
    for source, readers in readers_of.items():
        first = min(readers, key=pos.__getitem__)
        who = f"output #{returned[source]} of the step" if source in returned else f"node {first.name!r}"
        ops[source] = _reduce_op(source, layouts.get(source.name), who)
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
            collective, wait = _average(graph, read, read, group_name, world_size, ops[source])
            group = next(iter(versions.values()))
            group[0].prepend(wait)
            for reader in group:
                reader.replace_input_with(source, wait)
            reductions.append(Reduction(source, collective, wait, False, ops[source]))
            continue
        for version, group in versions.items():
            collective, wait = _average(graph, source, version, group_name, world_size, ops[source])
            group[0].prepend(wait)
            for reader in group:
                reader.replace_input_with(source, wait)
            reductions.append(Reduction(source, collective, wait, False, ops[source]))
    graph.lint()
    gm.recompile()
    order = {n: i for i, n in enumerate(graph.nodes)}
    reductions.sort(key=lambda r: order[r.collective])
    log.debug("inserted %d all-reduces: %s", len(reductions), [(r.source.name, r.gradient) for r in reductions])
    return reductions
