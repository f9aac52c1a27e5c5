"""Compiled autograd's copies of AOTAutograd backward graphs, traced by Dynamo as one call each.

NOTE [AOT backward copies traced as one call]
Compiled autograd's capture copies the backward graph of every compiled region
it meets (``proxy_call_aot_backward``: each node renamed ``aot<id>_<name>``) into
its own graph, and Dynamo then traces that graph's generated code instruction by
instruction: about 250 ops a block of the bundled Llama (FSDP over TP), each
interpreted, its fake value computed and wrapped in a ``TensorVariable``: 0.18 s
of the 0.77 s a layer costs the compiled-autograd backward (one process,
``aot_eager``, torch 2.13).  Those ops are already a graph with no Python
between them.

So, when compiled autograd hands its graph to a ``torch.compile`` of it, each
copied region (the nodes named ``aot<id>_...`` after one
``call_aot_bwd_prologue``, without the prologue's own ``getitem`` outputs) is
outlined into a function that runs the region's nodes, marked
``allow_in_graph``: Dynamo traces one call per region, and computes its fake
outputs by running the region on fake inputs, recording every node's fake value
on the way (``_Region.__call__``).  Before Dynamo hands the graph on (in
``OutputGraph.dedup_pass``, before its deferred runtime asserts, its structured
log and the backend), each call is replaced by the region's nodes again, each
with its recorded fake value as ``example_value`` and the metadata Dynamo's
retrace would give it (the fields ``fx.proxy`` copies from an original node,
its stack trace, ``source_fn_stack``).  The backend, the block split, the
bucketing pass and the collective check see the graph tracing op by op gives,
node for node and in the same order; only node names differ (and the name half
of ``source_fn_stack``, the node's own name here), as
``tests/test_aot_backward_calls.py`` checks on the FSDP-over-TP Llama.

A region is left as it is (logged) when it holds a node that is not a
``call_function`` (a ``get_attr`` of a constant, a submodule), a node that
makes data-dependent sizes (``unbacked_bindings``), or when a node between its
first and last reads one of its values (it could not run after the call).  The
outlining happens only when the compiler given to compiled autograd returned
Dynamo's ``OptimizedModule`` of that very graph, so a graph no Dynamo trace will
inline again is never changed.  Switch: ``dynamo_ext.config.outline_aot_backward``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from .. import _compat, config
from .._patching import Patcher

log = logging.getLogger(__name__)

# proxy_call_aot_backward names each copied node f"aot{deduped_aot_id}_{node_name}", the id "3" or "3_1";
# an FX node name starts with a letter or an underscore.
_COPIED_NODE = re.compile(r"^aot(\d+(?:_\d+)?)_(?=[A-Za-z_])")


class _Region:
    """A copied AOT backward graph, outlined: called with the region's inputs, returns its outputs (a tuple).

    ``runs`` keeps, for each call on fake values (Dynamo computing the call's ``example_value``), the value of
    every node of ``module``, keyed by the identities of the arguments, until the call is inlined again.
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self.runs: list[tuple[tuple[Any, ...], dict[Any, Any]]] = []
        self.__name__ = self.__qualname__ = "dynamo_ext_aot_backward"

    def __call__(self, *args: Any) -> Any:
        import torch.fx

        if not _compat.has_fake_tensor(args):  # run for real: Dynamo fell back to running the graph eagerly
            return self.module(*args)
        interpreter = torch.fx.Interpreter(self.module, garbage_collect_values=False)
        out = interpreter.run(*args)
        self.runs.append((_arguments_key(args), dict(interpreter.env)))
        return out

    def take_run(self, args: tuple[Any, ...]) -> dict[Any, Any] | None:
        """The node values of the fake run with these arguments (removed from ``runs``); None without one."""
        key = _arguments_key(args)
        for i, (k, env) in enumerate(self.runs):
            if k == key:
                del self.runs[i]
                return env
        return None


def _arguments_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    import torch

    symbolic = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    return tuple(("id", id(a)) if isinstance(a, symbolic) else ("value", a) for a in args)


def _is_prologue_output(node: Any) -> bool:
    return node.target is operator.getitem and _compat.is_aot_backward_prologue(getattr(node.args[0], "target", None))


def _regions(graph: Any) -> dict[str, list[Any]]:
    """The copied nodes of each AOT backward graph, in graph order, keyed by the deduplicated AOT id."""
    regions: dict[str, list[Any]] = defaultdict(list)
    for node in graph.nodes:
        match = _COPIED_NODE.match(node.name)
        if match and node.op in ("call_function", "get_attr", "call_module") and not _is_prologue_output(node):
            regions[match.group(1)].append(node)
    return regions


def _refusal(nodes: list[Any]) -> str | None:
    """Why ``nodes`` cannot become one call; None when they can."""
    members = set(nodes)
    for node in nodes:
        if node.op != "call_function":
            return f"{node.name} is a {node.op} node"
        if "unbacked_bindings" in node.meta:
            return f"{node.name} makes data-dependent sizes"
    node = nodes[0]
    while node is not nodes[-1]:  # only the span of the region, not the whole graph once per region
        if node not in members and any(arg in members for arg in node.all_input_nodes):
            return f"{node.name}, between the region's nodes, reads one of its values"
        node = node.next
    return None


def outline(gm: Any) -> int:
    """Replace each copied AOT backward graph in compiled autograd's ``gm`` by one call; return how many.

    The graph is changed in place and recompiled.  Raises nothing for a graph without such copies.
    """
    count = 0
    for aot_id, nodes in _regions(gm.graph).items():
        reason = _refusal(nodes)
        if reason is not None:
            log.info("compiled autograd: AOT backward %s traced op by op: %s", aot_id, reason)
            continue
        _outline_region(gm, nodes)
        count += 1
    if count:
        gm.recompile()
        _compat.retraced_from(gm)
        log.debug("compiled autograd: %d AOT backward graphs outlined for Dynamo's trace", count)
    return count


def _outline_region(gm: Any, nodes: list[Any]) -> None:
    """Move ``nodes`` into a ``_Region`` called after the last of them; their readers read the call's outputs."""
    import torch.fx

    graph = gm.graph
    members = set(nodes)
    inputs = list(dict.fromkeys(a for node in nodes for a in node.all_input_nodes if a not in members))
    outputs = [n for n in nodes if any(user not in members for user in n.users)]
    body = torch.fx.Graph()
    env = {a: body.placeholder(a.name) for a in inputs}
    for node in nodes:
        env[node] = body.node_copy(node, env.__getitem__)
    body.output(tuple(env[n] for n in outputs))
    region = _Region(_compat.lazy_graph_module(gm, body))  # its code generated only if it runs for real
    torch.compiler.allow_in_graph(region)
    with graph.inserting_after(nodes[-1]):
        call = graph.call_function(region, tuple(inputs))
    if "stack_trace" in nodes[0].meta:
        call.meta["stack_trace"] = nodes[0].meta["stack_trace"]
    anchor = call
    is_member = members.__contains__
    for i, node in enumerate(outputs):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (call, i))
        node.replace_all_uses_with(anchor, delete_user_cb=lambda user: not is_member(user))
    for node in reversed(nodes):
        graph.erase_node(node)


