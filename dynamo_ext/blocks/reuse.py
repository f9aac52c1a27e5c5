"""Identical blocks compiled once inside the one graph (``dynamo_ext.config.block_reuse``).

NOTE [block reuse]
The plugin traces a model with FSDP2 and TP into one graph, so a model of N
identical blocks hands AOTAutograd and Inductor N copies of the block.  With
``config.block_reuse`` on, Dynamo's graph deduplication
(``torch._dynamo.graph_deduplication``) runs on each graph the plugin traces:
nodes created by the same line of code on operands of the same metadata are
grouped, the groups are grown into the largest identical regions, and each
region group becomes one subgraph called by ``invoke_subgraph`` at every
place.  AOTAutograd traces that subgraph's forward and backward once (its
``invoke_subgraph`` cache) and Inductor compiles it once.  Dynamo itself still
interprets every block's bytecode: the saving is in AOTAutograd and Inductor.

What may sit inside a region is restricted (:func:`region_refusal`) to what
``invoke_subgraph`` carries on torch 2.11-2.15 and to what keeps the
collectives' contract simple:

* no tensor subclass (DTensor) operand or result: ``invoke_subgraph`` takes
  plain tensors only (on 2.13 a DTensor operand reaches the subgraph as its
  local tensor and the region's ``to_local`` fails);
* no higher-order op call (FSDP2's gather is an ``autograd.Function`` inside an
  activation checkpoint): the region would take the op's body as an input,
  which deduplication cannot do;
* no collective and no ``wait_tensor``: FSDP2's all-gathers (and, through
  their backward, its reduce-scatters) and TP's collectives stay in the outer
  graph, just outside the regions.  The bucketing pass then sees every
  collective where it decides (a bucket never spans a region: nothing of a
  region is a collective), and the collective check fingerprints them in
  graph order as before (it also descends into ``invoke_subgraph`` bodies).

NOTE [block reuse under compiled autograd]
Compiled autograd inlines AOTAutograd's backward graph into its own and traces
that with Dynamo, which refuses a bare ``invoke_subgraph`` call (2.13:
"Directly using invoke_subgraph is not supported").  Handing it a copy of the
backward with the calls inlined failed in Dynamo's input handling of the
compiled-autograd graph, so such a backward is refused with an error that
says what to do (``extract_bw_module`` patched): block reuse is for a backward
run by the autograd engine.

So for FSDP2 the region is the block's compute between its gathers.  Under TP
the block's compute is DTensor code: only its plain-tensor stretches (norms,
residual adds) are shared, which saves little.  A block whose ops match no
other block (another shape, dtype, placement or code path) stays inline; an
INFO line names it with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from .. import _compat, config
from .._patching import Patcher
from ..fx import collectives as fx_collectives
from ..fx.nodes import container_item, example_value, is_invoke_subgraph

log = logging.getLogger(__name__)

HIGHER_ORDER_OP = "a higher-order op (checkpoint, autograd.Function) whose body a region cannot take as an input"
SUBCLASS = "a DTensor (tensor subclass) operand or result; invoke_subgraph takes plain tensors"
COLLECTIVE = "a collective, kept in the outer graph for the bucketing pass and the collective check"


def region_refusal(node: Any) -> str | None:
    """Why a node of a Dynamo graph may not sit inside a reused region (NOTE [block reuse]); None when it may.

    Args:
        node: a ``torch.fx.Node`` of the graph Dynamo is building (``meta["example_value"]`` on its operands).
    """
    from torch.utils._pytree import tree_leaves

    if any(a.op == "get_attr" for a in node.all_input_nodes):
        return HIGHER_ORDER_OP
    if _communicates(node):
        return COLLECTIVE
    for n in (node, *node.all_input_nodes):
        if any(_compat.is_traceable_subclass(v) for v in tree_leaves(example_value(n))):
            return SUBCLASS
    return None


def _communicates(node: Any) -> bool:
    """A collective or a wait (NOTE [one collective reader]), or a ``torch.distributed`` function Dynamo kept."""
    if node.op != "call_function":
        return False
    if fx_collectives.is_collective(node) or fx_collectives.is_wait(node):
        return True
    return (getattr(node.target, "__module__", None) or "").startswith("torch.distributed")


def block_of(node: Any) -> str | None:
    """The outermost module path of ``node`` that is an item of a container (``layers[2]``, ``blocks.0``); None."""
    item = container_item(node)
    return None if item is None else item[0]


def _drop_refused(tracker: Any) -> dict[Any, str]:
    """Take the nodes :func:`region_refusal` refuses out of ``tracker``'s groups of identical nodes."""
    refused = {}
    for node, duplicates in list(tracker.node_to_duplicates.items()):
        reason = region_refusal(node)
        if reason is not None:
            refused[node] = reason
            duplicates.remove(node)
            del tracker.node_to_duplicates[node]
    return refused


