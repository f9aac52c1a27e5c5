"""Where a compiled-autograd backward graph is cut: at the AOTAutograd backwards compiled autograd copied into it.

NOTE [compiled-autograd backward compiled once per block]
Under compiled autograd the backward is one more graph: compiled autograd
copies the backward graph of every AOTAutograd forward it meets (one per
submodule of the forward's block split, NOTE [blocks compiled once]) into a
graph of its own, each copy after a call of its prologue
(``call_aot_bwd_prologue``: the saved tensors and gradients unpacked), and
Dynamo traces that graph for the backend.  Blocks that ran one forward compile
therefore leave identical copies: this module cuts the graph before each
prologue, so each segment is one AOTAutograd backward, the subclass wrapping of
its gradients (``make_subclass``) and what runs before the next one (hooks,
gradient accumulation), and :func:`~dynamo_ext.blocks.split.compile_blocks`
compiles each distinct segment once.  The nodes before the first prologue
join the first segment.

The cuts depend only on the graph's ops, the same on every rank whose graph
is the same.  Each segment is compiled on its own, so the bucketing pass groups
one block's gradient reductions, never two blocks' (as with per-block
compilation, and as the forward split).  The graph has no autograd of its own (it is the backward), so a
segment's inputs and outputs are plain values passed on in order; its
in-place updates (gradient accumulation) run where they ran, in the same
order.  Sizes compiled autograd made symbolic stay symbolic: two segments
share a compile when their inputs have the same size expressions, or differ
only in which symbols they carry (:func:`~dynamo_ext.blocks.split.structural_key`,
NOTE [blocks that differ only in their size symbols]).

Compiled autograd passes its saved tensors and gradients in one list, which
the backend sees unpacked (Dynamo's ``flatten_graph_inputs``: a ``GmWrapper``
over the graph, called with one flat list it may clear).  The graph is cut
with one placeholder per item of that list and one per size symbol of its
inputs (:func:`flat_backward_graph`), and the split graph is called the same
way (:meth:`FlatBackward.boxed`): it takes the list, clears it, and drops each
input after its last use, so the saved activations are still freed as the
backward goes.
"""

from __future__ import annotations

import bisect
import logging
import operator
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from .. import _compat
from ..fx.ops import op_signature

log = logging.getLogger(__name__)


def backward_partition(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int] | None:
    """Each node's segment index in a compiled-autograd backward graph: segment ``k`` runs from the ``k``-th
    AOTAutograd backward's prologue to the next one's (the nodes before the first prologue join segment 0).

    None when the graph copies fewer than two AOTAutograd backwards, or no two segments have the same ops
    (nothing to share).
    """
    nodes = list(gm.graph.nodes)
    starts = [i for i, n in enumerate(nodes) if n.op == "call_function" and _compat.is_aot_backward_prologue(n.target)]
    if len(starts) < 2:
        return None
    ends = [*starts[1:], len(nodes)]
    sigs = Counter(op_signature(gm, nodes[s:e]) for s, e in zip(starts, ends, strict=True))
    if sigs.most_common(1)[0][1] < 2:
        log.info("blocks compiled once: no two of the backward graph's %d AOT backwards have the same ops", len(starts))
        return None
    return {n: max(0, bisect.bisect_right(starts, i) - 1) for i, n in enumerate(nodes)}


class FlatBackward:
    """Dynamo's compiled-autograd graph with one placeholder per item of its list input, then one per size
    symbol of its inputs.

    Attributes:
        gm: the graph; its inputs are the list's items, the graph's other inputs, then the sizes ``sizes`` reads.
        sizes: ``(input index, dim, is_stride)`` of each size placeholder: ``split_module`` passes a symbol to a
            submodule from the node that holds it, which must be a placeholder (a ``sym_size`` node in the
            first submodule would make that submodule depend on itself).
    """

    def __init__(self, gm: torch.fx.GraphModule, sizes: list[tuple[int, int, bool]]) -> None:
        self.gm = gm
        self.sizes = sizes

    def inputs(self, flat_inputs: list[Any]) -> list[Any]:
        """The graph's inputs for ``flat_inputs`` (what Dynamo's wrapper passes): those, then their sizes."""
        return [*flat_inputs, *self._sizes_of(flat_inputs)]

    def _sizes_of(self, flat_inputs: list[Any]) -> list[Any]:
        return [flat_inputs[i].stride(d) if stride else flat_inputs[i].size(d) for i, d, stride in self.sizes]

    def boxed(self, split: torch.fx.GraphModule) -> Callable[[list[Any]], Any]:
        """``split`` called as the graph it replaces: with one list of the inputs, which it clears, so each
        input can be freed after its last use (where FX has the boxed code generator)."""
        codegen = _compat.boxed_codegen()
        if codegen is not None:
            split.graph.set_codegen(codegen)
            split.recompile()

            def call(args: list[Any]) -> Any:
                args.extend(self._sizes_of(args))
                return split(args)

            return call

        def call_unboxed(args: list[Any]) -> Any:
            flat = self.inputs(args)
            args.clear()
            return split(*flat)

        return call_unboxed


