"""Dynamo: graph breaks, variable trackers, builders, sources, guards, frames, the compile lock.

The trackers and builders are re-exported as they are: their names and
constructors are the same on torch 2.11 to 2.15.  Importing this module
imports ``torch._dynamo`` (our trackers subclass its classes at import).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (loads the submodules read below)
from torch._dynamo import exc as _exc
from torch._dynamo import guards as _guards
from torch._dynamo import source as _source
from torch._dynamo import variables as _variables
from torch._dynamo.variables import builder as _builder

from .probes import optional_attr
from .tracing import invoke_subgraph_op

__all__ = [
    "AttrSource",
    "ConstantVariable",
    "ContextWrappingVariable",
    "GetAttrVariable",
    "GlobalSource",
    "GuardBuilder",
    "SourcelessBuilder",
    "TupleVariable",
    "Unsupported",
    "VariableBuilder",
    "VariableTracker",
    "apply_graph_deduplication",
    "backward_hook_variable_class",
    "compile_lock",
    "current_compile_id",
    "current_tx",
    "dynamo_convert_frame",
    "dynamo_counters",
    "empty_dict_guard",
    "fresh_compile_kwargs",
    "get_fake_value",
    "global_state_source",
    "graph_region_tracker_class",
    "guard_fail_reason_owner",
    "inside_higher_order_op",
    "install_guard",
    "is_compiling_context",
    "lambda_guard",
    "output_graph_class",
    "raise_observed_exception",
    "root_lambda_guard",
    "skip_frames_of",
    "source_name",
    "subgraph_tracer_class",
    "tracker_getattr",
    "unimplemented",
    "user_function_variable",
    "wrap_fx_proxy",
    "wrap_inline",
]

# Trackers, builders, sources and guard helpers: same names and constructors on 2.11 to 2.15.
unimplemented = _exc.unimplemented
raise_observed_exception = _exc.raise_observed_exception
Unsupported = _exc.Unsupported
VariableTracker = _variables.VariableTracker
ConstantVariable = _variables.ConstantVariable
ContextWrappingVariable = _variables.ContextWrappingVariable
GetAttrVariable = _variables.GetAttrVariable
TupleVariable = _variables.TupleVariable
VariableBuilder = _builder.VariableBuilder
SourcelessBuilder = _builder.SourcelessBuilder
GuardBuilder = _guards.GuardBuilder
install_guard = _guards.install_guard
AttrSource = _source.AttrSource
GlobalSource = _source.GlobalSource


def current_tx() -> Any:
    """The instruction translator tracing right now (Dynamo's ``InstructionTranslator.current_tx()``)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    return InstructionTranslator.current_tx()


def dynamo_counters() -> Any:
    """``torch._dynamo.utils.counters`` (graph breaks, unique graphs, ...)."""
    from torch._dynamo.utils import counters

    return counters


def inside_higher_order_op(tx: Any) -> bool:
    """Whether ``tx`` traces the body of a higher-order op (checkpoint, cond, ...): a nested subtracer."""
    tracer = getattr(getattr(tx, "output", None), "current_tracer", None)
    return getattr(tracer, "parent", None) is not None


def user_function_variable(fn: Any, **kwargs: Any) -> Any:
    """A ``UserFunctionVariable`` for ``fn`` (inlined by Dynamo when called)."""
    return _variables.UserFunctionVariable(fn, **kwargs)


def wrap_fx_proxy(tx: Any, proxy: Any, example_value: Any = None) -> Any:
    """A tracker for the result of a graph node (``torch._dynamo.variables.builder.wrap_fx_proxy``); its fake
    value computed from the node's inputs unless ``example_value`` is given."""
    return _builder.wrap_fx_proxy(tx, proxy, example_value=example_value)


def get_fake_value(node: Any, tx: Any) -> Any:
    """The fake value of graph node ``node``, computed by running it on its inputs' fake values.

    Run as Dynamo runs its own (``wrap_fx_proxy``): with the user's saved-tensor hooks deferred
    to run time, so a pack hook never sees the fake tensors a higher-order op saves while it runs.
    """
    from torch._dynamo import utils

    deferred = getattr(utils, "_disable_saved_tensors_hooks_during_tracing", None)
    with deferred() if deferred is not None else contextlib.nullcontext():
        return utils.get_fake_value(node, tx)


def backward_hook_variable_class() -> Any:
    """Dynamo's tracker for ``torch.utils.hooks.BackwardHook`` (``BackwardHookVariable``), or ``None``.

    In ``torch._dynamo.variables.distributed`` on 2.11 to 2.15, re-exported from ``torch._dynamo.variables``.
    """
    return getattr(_variables, "BackwardHookVariable", None)


def source_name(source: Any) -> str:
    """A Dynamo ``Source``'s name: a property from 2.13 on, a method before."""
    name = source.name
    return str(name() if callable(name) else name)


def tracker_getattr(tx: Any, tracker: Any, name: str) -> Any:
    """``tracker.name`` as Dynamo traces it: a VariableTracker's ``var_getattr`` (2.11 to 2.13), renamed
    ``tp_getattro_impl`` after CPython's type slots (2.14, 2.15)."""
    getter = getattr(tracker, "tp_getattro_impl", None) or tracker.var_getattr
    return getter(tx, name)


def global_state_source() -> Any:
    """Dynamo's ``GlobalStateSource()``: the source of guards on global state (grad mode, default device).

    In ``torch._dynamo.source`` on 2.11 to 2.15.
    """
    return _source.GlobalStateSource()


def lambda_guard(builder: Any, guard: Any, check: Any, verbose: str) -> None:
    """Attach ``check(value) -> bool`` to the guard manager of ``guard``'s source.

    ``GuardManager.add_lambda_guard(fn, verbose_code_parts, user_stack)`` on 2.11 to 2.15.
    """
    mgr = builder.get_guard_manager(guard)
    parts = _guards.get_verbose_code_parts(verbose, guard)
    mgr.add_lambda_guard(check, parts, guard.user_stack)


def empty_dict_guard(builder: Any, guard: Any, verbose: str) -> None:
    """Guard that the dict at ``guard``'s source is empty, in C++; ``verbose`` is the failure reason.

    ``GuardManager.add_dict_length_check_guard(length, verbose_code_parts, user_stack)`` (what
    Dynamo's ``SEQUENCE_LENGTH`` uses for dicts) on 2.11 to 2.15; a lambda guard where it is absent.
    """
    mgr = builder.get_guard_manager(guard)
    parts = _guards.get_verbose_code_parts(verbose, guard)
    add = getattr(mgr, "add_dict_length_check_guard", None)
    if add is not None:
        add(0, parts, guard.user_stack)
    else:
        mgr.add_lambda_guard(lambda d: isinstance(d, dict) and not d, parts, guard.user_stack)


def root_lambda_guard(builder: Any, guard: Any, check: Any, verbose: str) -> None:
    """Attach ``check(f_locals) -> bool`` to the root guard manager (a guard on global state).

    ``GuardBuilder.guard_manager.root.add_lambda_guard`` on 2.11 to 2.15, as Dynamo's own
    ``AUTOGRAD_SAVED_TENSORS_HOOKS`` guard does.
    """
    parts = _guards.get_verbose_code_parts(verbose, guard)
    builder.guard_manager.root.add_lambda_guard(check, parts, guard.user_stack)


def guard_fail_reason_owner() -> tuple[Any, str]:
    """(module, name) of the function that turns a failed guard into the recompile reason."""
    return _guards, "get_guard_fail_reason_helper"


def skip_frames_of(code: Any, *, recursive: bool = False) -> Any:
    """Make Dynamo run frames of ``code`` without tracing them (with ``recursive``, the frames they call too);
    return the undo function.

    ``set_code_exec_strategy`` (what ``torch._dynamo.eval_frame.skip_code`` calls) exists on 2.11 to 2.15.
    ``FrameAction`` and ``FrameExecStrategy`` come from the C module through ``torch._dynamo.types`` (that stub
    lacks them).
    """
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy  # pyright: ignore[reportPrivateImportUsage]

    callees = FrameAction.SKIP if recursive else FrameAction.DEFAULT
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, callees))
    return lambda: set_code_exec_strategy(code, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT))