def _log_blocks(graph: Any, groups: list[list[list[Any]]], refused: dict[Any, str]) -> None:
    """One DEBUG line for the regions found, an INFO line per block left inline (and why)."""
    in_region = {n for group in groups for region in group for n in region}
    per_block: dict[str, list[Any]] = defaultdict(list)
    for node in graph.nodes:
        block = block_of(node) if node.op in ("call_function", "call_method", "call_module") else None
        if block is not None:
            per_block[block].append(node)
    log.debug(
        "block reuse: %d region group(s): %s", len(groups), ", ".join(f"{len(g)} x {len(g[0])} nodes" for g in groups)
    )
    for block, nodes in per_block.items():
        if any(n in in_region for n in nodes):
            continue
        reasons = sorted({refused[n] for n in nodes if n in refused})
        if len(reasons) and all(n in refused for n in nodes):
            why = "every op of it is " + "; or ".join(reasons)
        else:
            why = "its ops match no other block's (another shape, dtype, placement or code path)"
            if reasons:
                why += "; the rest of it is " + "; or ".join(reasons)
        log.info("block reuse: block %s traced inline: %s", block, why)


def _filtered(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_identical_regions(self: Any, graph: Any) -> Any:
        refused = _drop_refused(self)
        groups = original(self, graph)
        if config.block_reuse:
            _log_blocks(graph, groups, refused)
        return groups

    return get_identical_regions


def _dedup_when_on(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dedup_pass(self: Any) -> Any:
        if config.block_reuse:
            return _compat.apply_graph_deduplication(self)
        return original(self)

    return dedup_pass


def _tracking_when_on(original: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    @functools.wraps(original)
    def compile_frame(*args: Any, **kwargs: Any) -> Any:
        # Dynamo hashes every node it creates for deduplication only while this flag is on: a cost paid
        # only by the compiles that use it.
        on = config.block_reuse
        ctx = torch._dynamo.config.patch(track_nodes_for_deduplication=True) if on else contextlib.nullcontext()
        with ctx:
            return original(*args, **kwargs)

    return compile_frame


def install(patches: Patcher) -> None:
    """Route Dynamo's graph deduplication through the region filter; a no-op on releases without it."""
    tracker = _compat.graph_region_tracker_class()
    if tracker is None:
        log.debug("block reuse: this torch release has no graph deduplication into invoke_subgraph")
        return
    patches.setattr(tracker, "get_identical_regions", _filtered(tracker.get_identical_regions))
    output_graph = _compat.output_graph_class()
    patches.setattr(output_graph, "dedup_pass", _dedup_when_on(output_graph.dedup_pass))
    convert_frame = _compat.dynamo_convert_frame()
    patches.setattr(convert_frame, "_compile", _tracking_when_on(convert_frame._compile))
    compiled_autograd = _compat.compiled_autograd_module()
    if compiled_autograd is not None:
        patches.setattr(
            compiled_autograd,
            "extract_bw_module",
            _refused_under_compiled_autograd(compiled_autograd.extract_bw_module),
        )


def _refused_under_compiled_autograd(original: Callable[..., Any]) -> Callable[..., Any]:
    """NOTE [block reuse under compiled autograd]: a backward with shared regions is refused, in words."""

    @functools.wraps(original)
    def extract_bw_module(compiled_function: Any) -> Any:
        bw = original(compiled_function)
        graph = getattr(bw, "graph", None)
        if graph is not None and any(is_invoke_subgraph(n) for n in graph.nodes):
            raise RuntimeError(
                "dynamo-ext block reuse: this backward calls shared block regions (invoke_subgraph), which "
                "compiled autograd cannot trace on this torch release. Compile the forward with "
                "dynamo_ext.config.block_reuse = False when its backward runs under compiled autograd, or run "
                "the backward without compiled autograd."
            )
        return bw

    return extract_bw_module
