"""Dynamo's state of the frame it traces, read and added to directly: sources resolved against the frame, the
side effects it holds, graph inputs lifted, guards added, node names (what stamping a block needs: NOTE [blocks
traced once] in ``dynamo_ext/blocks/trace_once.py``).

``Source.get_value`` appeared in 2.13 (:func:`block_trace_supported` probes it and the rest); the other names
are the same on 2.11 to 2.15.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (loads the submodules read below)
import torch._guards
from torch._dynamo import guards as _guards
from torch._dynamo import source as _source
from torch._dynamo import variables as _variables
from torch._dynamo.variables import builder as _builder

__all__ = [
    "Source",
    "block_trace_supported",
    "build_variable",
    "container_item_base",
    "duplicate_log",
    "frame_registrations",
    "global_trace_state",
    "hashable_key",
    "install_block_trace",
    "install_guard_quietly",
    "is_new_object",
    "make_dupe_guard",
    "mutated_sources",
    "mutation_log",
    "opaque_guard_values",
    "pending_attrs",
    "rename_node",
    "renamed_guard",
    "script_object_type",
    "source_kind",
    "source_value",
    "tensor_name_set",
    "tracks_nodes_for_deduplication",
    "variable_kind",
]

Source = torch._guards.Source


def block_trace_supported() -> bool:
    """Whether this release has what stamping a block needs: ``Source.get_value`` (resolving a source against
    the frame, 2.13 on), ``OutputGraph.root_tx`` and ``guard_on_key_order``, and ``SideEffects.store_attr`` /
    ``mutation`` (every mutation Dynamo records goes through one of them)."""
    from torch._dynamo import output_graph, side_effects

    graph_cls, effects_cls = output_graph.OutputGraph, side_effects.SideEffects
    return (
        callable(getattr(Source, "get_value", None))
        and "output_graph_weakref" in effects_cls.__init__.__code__.co_names
        and callable(getattr(graph_cls, "install_subgraph", None))
        and all(callable(getattr(effects_cls, f, None)) for f in ("store_attr", "mutation"))
        and callable(getattr(_variables.UnspecializedNNModuleVariable, "call_function", None))
    )


def tracks_nodes_for_deduplication() -> bool:
    """Whether Dynamo records each node it creates for graph deduplication (``use_graph_deduplication`` or
    ``track_nodes_for_deduplication``): it identifies regions by the instruction that made each node."""
    cfg = torch._dynamo.config
    return bool(getattr(cfg, "use_graph_deduplication", False) or getattr(cfg, "track_nodes_for_deduplication", False))


def install_block_trace(patches: Any, hook: Any) -> None:
    """What stamping blocks hooks into Dynamo, each patch undone by ``patches``:

    - ``UnspecializedNNModuleVariable.call_function`` (a module called while Dynamo traces, FSDP2's
      ``FSDPManagedNNModuleVariable`` included) routed through ``hook(tx, module_vt, args, kwargs, trace)``;
    - every tracker Dynamo records a mutation of (``SideEffects.store_attr`` and ``mutation``) logged in order
      on the frame's ``OutputGraph`` (:func:`mutation_log`): kept on the graph, not on its ``SideEffects``, which
      tracing a higher-order op's body replaces with a copy made before it;
    - the (source, earlier source) pairs for which ``VariableBuilder`` met an object it already tracked
      (``make_dupe_guard``), logged while a :func:`duplicate_log` block is open.
    """
    from torch._dynamo.side_effects import SideEffects

    cls = _variables.UnspecializedNNModuleVariable
    call_function = cls.call_function

    def hooked_call_function(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        return hook(tx, self, args, kwargs, lambda: call_function(self, tx, args, kwargs))

    store_attr, mutation = SideEffects.store_attr, SideEffects.mutation

    def _log(effects: Any, item: Any) -> None:
        output = effects.output_graph_weakref()  # 2.11 to 2.15 (``block_trace_supported`` probes it)
        if output is not None:
            mutation_log(output).append(item)

    def logged_store_attr(self: Any, item: Any, *args: Any, **kwargs: Any) -> Any:
        _log(self, item)
        return store_attr(self, item, *args, **kwargs)

    def logged_mutation(self: Any, var: Any) -> Any:
        _log(self, var)
        return mutation(self, var)

    make_dupe_guard = _guards.make_dupe_guard

    def logged_make_dupe_guard(obj_source: Any, dupe_source: Any) -> Any:
        if _DUPLICATES and dupe_source is not None:
            _DUPLICATES[-1].append((obj_source, dupe_source))
        return make_dupe_guard(obj_source, dupe_source)

    patches.setattr(cls, "call_function", hooked_call_function)
    patches.setattr(SideEffects, "store_attr", logged_store_attr)
    patches.setattr(SideEffects, "mutation", logged_mutation)
    patches.setattr(_builder, "make_dupe_guard", logged_make_dupe_guard)


_MUTATIONS = "_dynamo_ext_mutations"


def mutation_log(output: Any) -> list[Any]:
    """The trackers whose mutations the frame of ``output`` (an ``OutputGraph``) recorded, in order, repeats
    included, those made while a higher-order op's body was traced too (see above)."""
    log = output.__dict__.get(_MUTATIONS)
    if log is None:
        log = output.__dict__[_MUTATIONS] = []
    return log


