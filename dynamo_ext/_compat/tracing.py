"""Fake tensors, symbolic shapes, dispatch modes and op metadata: what ``make_fx`` tracing and graph passes read."""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._guards

from .probes import optional_attr

__all__ = [
    "aten_op",
    "boxed_codegen",
    "destroy_library",
    "detect_fake_mode",
    "evaluate_guard",
    "fake_mode_of",
    "fake_tensor",
    "free_unbacked_symbols",
    "global_state_functions",
    "has_fake_tensor",
    "holds_at_hints",
    "invoke_subgraph_op",
    "is_float_symbol",
    "is_higher_order_op",
    "is_traceable_subclass",
    "lazy_graph_module",
    "name_generated_code",
    "no_duck_shapes",
    "no_tracing_context",
    "op_schema",
    "own_tracing_context",
    "proxy_tensor_module",
    "refake",
    "reparametrize_module",
    "shape_env_facts",
    "storage_of",
    "symbolic_fake_mode",
    "tensorify_leaving_alone",
    "to_fake",
    "torch_dispatch_mode_base",
    "tracing_context",
]


def symbolic_fake_mode() -> Any:
    """A ``FakeTensorMode`` with its own ``ShapeEnv`` (symbolic sizes), as AOTAutograd builds one.

    Real tensors the traced code closes over (a mask in a gradient hook) are allowed: ``make_fx`` keeps them
    as constants of the graph.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)


def proxy_tensor_module() -> Any:
    """``torch.fx.experimental.proxy_tensor``: ``make_fx``'s tracer, whose ``snapshot_fake`` copies each traced
    value into its node's ``meta["val"]`` (private, present on 2.11 to 2.15)."""
    return importlib.import_module("torch.fx.experimental.proxy_tensor")


def fake_tensor(mode: Any, t: Any, *, dynamic_dim: int | None, name: str) -> Any:
    """``t`` as a fake tensor of ``mode``: every size static except ``dynamic_dim`` (a fresh symbol, hint = its size).

    ``ConstantSource`` names the symbol's origin in guards (Dynamo's ``torch._dynamo.source``).
    """
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    if dynamic_dim is None:
        return mode.from_tensor(t, static_shapes=True)
    sizes = [DimDynamic.DYNAMIC if d == dynamic_dim else DimDynamic.STATIC for d in range(t.ndim)]
    ctx = StatelessSymbolicContext(dynamic_sizes=sizes)
    return mode.from_tensor(t, source=ConstantSource(name), symbolic_context=ctx)


def no_duck_shapes() -> Any:
    """Context manager: Dynamo gives every dynamic size its own symbol (``torch.fx.experimental._config``).

    With duck shapes (the default) a batch size equal to a static size (3 samples, 3 channels) shares its
    symbol, and the guard that pins the channels pins the batch too: a recompile for the next batch size.
    """
    from torch.fx.experimental import _config

    return _config.patch(use_duck_shape=False)  # pyright: ignore[reportAttributeAccessIssue]  # install_config_module adds it


def no_tracing_context() -> Any:
    """Context manager: no ``TracingContext`` (``torch._guards.tracing(None)``), so ``detect_fake_mode`` reads the
    fake mode off the values themselves rather than the context's."""
    return torch._guards.tracing(None)


def has_fake_tensor(args: Any) -> bool:
    """Whether ``args`` (a call's arguments; lists and tuples one level deep) hold a fake tensor
    (``torch._subclasses.fake_tensor.FakeTensor``), or a fake mode is active."""
    from torch._subclasses.fake_tensor import FakeTensor

    if torch._guards.detect_fake_mode() is not None:
        return True
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, FakeTensor):
                return True
    return False


def fake_mode_of(values: list[Any]) -> Any:
    """The fake mode of the active ``TracingContext`` or of fake tensors among ``values``
    (``torch._guards.detect_fake_mode``); a new ``FakeTensorMode`` when there is none."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return torch._guards.detect_fake_mode(values) or FakeTensorMode()


def storage_of(value: Any) -> Any:
    """A hashable handle of the storage a tensor's data lives in (a DTensor's local tensor's), or None."""
    from torch.multiprocessing.reductions import StorageWeakRef

    local = getattr(value, "_local_tensor", value)
    try:
        return StorageWeakRef(local.untyped_storage())
    except (NotImplementedError, RuntimeError, AttributeError):
        return None


def detect_fake_mode(values: list[Any]) -> Any:
    """``torch._guards.detect_fake_mode`` over example values (None when none are fake)."""
    fn = optional_attr("torch._guards", "detect_fake_mode")
    return fn(values) if fn is not None else None


