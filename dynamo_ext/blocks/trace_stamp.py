"""A block stamped from the recording of an identical block (NOTE [blocks traced once] in ``trace_once.py``):
checks, graph inputs lifted, nodes copied with their module stacks moved, guards carried over."""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

from .. import _compat
from . import trace_aliasing, trace_guards
from .trace_guards import Renaming, StampError
from .trace_record import (
    REDUNDANT,
    Recording,
    check_effects,
    log,
    mutated_objects,
    node_of,
    resolver,
    source_name_of,
    value_meta,
)


def stamp(tx: Any, rec: Recording, module_vt: Any, source: Any, args: list[Any]) -> Any:
    """Add copies of ``rec``'s nodes for block ``module_vt``; raises :class:`StampError` with nothing of it kept
    in the graph (graph inputs it lifted stay, unused, as a trace that stops there leaves them)."""
    output = tx.output
    old_module = rec.module_ref()
    if old_module is None or any(getattr(n, "_erased", False) for n in (rec.result, *rec.nodes)):
        raise StampError("the recorded nodes are gone (a rolled-back trace)")
    arg_nodes = [node_of(a) for a in args]
    trace_aliasing.check_mapping(rec.args, arg_nodes)
    new_path = REDUNDANT.sub(r".\2", _compat.source_name(module_vt.get_nn_module_stack_source()))
    renaming = Renaming(
        rec.source,
        source,
        _compat.source_name(rec.source),
        _compat.source_name(source),
        rec.path,
        new_path,
        trace_guards.hook_key_map(old_module, module_vt.value),
    )
    resolve = resolver(tx)
    _check_state(tx, rec, renaming, resolve)
    paths = _TrackedPaths(tx, resolve, {renaming.source(t) for t in rec.tracked})
    guards = trace_guards.carry(rec.plans, renaming, resolve, paths)
    _note_scalars(tx, rec, renaming, paths, resolve)
    calls = {renaming.text(k): v for k, v in rec.calls.items()}
    if any(tx.num_calls.get(k, 0) for k in calls):
        raise StampError("a module of the block was called before")
    moved = _ModuleStacks(renaming, old_module, module_vt.value)
    nodes: dict[torch.fx.Node, torch.fx.Node] = {p: p for p in rec.external}
    for old, node in zip(rec.args, arg_nodes):
        if old is not None and node is not None:
            nodes[old] = node
    _lift_inputs(tx, rec, renaming, paths, moved, resolve, nodes)
    _copy_nodes(tx, rec, moved, nodes)
    # Nothing can fail from here on: the block's guards and bookkeeping join the frame's.
    for guard in [*guards, *paths.guards]:
        _compat.install_guard_quietly(output, guard)
    for s in rec.key_order:
        output.guard_on_key_order.add(paths(renaming.source(s)))
    _compat.mutated_sources(output.side_effects, [paths(renaming.source(s)) for s in rec.mutated])
    for k, v in calls.items():
        tx.num_calls[k] = tx.num_calls.get(k, 0) + v
    for guard_source, on_source in _remembered(guards):
        on_source(guard_source, resolve(guard_source))
    result = nodes[rec.result]
    log.debug("%s stamped from %s (%d nodes, %d guards carried over)", new_path, rec.path, len(rec.nodes), len(guards))
    # wrap_fx_proxy sets a non-placeholder's fake value itself.
    tracer = output.current_tracer
    vt = _compat.wrap_fx_proxy(tx, torch.fx.Proxy(result, tracer), example_value=result.meta.pop("example_value"))
    if rec.named:
        _compat.tensor_name_set(vt, mark=True)
    return vt


def _note_scalars(tx: Any, rec: Recording, renaming: Renaming, paths: Any, resolve: Any) -> None:
    """Record block ``i``'s ints and floats in Dynamo's automatic-dynamic record as its trace would; refuse where
    Dynamo would now treat one otherwise than the recorded block's (NOTE [a stamp keeps Dynamo's automatic
    dynamic] in ``trace_record.py``)."""
    for source, seen in rec.scalars:
        renamed = paths(renaming.source(source))
        name = _compat.source_name(renamed)
        translator = _compat.recording_translator(tx, seen)  # the one the recorded trace recorded it under
        if translator is None:
            raise StampError(f"{name}: the recorded block's translator for automatic dynamic is not the caller's")
        try:
            value = resolve(renamed)
        except Exception as e:
            raise StampError(f"{name} cannot be read ({type(e).__name__}: {e})") from None
        noted = _compat.note_scalar(translator, name, value, unspecialized_nn_module=seen.unspecialized_nn_module)
        if noted != seen.dynamic:
            now = "dynamic" if noted else "static"
            raise StampError(f"Dynamo makes {name} {now} (automatic dynamic), the recorded block's was not")


