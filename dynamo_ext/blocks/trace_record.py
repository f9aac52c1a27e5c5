"""The first call of a block recorded for the identical blocks after it (NOTE [blocks traced once] in
``trace_once.py``): what a call adds to the frame, and the checks that it leaves nothing else behind."""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from typing import Any

import torch
import torch.fx

from .. import _compat
from . import trace_guards
from .trace_guards import StampError

log = logging.getLogger("dynamo_ext.blocks.trace_once")

# Dynamo's module paths in ``nn_module_stack`` drop ``._modules['x']`` spellings (``record_nn_module_stack``).
REDUNDANT = re.compile(r"\._(?:modules|parameters|buffers)\[(['\"])([^'\"\]]+)\1\]")


@dataclasses.dataclass
class Recording:
    """What one traced block call added to the frame (NOTE [blocks traced once])."""

    source: Any
    module_ref: weakref.ReferenceType[torch.nn.Module]
    path: str
    site: tuple[Any, ...]
    args: tuple[torch.fx.Node | None, ...]
    inputs: tuple[tuple[torch.fx.Node, Any, Any], ...]  # (placeholder, source, fake-value metadata), graph order
    nodes: tuple[torch.fx.Node, ...]
    result: torch.fx.Node
    plans: list[trace_guards.GuardPlan]
    dupes: tuple[tuple[Any, Any], ...]  # (source in the block, source of the object it turned out to be)
    tracked: tuple[Any, ...]  # the block's sources of objects its trace tracked, or met tracked already
    external: frozenset[torch.fx.Node]  # graph inputs from before the call that its nodes read
    named: bool  # the result's node was named after a local variable inside the call
    key_order: tuple[Any, ...]
    mutated: tuple[Any, ...]
    calls: dict[str, int]
    effects_start: int  # the frame's mutation log when the call began
    effects_end: int
    reused: frozenset[torch.fx.Node]  # nodes whose fake values a stamp reuses (:func:`reused_fake_values`)
    scalars: tuple[tuple[Any, Any], ...]  # :func:`automatic_dynamic_scalars`


def call_key(args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, list[Any]]:
    """What the trace of a block call depends on in its arguments, and the arguments' leaves (tensors and
    constants, tuples and lists of them flattened; keyword arguments by name); raises :class:`StampError`."""
    leaves: list[Any] = []

    def key(vt: Any) -> Any:
        if _compat.variable_kind(vt) == "sequence":
            return ("sequence", vt.python_type(), tuple(key(v.realize()) for v in vt.items))
        leaves.append(vt)
        return arg_key(vt)

    positional = tuple(key(a) for a in args)
    named = tuple((name, key(kwargs[name].realize())) for name in sorted(kwargs))
    return (positional, named), leaves


def arg_key(vt: Any) -> Any:
    """What the trace of a block call depends on in one argument; raises :class:`StampError`."""
    if _compat.variable_kind(vt) == "constant":
        value = vt.as_python_constant()
        try:
            hash(value)
        except TypeError:
            raise StampError("an argument is an unhashable constant") from None
        return ("constant", type(value), value)
    node = node_of(vt)
    value = node.meta.get("example_value") if node is not None else None
    if _compat.variable_kind(vt) != "tensor" or not isinstance(value, torch.Tensor):
        raise StampError(f"an argument is a {type(vt).__name__}")
    # Whether an activation is a view does not change the nodes Dynamo adds for ops on it (their fake values,
    # computed afresh, do): not in the key, so the first block's input (an embedding's view) matches the rest.
    return ("tensor", *value_meta(value, views=False))


def value_meta(value: Any, *, views: bool = True) -> tuple[Any, ...]:
    """What a tensor's trace depends on: class, sizes, strides, offset, dtype, device, ``requires_grad``, a
    DTensor's spec and local tensor, and (``views``) whether it is a view; raises :class:`StampError` for
    symbolic sizes.  For another value (an opaque object, a mesh): its class."""
    if isinstance(value, torch.Tensor):
        inner = getattr(value, "_local_tensor", None)
        spec = getattr(value, "_spec", None)
        shape, stride = tuple(value.shape), tuple(value.stride())
        if not all(type(d) is int for d in (*shape, *stride, value.storage_offset())):
            raise StampError("a tensor has symbolic sizes")
        own = (type(value), shape, stride, value.storage_offset(), value.dtype, value.device, value.requires_grad)
        view = value._is_view() if views else None
        return (*own, view, spec, None if inner is None else value_meta(inner, views=views))
    return (type(value), getattr(value, "real_obj", None) is not None)