def to_fake(mode: Any, value: Any) -> Any:
    """``value`` with each real tensor in it (lists and tuples too) made a fake tensor of ``mode``
    (``torch._dynamo.utils.to_fake_tensor``, memoized by the mode, as Dynamo made its example values)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, list | tuple):
        return type(value)(to_fake(mode, v) for v in value)
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        return importlib.import_module("torch._dynamo.utils").to_fake_tensor(value, mode)
    return value


def refake(mode: Any, value: Any) -> Any:
    """A fake tensor of ``mode`` with the metadata of ``value``, a fake tensor of another mode (or a DTensor of
    one): ``FakeTensorMode.from_tensor``, as Dynamo makes the backend's inputs from its own fake values."""
    return mode.from_tensor(value)


def is_traceable_subclass(value: Any) -> bool:
    """Whether ``value`` is a traceable tensor subclass (DTensor, ...): ``torch._subclasses.fake_tensor``-free probe."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value)


def torch_dispatch_mode_base() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode`` (the base of every dispatch mode, 2.11 to 2.15)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def reparametrize_module(module: Any, tensors: dict[str, Any]) -> Any:
    """Context manager swapping ``module``'s parameters and buffers for ``tensors`` (by qualified name).

    ``torch.nn.utils.stateless._reparametrize_module`` (2.11 to 2.15; what ``torch.func.functional_call``
    uses), with tied weights kept tied.
    """
    from torch.nn.utils import stateless

    return stateless._reparametrize_module(module, tensors, tie_weights=True)


def op_schema(target: Any) -> Any:
    """The ``FunctionSchema`` of an ``OpOverload`` graph target (``target._schema``), ``None`` for anything else."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return target._schema


def aten_op(name: str) -> Any:
    """``torch.ops.aten.<name>`` (the overload packet), ``None`` where this build lacks the op.

    For ops some builds or releases lack, e.g. ``_fused_rms_norm`` (the fused RMSNorm Inductor keeps
    undecomposed on some devices).
    """
    return getattr(torch.ops.aten, name, None)


def is_higher_order_op(target: Any) -> bool:
    """Whether an FX node's target is a higher-order op (``torch._ops.HigherOrderOperator``)."""
    hop = getattr(importlib.import_module("torch._ops"), "HigherOrderOperator", None)
    return hop is not None and isinstance(target, hop)


def invoke_subgraph_op() -> Any:
    """``torch.ops.higher_order.invoke_subgraph`` (a region compiled once and called at each place: 2.11 to
    2.15), ``None`` where this release lacks it."""
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


