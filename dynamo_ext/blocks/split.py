"""Identical blocks compiled once: the one Dynamo graph split at block boundaries, one compile per distinct block.

NOTE [blocks compiled once]
The plugin traces an FSDP2 (+ TP) model into one Dynamo graph, so AOTAutograd
and Inductor would see every one of its N identical blocks.  Where Dynamo
hands that graph to ``inductor`` (``compile_fx``) or to an AOTAutograd backend
(``AotAutograd.__call__``: ``aot_eager``, ``aot_autograd(...)``), this module
cuts it at the boundaries of the items of its longest module container
(``layers[0]``, ``layers[1]``, ...) into submodules run in order, as
DDPOptimizer cuts at its buckets, and compiles each with that backend; a
submodule identical to one already compiled (:func:`structural_key`: the same
nodes, targets and constants, inputs of the same metadata, the same aliasing
among them) runs that compile instead of a new one.  AOTAutograd and Inductor
then pay for one block whatever the depth.  Dynamo still traces every block
(one frame, one set of guards, no graph break), and a custom backend still
receives the one graph whole.  With ``config.reuse_block_compiles`` off every
submodule is compiled (the audit's setting: NOTE [the audit compiles each block]).

Where the cuts are depends only on the graph's ops (their order and targets,
not shapes), the same on every rank of a job whose ranks trace the same graph
(the collective check compares them); which compile a submodule runs may
differ between ranks (an uneven shard makes one rank's block differ), but two
submodules share a compile only when their graphs are identical, so each rank
runs the collectives its graph holds.  The bucketing pass and the fusion
lowerings see one submodule at a time: a bucket never crosses a block boundary
(as with per-block compilation).

Each submodule's outputs for the next are the fake values Dynamo traced for
them, made fakes of the backend's fake mode, or, where they alias an input or
each other, come from running it on fake inputs (NOTE [a submodule's outputs
from the trace]); eager's strides either way (Inductor keeps a graph's output
strides).  Not from a "fakified" first call of its compile as DDPOptimizer's
``SubmodCompiler`` does: that call saves the opaque objects of a graph (a process group) in
fake mode, and it keeps AOTAutograd from caching the compile.  Each compile
runs in its own copy of Dynamo's ``TracingContext`` (``own_tracing_context``):
AOTAutograd keeps that context for the backward it compiles lazily, which
then reads its own forward's metadata.  The backward runs as one compiled
backward per submodule, chained by autograd; a shared compile's backward is
compiled once.  Under compiled autograd the backward graph is cut at its
copies of these compiles' backwards (NOTE [compiled-autograd backward compiled
once per block]).
"""

from __future__ import annotations

import bisect
import functools
import logging
import operator
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

from .. import _compat, config
from .._patching import Patcher
from ..fx.nodes import container_item, is_invoke_subgraph, static_layout, traced_outputs
from ..fx.ops import op_signature
from .split_backward import backward_partition, flat_backward_graph
from .split_floats import compile_keeping_floats, float_symbols, floats_cross_cuts, floats_into_readers, twin_floats
from .split_key import structural_key
from .split_state import copied, follows_submodule_order, in_submodule_order, states_before
from .symbols import input_symbols, may_rename

log = logging.getLogger(__name__)