def _inline(output_graph: Any) -> int:
    """Put each outlined region's nodes back in place of its call in Dynamo's graph; return how many."""
    graph = output_graph.graph
    calls = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, _Region)]
    for call in calls:
        _inline_call(graph, call)
    return len(calls)


def _inline_call(graph: Any, call: Any) -> None:
    """Copy the body of ``call``'s region into ``graph`` before it, with the fake values and metadata Dynamo's
    trace of it would give; its ``getitem`` readers read the copies.  Raises ``AssertionError`` for a call read other
    than by ``getitem`` (Dynamo unpacks a tuple it traces that way)."""
    import torch.fx

    region: _Region = call.target
    body = region.module.graph
    placeholders = [n for n in body.nodes if n.op == "placeholder"]
    if len(placeholders) != len(call.args) or call.kwargs:
        raise AssertionError(f"{call.name}: {len(call.args)} arguments for {len(placeholders)} region inputs")
    arguments = tuple(a.meta["example_value"] if isinstance(a, torch.fx.Node) else a for a in call.args)
    values = region.take_run(arguments)
    if values is None:  # Dynamo's fake run is gone (a restarted trace): run the region on the fakes again
        with _compat.detect_fake_mode([*arguments]) or contextlib.nullcontext():
            interpreter = torch.fx.Interpreter(region.module, garbage_collect_values=False)
            interpreter.run(*arguments)
        values = dict(interpreter.env)
    env: dict[Any, Any] = dict(zip(placeholders, call.args))
    stack_trace = call.meta.get("stack_trace")
    timestamp = call.meta.get("creation_timestamp")
    output = None
    with graph.inserting_before(call):
        for node in body.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                output = node
                continue
            new = graph.node_copy(node, lambda a: env[a])
            new.meta = _dynamo_meta(node, new, values[node], stack_trace, timestamp)
            env[node] = new
    results = [env[n] for n in output.args[0]]  # type: ignore[union-attr]
    for user in list(call.users):
        if user.target is not operator.getitem:
            raise AssertionError(f"{user.name} reads the outlined region {call.name} other than by getitem")
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(call)