def lazy_graph_module(root: torch.nn.Module | dict[str, Any], graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A ``GraphModule`` of ``graph`` (attributes read from ``root``, a module or a dict by name) whose Python
    code is generated when first needed (``torch.fx._lazy_graph_module._LazyGraphModule``, as Dynamo makes its
    output graph), a plain ``GraphModule`` where this release lacks the lazy class."""
    lazy = getattr(importlib.import_module("torch.fx._lazy_graph_module"), "_LazyGraphModule", None)
    return (lazy or torch.fx.GraphModule)(root, graph)


def destroy_library(lib: torch.library.Library) -> None:
    """Remove every definition and implementation ``lib`` registered (``Library._destroy``)."""
    lib._destroy()


def tracing_context() -> Any:
    """The active ``torch._guards.TracingContext`` (Dynamo's, while it compiles a frame); None outside one."""
    return torch._guards.TracingContext.try_get()


@contextlib.contextmanager
def own_tracing_context() -> Iterator[None]:
    """Run one of several backend compiles of a Dynamo graph in its own shallow copy of Dynamo's
    ``TracingContext`` (the same fake mode, guards and module context), with the per-compile fields
    AOTAutograd and Inductor write (``fw_metadata``, ``output_strides``, DDPOptimizer's ``ddp_optimizer_ctx``
    and ``fakify_first_call``) cleared.  AOTAutograd keeps the context it compiled a forward in for the lazily
    compiled backward (``AutogradLazyBackwardCompileInfo.saved_context``), so each backward then reads its own
    forward's metadata.  Without an active context, nothing is changed."""
    ctx = torch._guards.TracingContext.try_get()
    if ctx is None:
        yield
        return
    own = copy.copy(ctx)
    for name, value in (
        ("fw_metadata", None),
        ("output_strides", None),
        ("ddp_optimizer_ctx", None),
        ("fakify_first_call", False),
    ):
        if hasattr(own, name):
            setattr(own, name, value)
    with torch._guards.tracing(own):
        yield


def free_unbacked_symbols(value: Any) -> set[Any]:
    """The unbacked symbols (data-dependent sizes) in a SymInt, SymFloat, SymBool or sympy expression
    (``torch.fx.experimental.symbolic_shapes.free_unbacked_symbols``, 2.11 to 2.15)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols as free

    return set(free(value))


def boxed_codegen() -> Any:
    """FX's code generator for the boxed calling convention (``torch.fx.graph._BoxedCodeGen``, 2.13: the
    generated ``forward(self, args_list)`` takes its inputs from one list and clears it, so each input can be
    freed after its last use); None where the release has none."""
    cls = optional_attr("torch.fx.graph", "_BoxedCodeGen")
    return None if cls is None else cls()


def shape_env_facts(value: Any) -> tuple[Any, Iterator[Any], dict[Any, Any], dict[Any, Any]] | None:
    """``(shape_env, guard expressions, replacements, value ranges)`` of the ``ShapeEnv`` a SymInt, SymFloat or
    SymBool belongs to (``ShapeEnv.guards``, ``.replacements``, ``.var_to_range``: 2.11 to 2.15; the guards
    read as they are iterated, not copied); None for a plain value."""
    node = getattr(value, "node", None)
    env = getattr(node, "shape_env", None)
    if env is None:
        return None
    return env, (g.expr for g in env.guards), env.replacements, env.var_to_range


def holds_at_hints(shape_env: Any, expr: Any) -> bool:
    """Whether a sympy condition on sizes holds at the current sizes, recording nothing: its symbols replaced by
    their values (``ShapeEnv.backed_var_to_val``, 2.13 to 2.15; ``.var_to_val`` before).  False when a symbol
    has no value (an unbacked size)."""
    values = getattr(shape_env, "backed_var_to_val", None)
    if values is None:
        values = shape_env.var_to_val
    result = expr.xreplace(values)
    return bool(result) if not result.free_symbols else False


def evaluate_guard(shape_env: Any, expr: Any) -> bool:
    """Evaluate a sympy condition on sizes at the current sizes, recording it as a guard of the frame being
    compiled (``ShapeEnv.evaluate_expr``)."""
    return bool(shape_env.evaluate_expr(expr))


def is_float_symbol(symbol: Any) -> bool:
    """Whether a sympy symbol stands for a Python float Dynamo made dynamic (``zf0``: ``SymT.FLOAT``,
    ``torch.utils._sympy.symbol.symbol_is_type``, 2.11 to 2.15)."""
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    return symbol_is_type(symbol, SymT.FLOAT)


@contextlib.contextmanager
def tensorify_leaving_alone(names: set[str], also: Callable[[set[str]], set[str]] | None = None) -> Iterator[None]:
    """While in the block, AOTAutograd's tensorify pass (``torch.fx.passes._tensorify_python_scalars``) does not
    specialize the float symbols named ``names``; where it lists others to specialize (before it restarts Dynamo
    to pin them), ``also(listed)`` names more to list with them.

    The pass specializes every float symbol of the shape environment that the graph it runs on did not turn
    into a tensor, and restarts Dynamo to pin those it lists in ``TensorifyState`` (which it skips when already
    listed; 2.11 to 2.15).  ``names`` are listed for the block and taken off again after it (also when the pass
    restarts Dynamo); a release without ``TensorifyState`` has no such pass and nothing is done.
    """
    state = optional_attr("torch._dynamo.symbolic_convert", "TensorifyState")
    listed = getattr(state, "force_specializations", None)
    if not isinstance(listed, set):
        yield
        return
    before = set(listed)
    added = names - listed
    listed |= added
    try:
        yield
    finally:
        listed -= added
        if also is not None and (new := listed - before):
            listed |= also(new)


def global_state_functions() -> tuple[Any, ...]:
    """The calls of a Dynamo graph that set grad mode or autocast for the nodes after them
    (``torch.amp._enter_autocast``, ``torch.amp._exit_autocast``, ``torch._C._set_grad_enabled``: what
    ``split_module`` carries into each later submodule, its ``GLOBAL_STATE_NODES``, 2.11 to 2.15), in that order;
    None in place of one this release lacks."""
    return (
        optional_attr("torch.amp", "_enter_autocast"),
        optional_attr("torch.amp", "_exit_autocast"),
        optional_attr("torch._C", "_set_grad_enabled"),
    )


def name_generated_code(gm: torch.fx.GraphModule, filename: str) -> bool:
    """Regenerate ``gm``'s code so its ``forward`` is compiled under ``filename`` (not ``<eval_with_key>.N``).

    FX numbers the code it generates with a per-process counter; a ``co_filename`` in the graph's private
    ``_co_fields`` (what torch's own content-addressed names for the profiler use; 2.13 and 2.15) replaces
    that name.  Probed by the result: False (only a recompile done) where this release ignores the field.
    """
    graph = gm.graph
    if not hasattr(graph, "_co_fields"):
        return False
    graph._co_fields = {"co_filename": filename}  # pyright: ignore[reportAttributeAccessIssue]  # private field
    gm.recompile()
    return type(gm).forward.__code__.co_filename == filename