def flat_backward_graph(wrapper: Any, flat_inputs: list[Any]) -> FlatBackward | None:
    """Dynamo's compiled-autograd graph under ``wrapper`` (a ``GmWrapper``: its first input a list) taking
    ``flat_inputs`` (the list's items, then the other inputs) and the sizes it needs (:class:`FlatBackward`).

    None when ``wrapper`` is not such a wrapper, the graph reads its list other than item by item, or an
    input's size is an expression over a symbol that no size or stride holds alone.
    """
    gm = getattr(wrapper, "gm", None)
    if not isinstance(gm, torch.fx.GraphModule) or "dynamo_compile_id" not in gm.meta:
        return None
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    output = graph.graph_copy(gm.graph, env)
    graph.output(output)
    for old, new in env.items():  # Dynamo's sources of its inputs, which AOTAutograd reads
        if old.op == "placeholder":
            new._dynamo_source = getattr(old, "_dynamo_source", None)  # type: ignore[attr-defined]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    boxed = len(flat_inputs) - (len(placeholders) - 1)
    first = placeholders[0] if placeholders else None
    if first is None or boxed < 0:
        return None
    items: dict[int, torch.fx.Node] = {}
    for user in first.users:
        index = user.args[1] if len(user.args) == 2 else None
        if user.target is not operator.getitem or not isinstance(index, int) or not 0 <= index < boxed:
            return None
        items[index] = user
    with graph.inserting_before(first):
        for i in range(boxed):
            ph = graph.placeholder(f"{first.name}_{i}")
            ph._dynamo_source = None  # type: ignore[attr-defined]  # an activation or gradient, not a parameter
            if i in items:
                ph.meta = dict(items[i].meta)
                items[i].replace_all_uses_with(ph)
                graph.erase_node(items[i])
            else:
                ph.meta["example_value"] = flat_inputs[i]
    graph.erase_node(first)
    sizes = _size_placeholders(graph)
    if sizes is None:
        log.info("blocks compiled once: a size of the backward graph's inputs has no symbol of its own; compiled whole")
        return None
    flat = torch.fx.GraphModule(gm, graph)
    flat.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        flat._param_name_to_source = gm._param_name_to_source  # type: ignore[assignment]
    return FlatBackward(flat, sizes)


def _size_placeholders(graph: torch.fx.Graph) -> list[tuple[int, int, bool]] | None:
    """Add a placeholder after the others for each size symbol of the inputs no SymInt input holds; what each
    reads (``(input index, dim, is_stride)``), or None when a symbol is only ever part of an expression."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    bound = {v.node.expr for n in placeholders if isinstance(v := n.meta.get("example_value"), torch.SymInt)}
    needed: set[Any] = set()
    sizes: list[tuple[int, int, bool]] = []
    last = placeholders[-1]
    for index, ph in enumerate(placeholders):
        value = ph.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            continue
        needed |= free_symbols(value)
        reads = [(d, False, s) for d, s in enumerate(value.shape)] + [
            (d, True, s) for d, s in enumerate(value.stride())
        ]
        for dim, stride, size in reads:
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol and size.node.expr not in bound:
                with graph.inserting_after(last):
                    last = graph.placeholder(f"{ph.name}_{'stride' if stride else 'size'}_{dim}")
                last.meta["example_value"] = size
                last._dynamo_source = None  # type: ignore[attr-defined]
                bound.add(size.node.expr)
                sizes.append((index, dim, stride))
    return sizes if needed <= bound else None