def _check_state(tx: Any, rec: Recording, renaming: Renaming, resolve: Any) -> None:
    """Refuse when block ``i`` has pending mutations, when an object outside the container's blocks was mutated
    since the recording, or when an object the recorded block met twice is two objects in block ``i``."""
    effects = _compat.mutation_log(tx.output)
    if any(trace_guards.mentions(source_name_of(vt), renaming.new_name) for vt in effects):
        raise StampError("the block has pending mutations")
    # Objects mutated before the recorded call (while it ran, or since: restored, checked there and below).  One
    # both blocks reach as the same object (FSDP2's shared state context) reads the same for both; one of the
    # recorded block's own, or of this block's, would read otherwise than in the recording.
    before = mutated_objects(effects[: rec.effects_start], resolve)
    for t in rec.tracked:
        try:
            old, new = resolve(t), resolve(renaming.source(t))
        except Exception:
            continue
        if new is not old and (id(old) in before or id(new) in before):
            raise StampError(
                f"{_compat.source_name(renaming.source(t))} or its recorded counterpart has a pending mutation"
            )
    container = _compat.source_name(_compat.container_item_base(renaming.new))
    for vt in effects[rec.effects_end :]:
        if getattr(vt, "source", None) is not None and not trace_guards.mentions(source_name_of(vt), container):
            raise StampError(f"{source_name_of(vt)} was mutated since the recorded block was traced")
    check_effects(tx, effects[rec.effects_end :])
    for a, b in rec.dupes:
        if resolve(renaming.source(a)) is not resolve(renaming.source(b)):
            raise StampError(f"{_compat.source_name(renaming.source(a))} is another object than the recorded block's")


def _lift_inputs(
    tx: Any, rec: Recording, renaming: Renaming, paths: Any, moved: Any, resolve: Any, nodes: dict
) -> None:
    """Block ``i``'s graph inputs for the recorded ones, lifted by Dynamo's ``VariableBuilder`` as a trace lifts
    them (guards, fake tensors, graph arguments), or the ones the frame already has for the same objects."""
    output = tx.output
    before = set(output.placeholders)
    for placeholder, input_source, meta in rec.inputs:
        renamed = paths(renaming.source(input_source))
        vt = output.input_source_to_var.get(renamed)
        if vt is None:
            try:
                vt = _compat.build_variable(tx, renamed, resolve(renamed))
            except Exception as e:  # e.g. a graph break Dynamo raises for this value: let the trace meet it
                raise StampError(f"graph input {_compat.source_name(renamed)}: {type(e).__name__}: {e}") from None
        node = node_of(vt)
        if node is None or value_meta(node.meta.get("example_value")) != meta:
            raise StampError(f"graph input {_compat.source_name(renamed)} differs from the recorded block's")
        if node.op == "placeholder" and node not in before:  # made now: as its trace would have made it
            for k in ("stack_trace", "nn_module_stack"):
                if k in placeholder.meta:
                    node.meta[k] = moved(placeholder.meta[k]) if k == "nn_module_stack" else placeholder.meta[k]
        nodes[placeholder] = node


def _copy_nodes(tx: Any, rec: Recording, moved: Any, nodes: dict) -> None:
    """Copies of the recorded nodes reading ``nodes``' values, with fake values fresh where anything can tell
    (NOTE [fake values a stamp reuses] in ``trace_record.py``); on any failure the copies are erased again and
    :class:`StampError` raised."""
    output = tx.output
    tracer = output.current_tracer
    made: list[torch.fx.Node] = []
    try:
        for old in rec.nodes:
            target = old.target
            if old.op == "get_attr":
                body = _copied_body(output.nn_modules[old.target], moved)
                target = output.install_subgraph(str(old.target).rstrip("0123456789").rstrip("_"), body)
            args, kwargs = map_arg((old.args, old.kwargs), lambda n: nodes[n])
            new = tracer.create_node(old.op, target, args, kwargs)
            made.append(new)
            if _name_base(new.name) != _name_base(old.name):  # Dynamo named it after a local variable
                _compat.rename_node(new, _name_base(old.name))
            nodes[old] = new
            _copy_meta(old, new, moved)
            if old in rec.reused:  # NOTE [fake values a stamp reuses] in trace_record.py
                new.meta["example_value"] = old.meta["example_value"]
            elif old.op != "get_attr":
                new.meta["example_value"] = _compat.get_fake_value(new, tx)
    except Exception as e:
        for n in reversed(made):
            tracer.graph.erase_node(n)
        raise StampError(f"copying its nodes failed ({type(e).__name__}: {e})") from None


def _copied_body(body: torch.nn.Module, moved: Any) -> torch.nn.Module:
    """A copy of a higher-order op's body (a ``GraphModule``, with the bodies it calls) with its nodes' module
    stacks moved to block ``i``.

    NOTE: the copy shares the recorded body's fake values (node metadata is copied shallowly) and generates its
    Python code only when called (``_compat.lazy_graph_module``): the block split never calls a stamped block's
    body, and a ``deepcopy`` would copy every fake value and generate the code at once. A body reading anything
    but nested bodies (a parameter, a module) is deep-copied whole.
    """
    lazy = _lazy_copy(body, moved)
    if lazy is not None:
        return lazy
    body = copy.deepcopy(body)
    for gm in body.modules():
        for n in gm.graph.nodes if isinstance(gm, torch.fx.GraphModule) else ():
            _move_stack(n, moved)
    return body