def container_item_base(source: Any) -> Any:
    """The container's source when ``source`` names one of its items (``X._modules['3']``, ``X[3]``), else None."""
    while isinstance(source, _source.NNModuleSource):
        source = source.base
    index = getattr(source, "index", None)
    base = getattr(source, "base", None)
    if base is None or not isinstance(index, (str, int)):
        return None
    while isinstance(base, _source.NNModuleSource):
        base = base.base
    if isinstance(source, _source.DictGetItemSource) and isinstance(base, _source.AttrSource):
        return base.base if base.member == "_modules" else None
    return base if isinstance(source, _source.GetItemSource) else None


def source_kind(source: Any) -> str | None:
    """``"module"`` for a source that only marks its base as a module (``NNModuleSource`` and its FSDP and
    unspecialized kinds), ``"type"`` for ``type(base)`` (``TypeSource``), ``"class dict"`` for a class's
    ``__dict__`` or ``__mro__`` (``TypeDictSource``, ``TypeMROSource``); None for another source."""
    if isinstance(source, _source.NNModuleSource):
        return "module"
    if isinstance(source, _source.TypeSource):
        return "type"
    if isinstance(source, (_source.TypeDictSource, _source.TypeMROSource)):
        return "class dict"
    return None


def make_dupe_guard(obj_source: Any, dupe_source: Any) -> Any:
    """The guard Dynamo installs when it reaches, by ``obj_source``, an object it tracks by ``dupe_source``;
    None where it installs none (``torch._dynamo.guards.make_dupe_guard``)."""
    fn = _guards.make_dupe_guard(obj_source, dupe_source)
    return None if fn is None else obj_source.make_guard(fn)


def source_value(tx: Any, source: Any, cache: dict[Any, Any] | None = None) -> Any:
    """The object ``source`` names now, read from the frame Dynamo traces (``Source.get_value``)."""
    root = tx.output.root_tx
    return source.get_value({"G": root.f_globals, "L": root.f_locals}, {}, {} if cache is None else cache)


def build_variable(tx: Any, source: Any, value: Any) -> Any:
    """The tracker Dynamo makes for ``value`` read from ``source`` (lifting a graph input, with its guards)."""
    vt = _builder.VariableBuilder(tx, source)(value)
    return vt.realize() if hasattr(vt, "realize") else vt


def variable_kind(vt: Any) -> str | None:
    """``"tensor"`` for a graph tensor's tracker (exactly ``TensorVariable``), ``"constant"`` for a Python
    constant's (``ConstantVariable``), ``"sequence"`` for a tuple or list whose items it holds
    (``TupleVariable``, ``ListVariable``); None for another tracker."""
    if type(vt) is _variables.TensorVariable:
        return "tensor"
    if isinstance(vt, _variables.ConstantVariable):
        return "constant"
    if isinstance(vt, (_variables.TupleVariable, _variables.ListVariable)):
        return "sequence"
    return None


def opaque_guard_values(value: Any) -> Any:
    """What Dynamo's ``OPAQUE_OBJ_GUARD_FN_MATCH`` compares of an opaque object (a mesh passed as a graph input):
    the values of the guard function registered for its type (``extract_opaque_obj``, 2.12 on); the object's
    identity where this release has no such function."""
    extract = getattr(_guards, "extract_opaque_obj", None)
    return ("id", id(value)) if extract is None else ("values", extract(None, value))