def block_partition(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int] | None:
    """Each node's submodule index: 0 before the first block, ``i + 1`` for block ``i``, then one after the last.

    The blocks are the items of the container with the most items in the graph's module stacks; block ``i``
    runs from its first node to the first node of block ``i + 1`` and the last block over as many nodes as the
    one before it when their ops are the same (so trailing nodes without a module stack stay with it).  None
    when the graph has no container of at least two items whose ops repeat, or its blocks do not follow
    one another in graph order.
    """
    nodes = list(gm.graph.nodes)
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    for i, n in enumerate(nodes):
        if n.op in ("placeholder", "output"):
            continue
        found = container_item(n)
        if found is not None:
            item = found[1:]
            first.setdefault(item, i)
            last[item] = i
    per_container = Counter(c for c, _ in first)
    if not per_container:
        return None
    container, count = per_container.most_common(1)[0]
    if count < 2:
        return None
    items = sorted((first[k], last[k], k[1]) for k in first if k[0] == container)
    starts = [s for s, _, _ in items]
    ends = [starts[i + 1] for i in range(len(items) - 1)]
    # The last block: as long as the one before it when their ops agree, else up to its own last node.
    prev_len = ends[-1] - starts[-2]
    tail = nodes[starts[-1] : starts[-1] + prev_len]
    if len(tail) == prev_len and op_signature(gm, tail) == op_signature(gm, nodes[starts[-2] : ends[-1]]):
        ends.append(starts[-1] + prev_len)
    else:
        ends.append(items[-1][1] + 1)
    for (_, last_node, _), end in zip(items, ends, strict=True):
        if last_node >= end:  # a block's node after the next block began: not one block after another
            log.info("blocks compiled once: %s's blocks interleave in the graph; compiled as one graph", container)
            return None
    sigs = Counter(op_signature(gm, nodes[s:e]) for s, e in zip(starts, ends, strict=True))
    if sigs.most_common(1)[0][1] < 2:
        log.info("blocks compiled once: no two of %s's %d blocks have the same ops; one graph", container, count)
        return None
    # Submodule 0 before the first block, k + 1 for block k (blocks abut: ends[k] == starts[k + 1]), then one more.
    partition: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(nodes):
        partition[n] = 0 if i < starts[0] else len(starts) + 1 if i >= ends[-1] else bisect.bisect_right(starts, i)
    _sink_into_consumers(nodes, partition)
    return partition


def _sink_into_consumers(nodes: list[torch.fx.Node], partition: dict[torch.fx.Node, int]) -> None:
    """Move each pure node before the first block whose users all sit in one submodule after the first block
    (the part after the blocks, for FSDP2's root parameters) into that one.

    NOTE [values that would cross a cut]
    A value made before the blocks and read only after them (FSDP2's root gathers its parameters in its
    pre-forward, the output projection reads them at the end) would be an output of the first submodule and
    an input of the last: the last one's backward would save it, where the one graph's partitioner
    recomputes it (FSDP2's re-gather in backward).  Moved to its reader, it is recomputed there as before.
    A node read on both sides stays, and so do the items of a tuple it makes (a higher-order op's outputs, a
    ``split``'s): a cut carries tensors only.  (So FSDP2's root, whose modules run on both sides, gathers its
    parameters one by one: NOTE [FSDP2 gathers per group].)
    Only nodes without side effects move (``Node.is_impure``: no random op, no in-place method), and only where
    they run under the grad mode and autocast of their place (NOTE [grad mode and autocast across cuts]); the
    moves depend on the graph's ops alone, the same on every rank.
    """
    states = states_before(nodes)
    first: dict[int, torch.fx.Node] = {}
    for n in nodes:
        first.setdefault(partition[n], n)
    moved: set[torch.fx.Node] = set()
    for n in reversed(nodes):
        if partition[n] != 0 or not n.users or n.op not in ("call_function", "call_method", "get_attr"):
            continue
        if n.is_impure() or (n.op == "call_method" and str(n.target).endswith("_")):
            continue
        readers = {partition[u] for u in n.users}
        if len(readers) == 1 and (target := readers.pop()) > 1:  # not into the first block: it reads h anyway
            if states is None or states[n] == states[first[target]]:  # it runs just before that submodule's first
                partition[n] = target
                moved.add(n)
    # A tuple (a higher-order op's outputs) never becomes a cut's value: an item moved without it goes back.
    for n in moved:
        if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) and n.args[0] not in moved:
            partition[n] = partition[n.args[0]]


_state = threading.local()


class _Compiled(torch.nn.Module):
    """A submodule's compiled callable, called as the submodule was (a single output unwrapped)."""

    def __init__(self, fn: Callable[..., Any], single_output: bool, symbols: list[Any]) -> None:
        super().__init__()
        self.fn = fn
        self.single_output = single_output
        self.symbols = symbols  # the size symbols of the inputs it was compiled for

    def forward(self, *args: Any) -> Any:
        out = self.fn(*args)
        return out[0] if self.single_output else out


def _returns_tuple(sub: torch.fx.GraphModule) -> bool:
    """Make ``sub`` return a tuple (what AOTAutograd compiles); whether it returned a single value."""
    output = next(n for n in reversed(sub.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], tuple | list):
        return False
    output.args = ((output.args[0],),)
    sub.recompile()
    return True


