"""Post-grad pass: an ``invoke_subgraph`` body never returns its own input (or a view of it) to Inductor.

NOTE [subgraph outputs that alias inputs]
When AOTAutograd partitions a region called through ``invoke_subgraph`` (block
reuse, NOTE [block reuse]; ``torch.compiler.nested_compile_region``), the
forward body returns the activations its backward needs, and an input of the
body is often one of them: the body returns its input placeholder unchanged.
Inductor 2.13 lowers each call's outputs as new buffers and does not know that
one of them is the caller's input buffer, so it reuses that input buffer for a
later result while the output still reads it: the saved activation is
overwritten before the backward reads it and the gradients come out wrong
(measured: a 3-block model compiled with stock ``use_graph_deduplication`` and
``backend="inductor"``, the last block's first weight gradient off by 0.04).
This pass makes every such output a copy (``aten.clone``), so it owns its
storage; the cost is one copy of a block input per block.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from ..fx.nodes import is_invoke_subgraph
from .graph_edit import call
from .registry import package_sources


def _aliased_input(node: Any) -> bool:
    """Whether ``node`` is a placeholder or a chain of view ops over one."""
    while node.op == "call_function" and getattr(node.target, "is_view", False) and node.args:
        node = node.args[0]
    return node.op == "placeholder"


def copy_aliased_outputs(gm: torch.fx.GraphModule) -> int:
    """Replace each output of ``gm`` that is (a view of) an input by a clone of it; returns how many.

    Args:
        gm: a post-grad graph module (an ``invoke_subgraph`` body) whose nodes carry ``meta["val"]``.
    """
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = output.args[0]
    flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    copied = 0
    for i, value in enumerate(flat):
        if isinstance(value, torch.fx.Node) and _aliased_input(value):
            with gm.graph.inserting_before(output):
                flat[i] = call(gm.graph, torch.ops.aten.clone.default, (value,), value)
            copied += 1
    if copied:
        output.args = (type(outs)(flat) if isinstance(outs, (list, tuple)) else flat[0],)
        gm.recompile()
    return copied


def copy_subgraph_outputs(graph: torch.fx.Graph) -> int:
    """Apply :func:`copy_aliased_outputs` to the body of every ``invoke_subgraph`` call in ``graph``."""
    owner = graph.owning_module
    if owner is None:
        return 0
    bodies = {}
    for node in graph.nodes:
        if is_invoke_subgraph(node) and node.args and node.args[0].op == "get_attr":
            body = getattr(owner, str(node.args[0].target), None)
            if isinstance(body, torch.fx.GraphModule):
                bodies[id(body)] = body
    return sum(copy_aliased_outputs(body) for body in bodies.values())


class SubgraphOutputCopyPass(_compat.custom_graph_pass_base()):  # type: ignore[misc]
    """Post-grad pass of NOTE [subgraph outputs that alias inputs]."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        copy_subgraph_outputs(graph)

    def uuid(self) -> Any:
        return _compat.hash_for_files(package_sources())  # NOTE [pass identity covers the lowerings]