def node_of(vt: Any) -> torch.fx.Node | None:
    try:
        return vt.as_proxy().node
    except (AttributeError, NotImplementedError):
        return None


def site(tx: Any) -> tuple[Any, ...]:
    """The call site as the nodes' stack traces begin with it, and the module stack around the call."""
    frames = []
    t = tx
    while t is not None:
        frames.append((t.f_code, t.lineno))
        t = getattr(t, "parent", None)
    return (tuple(frames), tuple(tx.nn_module_stack.items()), _compat.global_trace_state(tx))


def record(tx: Any, module_vt: Any, source: Any, args: list[Any], trace: Any, recordings: dict, key: Any) -> Any:
    output = tx.output
    graph = output.root_tracer.graph
    before = set(graph.nodes)
    guards_before = set(output.guards)
    effects = _compat.mutation_log(output)
    effects_start = len(effects)
    key_order_before = set(output.guard_on_key_order)
    mutated_before = set(_compat.mutated_sources(output.side_effects))
    calls_before = dict(tx.num_calls)
    hooks_before = _compat.frame_registrations(output)
    name = _compat.source_name(source)
    path = REDUNDANT.sub(r".\2", _compat.source_name(module_vt.get_nn_module_stack_source()))
    tracked_before = set(output.side_effects.id_to_variable)
    with _compat.duplicate_log() as dupes, _compat.scalar_log() as scalars:
        result = trace()
    recordings[key] = None
    try:
        if _compat.inside_higher_order_op(tx) or output.root_tracer.graph is not graph:
            raise StampError("the call changed the tracer")
        new = [n for n in graph.nodes if n not in before]
        inputs = tuple(
            (n, _input_source(n), value_meta(n.meta.get("example_value"))) for n in new if n.op == "placeholder"
        )
        nodes = tuple(n for n in new if n.op != "placeholder")
        result_node = node_of(result)
        if _compat.variable_kind(result) != "tensor" or result_node is None or result_node not in set(nodes):
            raise StampError(f"its result is a {type(result).__name__}, not a tensor it made")
        arg_nodes = tuple(node_of(a) for a in args)
        allowed = set(new) | {n for n in arg_nodes if n is not None}
        external = set()  # graph inputs lifted before the call (the root's, or an object met again): shared
        for n in nodes:
            if n.op not in ("call_function", "call_method", "get_attr"):
                raise StampError(f"it added a {n.op} node")
            for a in n.all_input_nodes:
                if a not in allowed:
                    if a.op != "placeholder":
                        raise StampError(f"node {n.name} reads {a.name}, made before the call")
                    external.add(a)
            if "unbacked_bindings" in n.meta:
                raise StampError("it made data-dependent sizes")
            if n.target in _AUTOGRAD_CALLS:  # traced by reachability from its inputs' autograd graph (views too)
                raise StampError(f"it calls {n.target.__name__}")
            if n.target is getattr and n.args[1:] == ("_base",):
                # whether and of what a tensor is a view, which the call key holds only among the arguments (NOTE
                # [a stamp keeps its arguments' aliasing] in trace_aliasing.py)
                raise StampError("it reads a tensor's _base")
        if any(calls_before.get(k, 0) for k in tx.num_calls if tx.num_calls[k] != calls_before.get(k, 0)):
            raise StampError("a module of the block was called before")
        if _compat.frame_registrations(output) != hooks_before:
            raise StampError("it registered tensor hooks, backward state, Python random calls or shape guards")
        if _compat.global_trace_state(tx) != key[2][2]:
            raise StampError("it changed global state (grad mode, autocast, torch function modes)")
        check_effects(tx, effects[effects_start:])
        if any(trace_guards.mentions(source_name_of(v), name) for v in effects[:effects_start]):
            # its trace read the pending values, which no guard checks: another block would not have them
            raise StampError("the block had pending mutations when it was called")
        resolve = resolver(tx)
        dupes = [(a, b) for a, b in dupes if trace_guards.mentions(_compat.source_name(a), name)]
        tracked = [a for a, _ in dupes] + [
            vt.source
            for k, vt in output.side_effects.id_to_variable.items()
            if k not in tracked_before
            and getattr(vt, "source", None) is not None
            and trace_guards.mentions(_compat.source_name(vt.source), name)
        ]
        rooted_before = [
            g
            for g in guards_before
            if g.originating_source is not None
            and trace_guards.mentions(_compat.source_name(g.originating_source), name)
        ]
        guards = [g for g in output.guards if g not in guards_before] + rooted_before
        plans = trace_guards.plan(guards, trace_guards.block_sources(source), name, resolve)
        seen = automatic_dynamic_scalars(tx, scalars, plans, name)
    except StampError as why:
        log.debug("%s traced and not recorded: %s", name, why)
        return result
    recordings[key] = Recording(
        source=source,
        module_ref=weakref.ref(module_vt.value),
        path=path,
        site=key[2],
        args=arg_nodes,
        inputs=inputs,
        nodes=nodes,
        result=result_node,
        plans=plans,
        dupes=tuple(dupes),
        tracked=tuple(tracked),
        external=frozenset(external),
        named=_compat.tensor_name_set(result),
        key_order=tuple(s for s in set(output.guard_on_key_order) - key_order_before),
        mutated=tuple(s for s in set(_compat.mutated_sources(output.side_effects)) - mutated_before),
        calls={k: v - calls_before.get(k, 0) for k, v in tx.num_calls.items() if v != calls_before.get(k, 0)},
        effects_start=effects_start,
        effects_end=len(effects),
        reused=reused_fake_values(nodes, result_node, [n for n in arg_nodes if n is not None], external, inputs),
        scalars=seen,
    )
    log.debug("%s traced and recorded for the identical blocks called after it (%d nodes)", name, len(nodes))
    return result