def compile_blocks(
    gm: torch.fx.GraphModule,
    partition: dict[torch.fx.Node, int],
    example_inputs: list[Any],
    compile_one: Callable[[torch.fx.GraphModule, list[Any]], Any],
) -> torch.fx.GraphModule | None:
    """Split ``gm`` by ``partition`` and compile each submodule with ``compile_one``, once per structural key.

    Submodules are visited in order with fake values: each one's outputs are Dynamo's fake values of them, or
    come from running it on its fake inputs (``fx.nodes.traced_outputs``), before it is compiled (their strides are
    eager's; Inductor keeps a graph's output strides, ``keep_output_stride``), and each compile runs in its own copy of Dynamo's ``TracingContext``, so the
    forward metadata AOTAutograd leaves there is the one its lazily compiled backward reads; the tensorify pass
    leaves the other submodules' floats alone (NOTE [dynamic floats in the block split]).  Returns the split
    GraphModule, each ``call_module`` calling a compiled callable, or None (logged) when ``split_module`` cannot
    cut ``gm``: the caller compiles it whole.
    """
    split = _cut(gm, partition)
    if split is None:
        return None
    graph_floats = float_symbols(gm.graph.nodes)
    twins = twin_floats([m for m in split.children() if isinstance(m, torch.fx.GraphModule)])
    fake_mode = _compat.fake_mode_of(example_inputs)
    compiled: dict[Any, _Compiled] = {}
    compiles = reused = 0
    env: dict[torch.fx.Node, Any] = {}
    inputs = iter(_compat.to_fake(fake_mode, x) for x in example_inputs)
    _state.splitting = True
    try:
        with _compat.saved_tensors_hooks_off_during_tracing():
            for n in split.graph.nodes:
                if n.op == "placeholder":
                    env[n] = next(inputs)
                elif n.op == "call_module":
                    sub = split.get_submodule(str(n.target))
                    assert isinstance(sub, torch.fx.GraphModule)  # split_module makes each a GraphModule
                    args = [env[a] for a in n.args]
                    key = structural_key(sub, args) if config.reuse_block_compiles else None
                    single = _returns_tuple(sub)
                    out = traced_outputs(sub, fake_mode)
                    if out is None:
                        with _compat.allowing_non_fake_inputs(fake_mode):
                            out = sub(*args)
                    env[n] = out[0] if single else out
                    hit = None if key is None else compiled.get(key)
                    symbols = input_symbols(args)
                    if hit is not None and hit.symbols != symbols and not may_rename(args, hit.symbols, symbols):
                        hit = None
                    if hit is None:
                        with _compat.own_tracing_context():
                            fn, pinned = compile_keeping_floats(compile_one, sub, args, graph_floats, twins)
                        hit = _Compiled(fn, single, symbols)
                        if key is not None and not pinned:
                            compiled.setdefault(key, hit)
                        compiles += 1
                    else:
                        reused += 1
                        log.debug("blocks compiled once: %s runs the compile of an identical submodule", n.target)
                    setattr(split, str(n.target), hit)
                elif n.op == "call_function":
                    fn_args, fn_kwargs = map_arg((n.args, n.kwargs), lambda a: env[a])
                    env[n] = n.target(*fn_args, **fn_kwargs)
    finally:
        _state.splitting = False
    split.recompile()
    log.info(
        "blocks compiled once: %s%d submodules, %d compiled, %d running an identical block's compile%s",
        "compiled-autograd backward, " if _compat.compiling_compiled_autograd_graph() else "",
        compiles + reused,
        compiles,
        reused,
        "" if config.reuse_block_compiles else " (config.reuse_block_compiles off)",
    )
    return split


def _cut(gm: torch.fx.GraphModule, partition: dict[torch.fx.Node, int]) -> torch.fx.GraphModule | None:
    """``split_module``'s cut of ``gm`` (partitions in topological order) with Dynamo's sources and metadata on
    each submodule, or None, logged with the reason, where it cannot cut it (NOTE [grad mode and autocast across
    cuts])."""
    from torch.fx.passes.split_module import split_module

    try:
        split = split_module(gm, gm, lambda n: partition[n])
        _, propagate_dynamo_source, propagate_metadata = _compat.ddp_submod_compiler()
        propagate_dynamo_source(gm, split)
        propagate_metadata(gm, split)
    except Exception as e:  # whatever split_module refuses (an assertion, a cycle), the graph compiles whole
        log.warning(
            "blocks compiled once: the graph cannot be cut at its blocks (%s: %s); compiled whole", type(e).__name__, e
        )
        return None
    return split