def _dynamo_meta(original: Any, new: Any, value: Any, stack_trace: str | None, timestamp: Any) -> dict[str, Any]:
    """The metadata Dynamo's retrace gives a node it creates for ``original`` (``SubgraphTracer._create_proxy``)."""
    meta: dict[str, Any] = {"source_fn_stack": [(new.name, new.target)]}
    for field in _compat.kept_node_meta_fields():
        if field in original.meta:
            meta[field] = original.meta[field]
    meta["stack_trace"] = original.meta.get("stack_trace", stack_trace)
    if timestamp is not None:
        meta["creation_timestamp"] = timestamp
    meta["example_value"] = value
    return meta


def _compiling_outlined(compiler_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``compiler_fn`` of compiled autograd, then the graph outlined when a Dynamo trace of it follows."""

    def compile_graph(graph: Any) -> Any:
        compiled = compiler_fn(graph)
        if config.outline_aot_backward and _compat.compiled_by_dynamo(compiled, graph):
            outline(graph)
        return compiled

    return compile_graph


def _wrapped_end_capture(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def end_capture(self: Any, outputs: Any) -> Any:
        compiler_fn = self.compiler_fn
        self.compiler_fn = _compiling_outlined(compiler_fn)
        try:
            return original(self, outputs)
        finally:
            self.compiler_fn = compiler_fn

    return end_capture


def _wrapped_dedup_pass(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dedup_pass(self: Any) -> Any:
        inlined = _inline(self)
        if inlined:
            log.debug("compiled autograd: %d outlined AOT backward graphs inlined into Dynamo's graph", inlined)
        return original(self)

    return dedup_pass


def install(patches: Patcher) -> None:
    """Outline compiled autograd's AOT backward copies for Dynamo's trace (NOTE [AOT backward copies traced as one
    call]); a no-op where compiled autograd or ``OutputGraph.dedup_pass`` is not as this module reads them."""
    module = _compat.compiled_autograd_module()
    instance_class = getattr(module, "AutogradCompilerInstance", None)
    output_graph = _compat.output_graph_class()
    if instance_class is None or not callable(getattr(output_graph, "dedup_pass", None)):
        log.debug("compiled autograd's AOT backward copies traced op by op: no AutogradCompilerInstance or dedup_pass")
        return
    end_capture = _wrapped_end_capture(instance_class.end_capture)
    patches.setattr(instance_class, "end_capture", end_capture)
    patches.setattr(output_graph, "dedup_pass", _wrapped_dedup_pass(output_graph.dedup_pass))
    # The capture may run under a frame Dynamo compiled (NOTE [make_fx wrappers run untraced]); a region runs
    # for real only where Dynamo gave up on the graph and runs it eagerly.
    for code in (end_capture.__code__, _Region.__call__.__code__):
        patches.on_undo(_compat.skip_frames_of(code, recursive=True))