def script_object_type(value: Any) -> type:
    """The class ``FAKE_SCRIPT_TYPE_MATCH`` checks: a fake script object's real object's, else the value's."""
    real = getattr(value, "real_obj", None)
    return type(value if real is None else real)


def is_new_object(vt: Any) -> bool:
    """Whether ``vt`` tracks an object made during the trace (``AttributeMutationNew`` / ``ValueMutationNew``)."""
    return type(getattr(vt, "mutation_type", None)).__name__ in ("AttributeMutationNew", "ValueMutationNew")


def pending_attrs(side_effects: Any, vt: Any) -> dict[str, Any]:
    """The attribute writes to ``vt``'s object that Dynamo holds until the frame returns."""
    return dict(side_effects.store_attr_mutations.get(vt, {}))


def hashable_key(key: Any) -> Any:
    """The Python key of a ``ConstDictVariable`` item (a ``HashableTracker``)."""
    vt = getattr(key, "vt", key)
    if hasattr(vt, "is_realized") and not vt.is_realized():
        return vt.original_value()
    return vt.as_python_constant()


def mutated_sources(side_effects: Any, add: list[Any] | None = None) -> set[Any]:
    """The sources Dynamo recorded a mutation through (``SideEffects.mutated_sources``; empty where absent),
    after recording mutations through ``add`` as a trace of them records them."""
    out = getattr(side_effects, "mutated_sources", None)
    if out is None:
        return set()
    out.update(add or ())
    return out


def frame_registrations(output: Any) -> tuple[int, ...]:
    """How many tensor hooks, backward-state entries, saved-for-backward records, Python ``random`` calls and
    shape guards the frame holds so far: a call that adds one leaves more than its nodes."""
    effects = output.side_effects
    backward_state = getattr(output, "backward_state", None) or {}
    return (
        len(effects.tensor_hooks),
        len(backward_state),
        len(getattr(effects, "save_for_backward", ())),
        len(getattr(output, "random_calls", ())),
        len(getattr(getattr(output, "shape_env", None), "guards", ())),
    )


def global_trace_state(tx: Any) -> tuple[Any, ...]:
    """Global state a traced call depends on: grad mode, autocast per device, Dynamo's torch function modes."""
    autocast = tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    modes = getattr(getattr(tx, "symbolic_torch_function_state", None), "mode_stack", ())
    return (
        torch.is_grad_enabled(),
        autocast,
        tuple(id(m) for m in modes),
        torch.are_deterministic_algorithms_enabled(),
    )


_DUPLICATES: list[list[tuple[Any, Any]]] = []


@contextlib.contextmanager
def duplicate_log() -> Any:
    """A list of the (source, earlier source) pairs :func:`install_block_trace` logs while the block runs."""
    found: list[tuple[Any, Any]] = []
    _DUPLICATES.append(found)
    try:
        yield found
    finally:
        _DUPLICATES.pop()


def renamed_guard(guard: Any, source: Any, create_fn: Any) -> Any:
    """``guard`` for another source (and create function), with the recorded user stack and nothing built."""
    return dataclasses.replace(
        guard,
        originating_source=source,
        create_fn=create_fn,
        _hash=None,
        code_list=None,
        obj_weakref=None,
        guarded_class_weakref=None,
        stack=None,
    )


def install_guard_quietly(output: Any, guard: Any) -> None:
    """Add ``guard`` to the frame's guards without capturing a Python stack for it (it has its user stack)."""
    try:
        output.guards.add(guard, collect_debug_stack=False)
    except TypeError:
        output.guards.add(guard)


def rename_node(node: Any, name: str) -> None:
    """Give a graph node the name Dynamo gives a value stored in a local variable (``set_name_hint``)."""
    node._rename(name)


def tensor_name_set(vt: Any, *, mark: bool = False) -> bool:
    """Whether a tensor tracker's node was named after a local variable (``TensorVariable._is_name_set``: a
    later store does not rename it); with ``mark``, mark it so first."""
    if mark and hasattr(vt, "_is_name_set"):
        vt._is_name_set = True
    return bool(getattr(vt, "_is_name_set", False))