def _prepared(
    gm: torch.fx.GraphModule, partition: dict[torch.fx.Node, int]
) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, int]] | None:
    """The graph to cut and its partition: ``gm``, or a copy in which each SymFloat a later submodule reads is made
    again there (NOTE [dynamic floats in the block split]) and, where the graph switches grad mode or autocast,
    the nodes are in submodule order (NOTE [grad mode and autocast across cuts]); None to compile ``gm`` whole."""
    floats = floats_cross_cuts(gm, partition)
    switches = states_before(list(gm.graph.nodes)) is not None
    if not floats and (not switches or follows_submodule_order(gm, partition)):
        return gm, partition
    gm, partition = copied(gm, partition)
    if floats:
        log.debug("blocks compiled once: %d scalar nodes made again where read", floats_into_readers(gm, partition))
    if switches and not in_submodule_order(gm, partition):
        log.info(
            "blocks compiled once: grad mode or autocast switches, and no order of the graph puts its blocks one after another; compiled whole"
        )
        return None
    return gm, partition


def _dynamic_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not static_layout(value)


def _plan(gm: Any, example_inputs: Any) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, int], Any] | None:
    """How a graph handed to a backend entry is split: ``(graph, partition, flat)`` where ``flat`` is None or,
    for a compiled-autograd backward, the :class:`FlatBackward` whose graph is ``graph``; or None to compile the
    graph whole."""
    if not config.compile_blocks_once or getattr(_state, "splitting", False):
        return None
    ctx = _compat.tracing_context()
    if ctx is None or getattr(ctx, "ddp_optimizer_ctx", None) is not None:  # no Dynamo, or DDPOptimizer's split
        return None
    if any(isinstance(x, list | tuple | dict) for x in example_inputs):
        return None  # handed back unpacked (Dynamo's flatten_graph_inputs)
    if _compat.compiling_compiled_autograd_graph():  # NOTE [compiled-autograd backward compiled once per block]
        flat = flat_backward_graph(gm, example_inputs)
        if flat is None or any(is_invoke_subgraph(n) for n in flat.gm.graph.nodes):
            return None
        partition = backward_partition(flat.gm)
        return None if partition is None else (flat.gm, partition, flat)
    if not isinstance(gm, torch.fx.GraphModule) or "dynamo_compile_id" not in gm.meta:
        return None  # not a graph Dynamo traced (export, a direct compile_fx call)
    if any(isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool) or _dynamic_tensor(x) for x in example_inputs):
        log.info("blocks compiled once: the graph has dynamic-shape inputs; compiled whole")
        return None
    if any(is_invoke_subgraph(n) for n in gm.graph.nodes):
        log.info("blocks compiled once: the graph already shares regions (invoke_subgraph); compiled whole")
        return None
    partition = block_partition(gm)
    return None if partition is None else (gm, partition, None)


def _split_and_compile(
    gm: Any, example_inputs: Any, compile_one: Callable[[torch.fx.GraphModule, list[Any]], Any]
) -> Any | None:
    """The block split of ``gm`` compiled with ``compile_one``, or None to compile ``gm`` whole."""
    plan = _plan(gm, example_inputs)
    if plan is None:
        return None
    graph, partition, flat = plan
    prepared = _prepared(graph, partition)
    if prepared is None:
        return None
    inputs = list(example_inputs) if flat is None else flat.inputs(list(example_inputs))
    split = compile_blocks(*prepared, inputs, compile_one)
    return split if split is None or flat is None else flat.boxed(split)


def _wrapped_compile_fx(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compile_fx(model_: Any, example_inputs_: Any, *args: Any, **kwargs: Any) -> Any:
        split = _split_and_compile(model_, example_inputs_, lambda g, i: original(g, i, *args, **kwargs))
        return original(model_, example_inputs_, *args, **kwargs) if split is None else split

    return compile_fx


def _wrapped_aot_autograd_call(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(self: Any, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        split = _split_and_compile(gm, example_inputs, lambda g, i: original(self, g, i, **kwargs))
        return original(self, gm, example_inputs, **kwargs) if split is None else split

    return call


def install(patches: Patcher) -> None:
    """Route the graphs Dynamo hands to Inductor and to AOTAutograd's backends through the block split
    (NOTE [blocks compiled once])."""
    module = _compat.compile_fx_module()
    patches.setattr(module, "compile_fx", _wrapped_compile_fx(module.compile_fx))
    owner = _compat.aot_autograd_backend_class()
    patches.setattr(owner, "__call__", _wrapped_aot_autograd_call(owner.__call__))