def automatic_dynamic_scalars(
    tx: Any, seen: list[Any], plans: list[trace_guards.GuardPlan], name: str
) -> tuple[tuple[Any, Any], ...]:
    """The ints and floats of the block the recorded trace put in Dynamo's automatic-dynamic record: for each, the
    source of the guard that reads it and what was recorded (``_compat.ScalarSeen``); raises :class:`StampError`
    for one no carried guard reads, or one recorded under a function inlined in the call (a stamp has no
    translator of that function to record block ``i``'s under).

    NOTE [a stamp keeps Dynamo's automatic dynamic]: Dynamo remembers, per frame and source name, the last int
    and float it wrapped (``process_automatic_dynamic``), and traces one that changed since as a symbolic input
    (automatic dynamic: a float attribute changed each step costs one recompile, then none).  A stamp installs
    block ``i``'s guards without wrapping its values, so block ``i``'s float was missing from that record: the
    recompile after it changed pinned it again (``layers[2].scale == 1.5``) and the next change cost a third
    graph where tracing every block costs two.  So a recording keeps the scalars block ``0``'s trace recorded
    under its own names, and a stamp records block ``i``'s values under the renamed names as its trace would
    (``.trace_stamp``); where the record then says Dynamo treats one otherwise than block ``0``'s (block ``i``'s
    changed since the last compile, block ``0``'s did not, or the reverse) the stamp is refused and block ``i``
    traced, so each block's value is made dynamic where stock makes it dynamic.  A block whose trace lifted a
    symbolic value is not recorded (:func:`_input_source`).
    """
    guarded = {_compat.source_name(p.guard.originating_source): p.guard.originating_source for p in plans if p.rooted}
    out: dict[str, tuple[Any, Any]] = {}
    for s in seen:
        if not trace_guards.mentions(s.name, name):
            continue  # an object outside the block: the same for block i, recorded already
        source = guarded.get(s.name)
        if source is None:
            raise StampError(f"its trace recorded {s.name} for automatic dynamic, read by no guard carried over")
        if _compat.recording_translator(tx, s) is None:
            raise StampError(f"its trace recorded {s.name} for automatic dynamic under a function it inlined")
        out[s.name] = (source, s)
    return tuple(out.values())


def reused_fake_values(
    nodes: tuple[torch.fx.Node, ...], result: torch.fx.Node, args: list[torch.fx.Node], external: Any, inputs: Any
) -> frozenset[torch.fx.Node]:
    """The recorded nodes whose fake values a stamp gives its copies as they are, without running the op again.

    NOTE [fake values a stamp reuses]: a copy's fake value must be a fresh tensor where anything after the
    stamp can tell it apart: the result (the caller traces on with it), and every value sharing storage with
    the block's inputs (its argument, parameters, graph inputs: a view of them, or an op mutating them in place,
    changes their fake values' metadata and version, which Dynamo reads). A node whose recorded value is a
    tensor (or a tuple or list of tensors) whose storage is none of the block's inputs' and not the result's
    is made by the block and dies in it: its copy's value would differ from the recorded one only in identity,
    so the recorded fake tensor is reused, which skips its fake propagation (most of a stamp's time otherwise:
    DTensor ops and activation-checkpoint bodies under the fake mode). Nodes whose values are anything else
    (``None`` from an op mutating an argument, sizes) run again.  AOTAutograd and Inductor trace their own
    fake values from the graph inputs, so the reused ones reach no compiled code.
    """
    outside = {
        _compat.storage_of(t)
        for n in (*args, *external, *(p for p, _, _ in inputs))
        for t in _tensors(n.meta.get("example_value")) or ()
    }
    own = _tensors(result.meta.get("example_value")) or ()
    outside |= {_compat.storage_of(t) for t in own}
    reused = []
    for n in nodes:
        tensors = _tensors(n.meta.get("example_value"))
        if n is result or not tensors:
            continue
        storages = [_compat.storage_of(t) for t in tensors]
        if all(s is not None and s not in outside for s in storages):
            reused.append(n)
    return frozenset(reused)