def is_compiling_context(ctx: Any) -> bool:
    """Whether an ``OptimizedModule``'s ``dynamo_ctx`` compiles (not ``torch._dynamo.disable``'s context)."""
    from torch._dynamo.eval_frame import DisableContext

    return not isinstance(ctx, DisableContext)


def wrap_inline(module: Any) -> Any:
    """``external_utils.wrap_inline(module)``: a frame Dynamo can capture that calls ``module(...)`` with its hooks."""
    from torch._dynamo import external_utils

    return external_utils.wrap_inline(module)


def compile_lock() -> Any:
    """Dynamo's compile lock (``torch._dynamo.convert_frame.compile_lock``, a ``threading.RLock``).

    Held by Dynamo while it compiles a frame and by ``torch._dynamo.reset()``;
    ``dynamo_ext.install()`` holds it while patching so no frame is traced half
    patched.  On 2.11 to 2.15; a private lock of our own where absent.
    """
    from torch._dynamo import convert_frame

    return getattr(convert_frame, "compile_lock", _FALLBACK_COMPILE_LOCK)


_FALLBACK_COMPILE_LOCK = threading.RLock()


def current_compile_id() -> Any:
    """The ``CompileId`` of the frame Dynamo compiles now (``torch._guards.CompileContext.current_compile_id``).

    ``None`` outside a compile, or where ``CompileContext`` lacks ``current_compile_id`` (it has it on 2.11
    to 2.15).
    """
    current = getattr(optional_attr("torch._guards", "CompileContext"), "current_compile_id", None)
    return current() if current is not None else None