def _lazy_copy(body: Any, moved: Any) -> Any:
    """:func:`_copied_body`'s copy without ``deepcopy``, or None where ``body`` reads anything but bodies."""
    if not isinstance(body, torch.fx.GraphModule):
        return None
    nested = {}
    for n in body.graph.nodes:
        if n.op == "call_module":
            return None
        if n.op == "get_attr":
            sub = _lazy_copy(getattr(body, str(n.target), None), moved)
            if sub is None:
                return None
            nested[str(n.target)] = sub
    graph = copy.deepcopy(body.graph)
    for n in graph.nodes:
        _move_stack(n, moved)
    out = _compat.lazy_graph_module(nested or body, graph)
    out.meta = dict(getattr(body, "meta", {}))
    return out


def _move_stack(node: torch.fx.Node, moved: Any) -> None:
    if node.meta.get("nn_module_stack") is not None:
        node.meta["nn_module_stack"] = moved(node.meta["nn_module_stack"])


def _name_base(name: str) -> str:
    return _NUMBERED.sub("", name)


_NUMBERED = re.compile(r"_\d+$")


class _TrackedPaths:
    """The path a trace reaches a source's object by (NOTE [blocks traced once]).

    Dynamo's ``VariableBuilder`` returns the tracker it already has for an object it meets again, so a trace
    reading ``source`` step by step continues from the first step whose object the frame already tracks (an
    FSDP2 spec shared by every block, a class's ``__dict__``) along that tracker's source: its graph inputs and
    guards are on that path.  Memoized per step for one stamp.
    """

    def __init__(self, tx: Any, resolve: Any, candidates: set[Any]) -> None:
        self._effects = tx.output.side_effects
        self._resolve = resolve
        self._candidates = candidates  # the steps where a trace of this block can meet a tracked object
        self._steps: dict[Any, Any] = {}
        self._done: dict[Any, Any] = {}
        self.guards: list[Any] = []  # the aliasing guards Dynamo installs where it meets a tracked object again

    def __call__(self, source: Any) -> Any:
        done = self._done.get(source)
        if done is not None:
            return done
        out = source
        for _ in range(8):  # each rebase moves to an earlier-tracked object; a few suffice
            rebased = self._rebase(out)
            if rebased is None:
                break
            out = rebased
        self._done[source] = out
        return out

    def _rebase(self, source: Any) -> Any:
        steps = []
        s = source
        while s is not None:
            steps.append(s)
            s = getattr(s, "base", None)
        for step in reversed(steps[:-1]):
            if step not in self._candidates:
                continue
            seen = self._steps.get(step, _UNSEEN)
            if seen is _UNSEEN:
                seen = self._steps[step] = self._tracked_source(step)
            if seen is not None:
                return trace_guards.replace_source(source, step, seen)
        return None

    def _tracked_source(self, step: Any) -> Any:
        if _compat.source_kind(step) == "module":
            return None
        try:
            obj = self._resolve(step)
        except Exception:
            return None
        if obj not in self._effects:
            return None
        seen = getattr(self._effects[obj], "source", None)
        if seen is None or seen == step or _compat.source_name(seen) == _compat.source_name(step):
            return None
        guard = _compat.make_dupe_guard(step, seen)
        if guard is not None:
            self.guards.append(guard)
        return seen


_UNSEEN = object()


class _ModuleStacks:
    """Node ``nn_module_stack`` entries moved from block ``0`` to block ``i``: keys (module ids, with the call
    count after ``@``) and module paths renamed."""

    def __init__(self, renaming: Renaming, old: torch.nn.Module, new: torch.nn.Module) -> None:
        self._renaming = renaming
        self._ids = {
            str(id(a)): str(id(b))
            for (_, a), (_, b) in zip(
                old.named_modules(remove_duplicate=False), new.named_modules(remove_duplicate=False)
            )
        }
        self._memo: dict[int, tuple[Any, dict[str, Any]]] = {}

    def __call__(self, stack: dict[str, Any]) -> dict[str, Any]:
        key = id(stack)
        if key not in self._memo:
            moved = {}
            for k, (path, cls) in stack.items():
                module_id, at, count = k.partition("@")
                moved[self._ids.get(module_id, module_id) + at + count] = (self._renaming.text(path), cls)
            self._memo[key] = (stack, moved)  # the stack kept alive: its id is not reused while memoized
        return dict(self._memo[key][1])


def _copy_meta(old: torch.fx.Node, new: torch.fx.Node, moved: _ModuleStacks) -> None:
    for k, v in old.meta.items():
        if k in ("example_value", "creation_timestamp"):
            continue
        if k == "nn_module_stack":
            v = moved(v)
        elif k == "source_fn_stack":
            v = [*v[:-1], (new.name, v[-1][1])] if v else v
        new.meta[k] = v


def _remembered(guards: list[Any]) -> list[tuple[Any, Any]]:
    out = []
    for g in guards:
        fn = g.create_fn
        spec = getattr(getattr(fn, "func", fn), "guard_spec", None)
        if spec is not None and spec.on_source is not None:
            out.append((g.originating_source, spec.on_source))
    return out
