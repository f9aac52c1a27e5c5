"""Grad mode and autocast in a graph the block split cuts: where nodes may move, and the graph in submodule order.

NOTE [grad mode and autocast across cuts]
A Dynamo graph holds the calls that switch grad mode (``torch._C._set_grad_enabled``, from ``torch.no_grad()``
or ``@torch.no_grad()``) and autocast (``_enter_autocast`` / ``_exit_autocast``) for the nodes after them.
``split_module`` carries a region that spans cuts into each submodule it reaches (the switch again at the start
of each later submodule, an autocast exited at the end of each but its last), and for that needs each
submodule's nodes to come after the previous one's in graph order: it asserts "autocast or set_grad_enabled
require monotonically increasing partitions" otherwise.  The split's only nodes out of that order are those
moved to their readers after the blocks (NOTE [values that would cross a cut]).  Such a node moves only where
it then runs under the grad mode and autocast it ran under at its place (:func:`states_before`; transformers'
Llama computes its rotary embedding under ``torch.no_grad()`` with autocast off, between FSDP2's root
all-gather and the first layer), and where the graph has such switches, the graph cut is a copy in submodule
order (:func:`in_submodule_order`: each moved node just before the first node of its submodule, the others in
their order).  A graph whose submodules still do not follow one another, or that ``split_module`` cannot cut
for another reason, is compiled whole, logged with the reason: the block split never fails a compile.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .. import _compat


def _switches(nodes: list[torch.fx.Node]) -> bool:
    targets = [t for t in _compat.global_state_functions() if t is not None]
    return any(n.op == "call_function" and any(n.target is t for t in targets) for n in nodes)


def states_before(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, Any] | None:
    """The grad mode and autocast each node runs under: ``(grad enabled, active autocast entries)``, the grad mode
    before any switch being the current one (Dynamo compiles under the frame's grad mode, which it guards), an
    autocast entry by its ``_enter_autocast`` node.  None when the graph switches neither."""
    if not _switches(nodes):
        return None
    enter, exit_, set_grad = _compat.global_state_functions()
    grad = torch.is_grad_enabled()
    autocast: tuple[torch.fx.Node, ...] = ()
    states: dict[torch.fx.Node, Any] = {}
    for n in nodes:
        states[n] = (grad, autocast)
        if n.op != "call_function":
            continue
        if n.target is set_grad and n.args:
            grad = bool(n.args[0])
        elif n.target is enter:
            autocast = (*autocast, n)
        elif n.target is exit_ and n.args:
            autocast = tuple(a for a in autocast if a is not n.args[0])
    return states


def follows_submodule_order(gm: torch.fx.GraphModule, partition: dict[torch.fx.Node, int]) -> bool:
    """Whether each submodule's nodes come after the previous submodule's in graph order (inputs, attributes and
    the output aside), as ``split_module`` needs where the graph switches grad mode or autocast."""
    highest = -1
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        if partition[n] < highest:
            return False
        highest = partition[n]
    return True


def copied(
    gm: torch.fx.GraphModule, partition: dict[torch.fx.Node, int]
) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, int]]:
    """A copy of Dynamo's graph to change before it is cut (the graph handed to the backend stays as it is),
    and the partition of its nodes: the same node names, metadata, inputs' sources and parameter sources."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    new_output = next(n for n in reversed(graph.nodes) if n.op == "output")
    new_output.meta = dict(output.meta)
    env[output] = new_output
    for old, new in env.items():
        if old.op == "placeholder":  # Dynamo's sources of its inputs, which AOTAutograd reads
            new._dynamo_source = getattr(old, "_dynamo_source", None)  # type: ignore[attr-defined]
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source  # type: ignore[assignment]
    return copy, {env[n]: p for n, p in partition.items()}


def in_submodule_order(gm: torch.fx.GraphModule, partition: dict[torch.fx.Node, int]) -> bool:
    """Reorder ``gm``'s nodes (a copy: :func:`copied`) by submodule, each submodule's nodes in their graph order:
    the inputs and attributes first, the output last; whether that order is one the graph can run in (each node
    after its arguments).  Only nodes moved to a later submodule change place."""
    nodes = list(gm.graph.nodes)
    rank = {"placeholder": 0, "get_attr": 1, "output": 3}
    order = sorted(
        range(len(nodes)),
        key=lambda i: (rank.get(nodes[i].op, 2), partition[nodes[i]] if nodes[i].op not in rank else 0, i),
    )
    previous = None
    for i in order:
        if previous is not None:
            previous.append(nodes[i])
        previous = nodes[i]
    try:
        gm.graph.lint()
    except RuntimeError:  # a node would come before an argument: a submodule reads a later one
        return False
    gm.recompile()
    return True