def output_graph_class() -> type:
    """``torch._dynamo.output_graph.OutputGraph``: its ``call_user_compiler`` hands a Dynamo graph to the backend."""
    return importlib.import_module("torch._dynamo.output_graph").OutputGraph


def subgraph_tracer_class() -> type:
    """``torch._dynamo.output_graph.SubgraphTracer``: its ``_create_proxy`` adds each node Dynamo traces."""
    return importlib.import_module("torch._dynamo.output_graph").SubgraphTracer


def graph_region_tracker_class() -> Any:
    """Dynamo's ``GraphRegionTracker`` where this release deduplicates identical graph regions into
    ``invoke_subgraph`` (``torch._dynamo.config.use_graph_deduplication``, ``OutputGraph.dedup_pass``); else None.

    2.11 to 2.15 have it (``torch/_dynamo/graph_region_tracker.py``, ``graph_deduplication.py``).
    """
    cfg = torch._dynamo.config
    if not all(hasattr(cfg, f) for f in ("use_graph_deduplication", "track_nodes_for_deduplication")):
        return None
    if invoke_subgraph_op() is None:
        return None
    if not callable(getattr(output_graph_class(), "dedup_pass", None)):
        return None
    tracker = optional_attr("torch._dynamo.graph_region_tracker", "GraphRegionTracker")
    if tracker is None or not all(hasattr(tracker, f) for f in ("track_node", "get_identical_regions")):
        return None
    return tracker


def apply_graph_deduplication(output_graph: Any) -> Any:
    """``torch._dynamo.graph_deduplication.apply_graph_deduplication(output_graph)``: identical regions of the
    Dynamo graph become one subgraph called by ``invoke_subgraph`` at each place; returns the new subgraphs."""
    return importlib.import_module("torch._dynamo.graph_deduplication").apply_graph_deduplication(output_graph)


def dynamo_convert_frame() -> Any:
    """``torch._dynamo.convert_frame``: every frame Dynamo compiles goes through its module-level ``_compile``.

    Raises:
        RuntimeError: this release has no module-level ``_compile`` there (2.11 to 2.15 have it).
    """
    module = importlib.import_module("torch._dynamo.convert_frame")
    if not callable(getattr(module, "_compile", None)):
        raise RuntimeError("torch._dynamo.convert_frame._compile is missing: dynamo-ext's block reuse needs it")
    return module


class _FreshBackend:
    """A ``torch.compile`` backend equal to no other: Dynamo reuses no cache entry made by another call."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        return self._inner(gm, example_inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:  # compiler_name, get_compiler_config, reset, ...
        if name == "_inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)


def fresh_compile_kwargs(compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` kwargs for a compile that shares no Dynamo cache entry with any other call.

    Dynamo reuses a code object's cache entries across ``torch.compile`` calls
    whose backends compare equal (``torch._TorchCompileWrapper.__eq__``).  The
    backend (resolved as ``torch.compile`` does, ``mode``/``options`` included) is
    wrapped in an object equal only to itself, and where ``torch.compile`` has
    ``isolate_recompiles`` (probed) the compile gets its own cache bucket, so its
    entries neither count toward nor disturb other calls' recompile limits.
    """
    kw = dict(compile_kwargs)
    backend = kw.pop("backend", "inductor")
    mode, options = kw.pop("mode", None), kw.pop("options", None)
    if mode is None and options is None:
        mode = "default"
    dynamic = kw.get("dynamic")
    if backend == "inductor":
        inner = torch._TorchCompileInductorWrapper(mode, options, dynamic)  # 2.11-2.15: `name` optional or absent
    else:
        inner = torch._TorchCompileWrapper(backend, mode, options, dynamic)
    kw["backend"] = _FreshBackend(inner)
    try:
        if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
            kw.setdefault("isolate_recompiles", True)
    except (TypeError, ValueError):
        pass
    return kw