def _tensors(value: Any) -> list[Any] | None:
    """The tensors ``value`` is (a tensor, or a tuple or list of tensors only), or None."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    return None


_AUTOGRAD_CALLS = (torch.autograd.grad, torch.autograd.backward)


def _input_source(node: torch.fx.Node) -> Any:
    """The source of a graph input a block call lifted; raises :class:`StampError` for one without (a value
    Dynamo made) or a symbolic value (its symbol's guards would be another block's), a float Dynamo made dynamic
    included (lifted as a 0-d tensor, read back by ``item()``)."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        raise StampError("it lifted a graph input without a source")
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor) and getattr(value, "real_obj", None) is None:
        raise StampError(f"it lifted {type(value).__name__} graph input {node.name} (a symbolic value)")
    if _compat.python_scalar_input(grapharg):
        raise StampError(f"it lifted {_compat.source_name(source)}, a Python number, as a tensor (a symbolic value)")
    return source


def mutated_objects(mutated: list[Any], resolve: Any) -> set[int]:
    """The ids of the objects the trackers in ``mutated`` (a slice of the frame's mutation log) track."""
    out = set()
    for vt in mutated:
        source = getattr(vt, "source", None)
        try:
            if source is not None:
                out.add(id(resolve(source)))
        except Exception:  # a tracker whose source no longer resolves: no object of a block
            continue
    return out


def source_name_of(vt: Any) -> str:
    source = getattr(vt, "source", None)
    return "" if source is None else _compat.source_name(source)


def resolver(tx: Any) -> Any:
    cache: dict[Any, Any] = {}
    return lambda source: _compat.source_value(tx, source, cache)


def check_effects(tx: Any, mutated: list[Any]) -> None:
    """Refuse a call that leaves a mutation on an object that existed before it (NOTE [blocks traced once])."""
    resolve = resolver(tx)
    for vt in {id(v): v for v in mutated}.values():
        if getattr(vt, "source", None) is None:
            if _compat.is_new_object(vt):
                continue
            raise StampError(f"it mutated a {type(vt).__name__} without a source")
        if not _restored(tx, vt, resolve):
            raise StampError(f"it leaves {_compat.source_name(vt.source)} mutated")


def _same_object(tx: Any, vt: Any, live: Any, resolve: Any) -> bool:
    if _compat.variable_kind(vt) == "constant":
        value = vt.as_python_constant()
        return type(value) is type(live) and value == live
    source = getattr(vt, "source", None)
    if source is None:
        return False
    try:
        return resolve(source) is live
    except Exception:
        return False


def _restored(tx: Any, vt: Any, resolve: Any) -> bool:
    """Whether every pending mutation of ``vt`` writes back the value its object holds now."""
    try:
        obj = resolve(vt.source)
    except Exception:
        return False
    attrs = _compat.pending_attrs(tx.output.side_effects, vt)
    for attr, value in attrs.items():
        if not _same_object(tx, value, getattr(obj, attr, _MISSING), resolve):
            return False
    items = vt.__dict__.get("items")  # a dict's or list's tracked contents (not a tracker's attribute lookup)
    if isinstance(items, dict) and isinstance(obj, dict):
        keys = [_compat.hashable_key(k) for k in items]
        if keys != list(obj):
            return False
        return all(_same_object(tx, v, obj[k], resolve) for k, v in zip(keys, items.values()))
    if isinstance(items, list) and isinstance(obj, list):
        return len(items) == len(obj) and all(_same_object(tx, v, o, resolve) for v, o in zip(items, obj))
    # Attribute writes only, all checked above; any other kind of mutated contents is not compared: refused.
    return items is None and bool(attrs)


_MISSING = object()
