"""FSDP2's per-parameter gathers traced once per signature and stamped for the others.

NOTE [FSDP2 gathers traced once]
Each FSDP2 parameter is unsharded by one call of ``hooks._gather_impl`` (or of
its activation-checkpointed form): Dynamo inlines it and speculates the bodies
of a higher-order op (the checkpoint's body and the gather's
``autograd.Function`` forward and backward) for every parameter of every
block.  That was about half of Dynamo's time on a Llama block (9 parameters),
on every first compile and on every warm restart, whose graphs come from the
caches but whose bytecode Dynamo traces again.

The nodes such a call adds to the graph depend only on the call's signature:
the function, the local shard's metadata (shape, stride, dtype, device,
``requires_grad``), the padded row count and the ``GradReduction`` constants,
and the grad mode.  Identical blocks repeat the same few signatures.  So the
first call of a signature in a frame's trace is traced as usual and its nodes
recorded; a later call with the same signature adds copies of those nodes,
with its own shard as the one input, calling the same body submodules.  Fake
values of the copies are computed by running them (``wrap_fx_proxy``), not
copied, so no two graph values share a fake tensor.

A recording is used only when it is self-contained, which is checked when it
is made: every recorded node is a ``get_attr`` or ``call_function`` of the
root graph, the only value it reads from before the call is the shard, the
call lifted no new graph input, and its result is the last recorded node.
Anything else (a nested tracer, dynamic shapes, a lifted input) traces every
call as before.  The recordings belong to one frame's root graph: a new frame, or a
restarted trace, starts empty.  ``tests/test_fsdp_gather_stamps.py`` checks
that AOTAutograd's forward and backward graphs are the same node for node with
and without stamping.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.node import map_arg

from ... import _compat

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Recording:
    """The nodes one gather call added, in order; ``local`` is the node of the shard it read."""

    local: torch.fx.Node
    nodes: tuple[torch.fx.Node, ...]


# Per frame trace: keyed by the root graph Dynamo is building (an OutputGraph is not hashable).
_recordings: weakref.WeakKeyDictionary[torch.fx.Graph, dict[tuple[Any, ...], _Recording | None]] = (
    weakref.WeakKeyDictionary()
)


def signature(impl: Callable[..., Any], local: Any, constants: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What the nodes of ``impl(local, *constants)`` depend on; None when they may depend on more.

    Args:
        impl: the traced gather function (``hooks._gather_impl`` or a checkpointed form).
        local: the shard's tracker (a ``TensorVariable`` with ``example_value`` in its proxy's meta).
        constants: the call's Python constants (padded rows, ``GradReduction`` fields): hashable.
    """
    node = _node_of(local)
    value = node.meta.get("example_value") if node is not None else None
    if not isinstance(value, torch.Tensor):
        return None
    shape, stride = tuple(value.shape), tuple(value.stride())
    if not all(type(d) is int for d in (*shape, *stride, value.storage_offset())):
        return None  # symbolic sizes: the recorded nodes may carry symbols of another shard
    try:
        hash(constants)
    except TypeError:
        return None
    meta = (shape, stride, value.storage_offset(), value.dtype, value.device, value.requires_grad)
    return (impl, meta, constants, torch.is_grad_enabled())


def call(tx: Any, impl: Callable[..., Any], local: Any, constants: list[Any], key: tuple[Any, ...] | None) -> Any:
    """``impl(local, *constants)`` traced, or stamped from the recording of ``key`` (NOTE [FSDP2 gathers traced once]).

    Args:
        tx: the instruction translator.
        impl: the gather function to inline.
        local: the shard's tracker.
        constants: trackers of the call's constant arguments.
        key: :func:`signature` of the call, or None to trace it without recording.
    """
    output = tx.output
    if key is None or _compat.inside_higher_order_op(tx):
        return _trace(tx, impl, local, constants)
    recordings = _recordings.setdefault(output.root_tracer.graph, {})
    if key in recordings:
        recording = recordings[key]
        if recording is not None and _usable(recording, tx):
            return _stamp(tx, recording, local)
        if recording is not None:
            log.debug("FSDP2 gather recording dropped: Dynamo rolled its nodes back")
            del recordings[key]
        else:
            return _trace(tx, impl, local, constants)
    graph = output.current_tracer.graph
    before = set(graph.nodes)
    inputs = len(output.placeholders)
    result = _trace(tx, impl, local, constants)
    new = tuple(n for n in graph.nodes if n not in before)
    recordings[key] = _checked(new, local, result, lifted=len(output.placeholders) != inputs)
    if recordings[key] is not None:
        log.debug("FSDP2 gather of a %s shard traced: later identical parameters are stamped from it", key[1])
    return result


def _trace(tx: Any, impl: Callable[..., Any], local: Any, constants: list[Any]) -> Any:
    return _compat.user_function_variable(impl).call_function(tx, [local, *constants], {})


def _checked(new: tuple[torch.fx.Node, ...], local: Any, result: Any, lifted: bool) -> _Recording | None:
    """The recording of a traced call, or None (and why, logged) when it is not self-contained."""
    local_node = local.as_proxy().node
    inside = set(new)
    why = None
    if lifted:
        why = "it lifted a graph input"
    elif not new or _node_of(result) is not new[-1]:
        why = "its result is not its last node"
    else:
        for n in new:
            outside = [a for a in n.all_input_nodes if a not in inside and a is not local_node]
            if n.op not in ("get_attr", "call_function") or outside:
                why = f"node {n.name} ({n.op}) reads {[a.name for a in outside]} from before the call"
                break
    if why is not None:
        log.debug("FSDP2 gather traced for every parameter of this signature: %s", why)
        return None
    return _Recording(local_node, new)


def _node_of(tracker: Any) -> torch.fx.Node | None:
    try:
        return tracker.as_proxy().node
    except (AttributeError, NotImplementedError):
        return None


def _stamp(tx: Any, recording: _Recording, local: Any) -> Any:
    """Add copies of ``recording``'s calls reading ``local``; the tracker of the last copy.

    The recorded ``get_attr`` nodes (the bodies of higher-order ops) are read again, not
    copied: Dynamo finds a body by its ``get_attr`` node's name.
    """
    tracer = tx.output.current_tracer
    proxies: dict[torch.fx.Node, Any] = {recording.local: local.as_proxy()}
    *inner, last = recording.nodes
    for node in inner:
        if node.op == "get_attr":
            proxies[node] = torch.fx.Proxy(node, tracer)
            continue
        proxy = _copy(tx.output, node, proxies)
        proxy.node.meta["example_value"] = _compat.get_fake_value(proxy.node, tx)
    return _compat.wrap_fx_proxy(tx, _copy(tx.output, last, proxies))


def _copy(output: Any, node: torch.fx.Node, proxies: dict[torch.fx.Node, Any]) -> Any:
    args, kwargs = map_arg((node.args, node.kwargs), lambda n: proxies[n])
    proxies[node] = output.create_proxy(node.op, node.target, args, kwargs)
    return proxies[node]


def _usable(recording: _Recording, tx: Any) -> bool:
    """Whether every recorded node is still in the graph (Dynamo erases the nodes of a trace it rolls back)."""
    modules = tx.output.nn_modules
    return not any(
        getattr(n, "_erased", False) or (n.op == "get_attr" and n.name not in modules)
        for n in (recording.local, *recording.nodes)
    )
