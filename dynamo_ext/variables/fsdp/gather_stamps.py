"""FSDP2's group gathers traced once per signature and stamped for the others.

NOTE [FSDP2 gathers traced once]
Each FSDP2 param group is unsharded by calls of ``unshard._gather_impl`` (or of
its activation-checkpointed form; NOTE [FSDP2 gathers per group]): Dynamo
inlines it and speculates the bodies of a higher-order op (the checkpoint's
body and the gather's ``autograd.Function`` forward and backward) for every
group of every block.  That was about half of Dynamo's time on a Llama block,
on every first compile and on every warm restart, whose graphs come from the
caches but whose bytecode Dynamo traces again.

The nodes such a call adds to the graph depend only on the call's signature:
the function, the local shards' metadata (shape, stride, dtype, device,
``requires_grad``), the padded row counts and the ``GradReduction`` constants,
and the grad mode.  Identical blocks repeat the same few signatures.  So the
first call of a signature in a frame's trace is traced as usual and its nodes
recorded; a later call with the same signature adds copies of those nodes,
with its own shards as the inputs.  The higher-order ops' bodies are copied
too (a few nodes each), their nodes moved into the calling block's module
(``nn_module_stack``): AOTAutograd copies a body node's module stack and stack
trace onto the nodes it traces from it, and the audit and the compiled-autograd
backward read them, so a stamped call must leave exactly what tracing it would.
Stack traces are the recorded ones; a call from another place than the recorded
call (a block called on another line) is traced instead.  Fake values of the
copies are computed by running them, as ``wrap_fx_proxy`` does, with the
user's saved-tensor hooks deferred (a pack hook must not see the fakes the
checkpoint saves); they are never copied, so no two graph values share a fake
tensor.

A recording is used only when it is self-contained, which is checked when it
is made: every recorded node is a ``get_attr``, ``call_function`` or ``call_method`` of the
root graph, the only values it reads from before the call are the shards, the
call lifted no new graph input, and each tensor of its result (a tuple) is a
recorded node.
Anything else (a nested tracer, dynamic shapes, a lifted input) traces every
call as before, and so does a recording whose bodies hold a node of another
module than the call's.  The recordings belong to one frame's root graph: a
new frame, or a restarted trace, starts empty; a recording whose nodes Dynamo
erased (a speculation it rolled back) is dropped and the call traced again.

Which calls are stamped may differ between ranks (uneven shards give a rank
other shard shapes); AOTAutograd's graphs do not, since a stamped call leaves what
tracing it leaves.  ``tests/test_fsdp_gather_stamps.py`` checks that
AOTAutograd's forward and backward graphs are the same node for node with and
without stamping, with each node's module stack and stack trace.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx.node import map_arg

from ... import _compat

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Recording:
    """The nodes one gather call added, in order; ``locals`` are the nodes of the shards it read, ``outputs``
    the nodes of its result's tensors."""

    locals: tuple[torch.fx.Node, ...]
    nodes: tuple[torch.fx.Node, ...]
    outputs: tuple[torch.fx.Node, ...]


_RECORDINGS_ATTR = "_dynamo_ext_gather_recordings"


def _frame_recordings(graph: torch.fx.Graph) -> dict[tuple[Any, ...], _Recording | None]:
    """The gather recordings of the frame whose root graph is ``graph``, kept on that graph: a recording holds
    nodes, a node holds its graph, so a table keyed weakly by the graph would keep every graph alive (NOTE
    [recordings live on the graph] in ``dynamo_ext/blocks/trace_once.py``)."""
    recordings = graph.__dict__.get(_RECORDINGS_ATTR)
    if recordings is None:
        recordings = {}
        setattr(graph, _RECORDINGS_ATTR, recordings)
    return recordings


def signature(impl: Callable[..., Any], locals_: Sequence[Any], constants: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What the nodes of ``impl(*constants, *locals_)`` depend on; None when they may depend on more.

    Args:
        impl: the traced gather function (``unshard._gather_impl`` or a checkpointed form).
        locals_: the shards' trackers (``TensorVariable``\\ s with ``example_value`` in their proxies' meta).
        constants: the call's Python constants (padded rows, ``GradReduction`` fields): hashable.
    """
    metas = []
    for local in locals_:
        node = _node_of(local)
        value = node.meta.get("example_value") if node is not None else None
        if not isinstance(value, torch.Tensor):
            return None
        shape, stride = tuple(value.shape), tuple(value.stride())
        if not all(type(d) is int for d in (*shape, *stride, value.storage_offset())):
            return None  # symbolic sizes: the recorded nodes may carry symbols of another shard
        metas.append((shape, stride, value.storage_offset(), value.dtype, value.device, value.requires_grad))
    try:
        hash(constants)
    except TypeError:
        return None
    return (impl, tuple(metas), constants, torch.is_grad_enabled())


def call(
    tx: Any, impl: Callable[..., Any], locals_: Sequence[Any], constants: list[Any], key: tuple[Any, ...] | None
) -> Any:
    """``impl(*constants, *locals_)`` traced, or stamped from the recording of ``key`` (NOTE [FSDP2 gathers traced
    once]); ``impl`` returns a tuple of tensors, and so does this (a tuple tracker).

    Args:
        tx: the instruction translator.
        impl: the gather function to inline.
        locals_: the shards' trackers.
        constants: trackers of the call's constant arguments.
        key: :func:`signature` of the call, or None to trace it without recording.
    """
    output = tx.output
    if key is None or _compat.inside_higher_order_op(tx):
        return _trace(tx, impl, locals_, constants)
    recordings = _frame_recordings(output.root_tracer.graph)
    if key in recordings:
        recording = recordings[key]
        if recording is not None and _usable(recording, tx):
            stamped = _stamp(tx, recording, locals_)
            if stamped is not None:
                return stamped
            return _trace(tx, impl, locals_, constants)
        if recording is not None:
            log.debug("FSDP2 gather recording dropped: Dynamo rolled its nodes back")
            del recordings[key]
        else:
            return _trace(tx, impl, locals_, constants)
    graph = output.current_tracer.graph
    before = set(graph.nodes)
    inputs = len(output.placeholders)
    result = _trace(tx, impl, locals_, constants)
    new = tuple(n for n in graph.nodes if n not in before)
    recordings[key] = _checked(new, locals_, result, len(output.placeholders) != inputs, output.nn_modules)
    if recordings[key] is not None:
        log.debug("FSDP2 gather of a %s shard traced: later identical groups are stamped from it", key[1])
    return result


def _trace(tx: Any, impl: Callable[..., Any], locals_: Sequence[Any], constants: list[Any]) -> Any:
    return _compat.user_function_variable(impl).call_function(tx, [*constants, *locals_], {})


def _checked(
    new: tuple[torch.fx.Node, ...], locals_: Sequence[Any], result: Any, lifted: bool, modules: dict[str, Any]
) -> _Recording | None:
    """The recording of a traced call, or None (and why, logged) when it is not self-contained."""
    local_nodes = tuple(local.as_proxy().node for local in locals_)
    inside = set(new)
    outputs = tuple(n for n in (_node_of(item) for item in getattr(result, "items", ())) if n in inside)
    why = None
    if lifted:
        why = "it lifted a graph input"
    elif not new or not outputs or len(outputs) != len(getattr(result, "items", ())):
        why = "its result is not a tuple of its own nodes"
    else:
        for n in new:
            outside = [a for a in n.all_input_nodes if a not in inside and a not in local_nodes]
            if n.op not in ("get_attr", "call_function", "call_method") or outside:
                why = f"node {n.name} ({n.op}) reads {[a.name for a in outside]} from before the call"
                break
    if why is None:
        why = _context_differs(new, modules)
    if why is not None:
        log.debug("FSDP2 gather traced for every group of this signature: %s", why)
        return None
    return _Recording(local_nodes, new, outputs)


def _bodies(node: torch.fx.Node, modules: dict[str, Any]) -> list[torch.fx.GraphModule]:
    """The graph modules a recorded ``get_attr`` node reads, nested bodies included; [] for other nodes."""
    body = modules.get(node.name) if node.op == "get_attr" else None
    if not isinstance(body, torch.fx.GraphModule):
        return []
    return [m for m in body.modules() if isinstance(m, torch.fx.GraphModule)]


def _context_differs(new: tuple[torch.fx.Node, ...], modules: dict[str, Any]) -> str | None:
    """Why a body node of the call is not in the call's module; None when all are.

    A stamped copy's bodies get the module stack of their own call (:func:`_stamp`): exact only when
    every node of the recorded bodies carries the recorded call's module stack or none.
    """
    stack = new[-1].meta.get("nn_module_stack")
    for body in (b for n in new for b in _bodies(n, modules)):
        for m in body.graph.nodes:
            if m.op not in ("placeholder", "output") and m.meta.get("nn_module_stack") not in (None, stack):
                return f"body node {m.name} is inside another module than the call"
    return None


def _node_of(tracker: Any) -> torch.fx.Node | None:
    try:
        return tracker.as_proxy().node
    except (AttributeError, NotImplementedError):
        return None


def _stamp(tx: Any, recording: _Recording, locals_: Sequence[Any]) -> Any:
    """Add copies of ``recording``'s nodes reading ``locals_``; a tuple tracker of the output copies, or None.

    The higher-order ops' bodies are copied too, each node moved into the module of this
    call (``nn_module_stack``), so AOTAutograd's nodes say which block they belong to, as
    if traced.  Dynamo finds a body by its ``get_attr`` node's name: each copy is installed
    under a name of its own.  Stack traces are the recorded ones, which begin with the
    recorded call site: when this call comes from another one (a block called from another
    line), the copies are removed again and None returned, for the call to be traced.
    """
    output = tx.output
    proxies: dict[torch.fx.Node, Any] = {n: local.as_proxy() for n, local in zip(recording.locals, locals_)}
    stack = dict(tx.nn_module_stack)
    trackers: dict[torch.fx.Node, Any] = {}
    for node in recording.nodes:
        if node.op == "get_attr":
            body = copy.deepcopy(output.nn_modules[node.name])
            for module in body.modules():
                for n in module.graph.nodes if isinstance(module, torch.fx.GraphModule) else ():
                    if n.meta.get("nn_module_stack") is not None:  # what Dynamo leaves out stays out
                        n.meta["nn_module_stack"] = dict(stack)
            name = output.install_subgraph(str(node.target).rstrip("0123456789").rstrip("_"), body)
            proxies[node] = output.create_proxy("get_attr", name, (), {})
            continue
        proxy = _copy(output, node, proxies)
        site = proxy.node.meta.get("stack_trace")
        if not site or not (node.meta.get("stack_trace") or "").startswith(site):
            for made in reversed([p.node for n, p in proxies.items() if n not in recording.locals]):
                output.remove_node(made)
            log.debug("FSDP2 gather traced: called from another place than the recorded call")
            return None
        proxy.node.meta["stack_trace"] = node.meta.get("stack_trace")
        if node in recording.outputs:
            trackers[node] = _compat.wrap_fx_proxy(tx, proxy)  # its fake value computed, as tracing does
        else:
            proxy.node.meta["example_value"] = _compat.get_fake_value(proxy.node, tx)
    return _compat.TupleVariable([trackers[n] for n in recording.outputs])


def _copy(output: Any, node: torch.fx.Node, proxies: dict[torch.fx.Node, Any]) -> Any:
    args, kwargs = map_arg((node.args, node.kwargs), lambda n: proxies[n])
    proxies[node] = output.create_proxy(node.op, node.target, args, kwargs)
    return proxies[node]


def _usable(recording: _Recording, tx: Any) -> bool:
    """Whether every recorded node is still in the graph (Dynamo erases the nodes of a trace it rolls back)."""
    modules = tx.output.nn_modules
    return not any(
        getattr(n, "_erased", False) or (n.op == "get_attr" and n.name not in modules)
        for n in (*recording.locals, *recording.nodes)
    )
