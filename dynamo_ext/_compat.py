"""Every private torch API dynamo-ext touches, probed once per feature.

Supported: torch 2.11 to 2.15.  Each difference between releases is a probe
here (``hasattr``/import attempts), never a version-string comparison, so a
point release that back-ports a feature is handled too.  Other modules import
torch internals only through this one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (loads the submodules probed below)
from torch._dynamo import config as dynamo_config  # noqa: F401
from torch._dynamo import exc as _exc
from torch._dynamo import guards as _guards
from torch._dynamo import source as _source  # noqa: F401
from torch._dynamo import variables as _variables
from torch._dynamo.variables import builder as _builder

# ---- Dynamo: graph breaks, trackers, builders, guards -----------------------
unimplemented = _exc.unimplemented
raise_observed_exception = _exc.raise_observed_exception
Unsupported = _exc.Unsupported
VariableTracker = _variables.VariableTracker
ConstantVariable = _variables.ConstantVariable
ContextWrappingVariable = _variables.ContextWrappingVariable
VariableBuilder = _builder.VariableBuilder
SourcelessBuilder = _builder.SourcelessBuilder
GuardBuilder = _guards.GuardBuilder
install_guard = _guards.install_guard
AttrSource = _source.AttrSource
GlobalSource = _source.GlobalSource


GetAttrVariable = _variables.GetAttrVariable
TupleVariable = _variables.TupleVariable


def current_tx() -> Any:
    """The instruction translator tracing right now (Dynamo's ``InstructionTranslator.current_tx()``)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    return InstructionTranslator.current_tx()


def dynamo_counters() -> Any:
    """``torch._dynamo.utils.counters`` (graph breaks, unique graphs, ...)."""
    from torch._dynamo.utils import counters

    return counters


def in_autograd_backward() -> bool:
    """Whether an autograd node is running now (``torch._C._current_autograd_node``)."""
    try:
        return torch._C._current_autograd_node() is not None
    except (AttributeError, RuntimeError):
        return False


def compiled_autograd(compiler: Any) -> Any:
    """Context manager tracing the backward with compiled autograd (``compiled_autograd._enable``).

    Private in 2.11 to 2.15; torchtitan's training loop uses the same entry point.
    """
    from torch._dynamo import compiled_autograd as ca

    return ca._enable(compiler)


def inside_higher_order_op(tx: Any) -> bool:
    """Whether ``tx`` traces the body of a higher-order op (checkpoint, cond, ...): a nested subtracer."""
    tracer = getattr(getattr(tx, "output", None), "current_tracer", None)
    return getattr(tracer, "parent", None) is not None


def in_compiled_autograd_region() -> bool:
    """Whether a compiled-autograd graph is running now (``compiled_autograd.in_compiled_autograd_region``)."""
    from torch._dynamo import compiled_autograd as ca

    return bool(getattr(ca, "in_compiled_autograd_region", False))


def is_compiling_context(ctx: Any) -> bool:
    """Whether an ``OptimizedModule``'s ``dynamo_ctx`` compiles (not ``torch._dynamo.disable``'s context)."""
    from torch._dynamo.eval_frame import DisableContext

    return not isinstance(ctx, DisableContext)


def wrap_inline(module: Any) -> Any:
    """``external_utils.wrap_inline(module)``: a frame Dynamo can capture that calls ``module(...)`` with its hooks."""
    from torch._dynamo import external_utils

    return external_utils.wrap_inline(module)


def user_function_variable(fn: Any, **kwargs: Any) -> Any:
    """A ``UserFunctionVariable`` for ``fn`` (inlined by Dynamo when called)."""
    return _variables.UserFunctionVariable(fn, **kwargs)


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


def skip_frames_of(code: Any) -> Any:
    """Make Dynamo run frames of ``code`` without tracing them; return the undo function.

    ``torch._dynamo.eval_frame.skip_code`` / ``set_code_exec_strategy`` exist on 2.11 to 2.15.
    """
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.eval_frame import skip_code
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    skip_code(code)
    return lambda: set_code_exec_strategy(code, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT))


def dtensor_to_local_codes() -> tuple[Any, ...]:
    """The code objects of ``DTensor.to_local`` and of its autograd.Function's forward (``_ToTorchTensor``,
    private, in torch/distributed/tensor/_api.py on 2.11 to 2.15); the ones this release lacks are left out."""
    from torch.distributed.tensor import DTensor

    codes = [getattr(DTensor.to_local, "__code__", None)]
    to_torch = optional_attr("torch.distributed.tensor._api", "_ToTorchTensor")
    codes.append(getattr(getattr(to_torch, "forward", None), "__code__", None))
    return tuple(c for c in codes if c is not None)


# ---- Dynamo internals the audit reads -----------------------------------------
# Dynamo methods that log a graph break with the exception in a local named ``exc``
# (torch 2.11-2.15: ``InstructionTranslatorBase.log_graph_break``); on 2.13 the
# data-dependent-branch path (``jump_graph_break``) calls it outside any ``except``.
_GRAPH_BREAK_LOGGERS = frozenset({"log_graph_break"})


def graph_break_being_logged() -> BaseException | None:
    """The exception Dynamo is logging as a graph break right now, from inside a log handler.

    Read from the locals of Dynamo's ``log_graph_break`` frame on the current
    stack (exact, whether or not an ``except`` block is active), else from
    ``sys.exc_info()`` (the skip paths in ``convert_frame`` log inside their
    ``except``).  ``None`` when neither has one.
    """
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _GRAPH_BREAK_LOGGERS and "_dynamo" in frame.f_code.co_filename:
            exc = frame.f_locals.get("exc")
            if isinstance(exc, BaseException):
                return exc
        frame = frame.f_back
    return sys.exc_info()[1]


# Structured-trace event -> the local of the frame that logged it holding the GraphModule.
_LOGGED_GRAPH_LOCALS = {
    "dynamo_output_graph": ("gm",),
    "aot_forward_graph": ("fw_module",),
    "aot_inference_graph": ("fw_module",),
    "aot_backward_graph": ("bw_module",),
}


def graph_module_being_logged(trace_name: str) -> tuple[Any, int | None]:
    """The ``GraphModule`` (and AOTAutograd's ``aot_id``) whose text ``trace_structured(trace_name)`` is logging.

    Called from a log handler on ``torch.__trace``: read from the locals of the
    frame that called ``trace_structured`` (Dynamo's ``compile_and_call_fx_graph``:
    ``gm``; AOTAutograd's ``_log_fw_bw_graphs``: ``fw_module``/``bw_module``;
    ``aot_dispatch_base_graph``: ``fw_module``), so the graph is seen exactly as
    logged and nothing is recompiled.  ``(None, None)`` when that frame or local
    is not there (a cache hit logs only text; another torch release names them
    differently).
    """
    import sys

    names = _LOGGED_GRAPH_LOCALS.get(trace_name, ())
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "trace_structured":
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    if caller is None:
        return None, None
    loc = caller.f_locals
    gm = next((loc[n] for n in names if isinstance(loc.get(n), torch.fx.GraphModule)), None)
    aot_id = getattr(loc.get("aot_config"), "aot_id", None)
    return gm, aot_id if isinstance(aot_id, int) else None


def root_mesh(mesh: Any) -> Any:
    """The root ``DeviceMesh`` a submesh was sliced from (``DeviceMesh._get_root_mesh``), else ``mesh``."""
    get = getattr(mesh, "_get_root_mesh", None)
    return get() if callable(get) else mesh


def process_group_info(group_name: str) -> tuple[int, list[int]]:
    """(size, global ranks) of the process group registered as ``group_name``; ``(0, [])`` when unknown here."""
    import torch.distributed as dist

    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(group_name)
        return pg.size(), list(dist.get_process_group_ranks(pg))
    except Exception:
        return 0, []


def estimate_collective_ms(node: Any, *, intra_bw: float | None = None, inter_bw: float | None = None) -> float | None:
    """``torch._inductor.comm_analysis``'s NCCL time estimate (ms) of an FX collective node; ``None`` if it cannot.

    Its analytical model (NCCL's tuning.cc), not the NCCL simulator;
    ``intra_bw``/``inter_bw`` (GB/s) replace ``torch._inductor.config.intra_node_bw``/``inter_node_bw``.
    """
    try:
        from torch._inductor import comm_analysis
        from torch._inductor import config as inductor_config

        patch = {
            k: int(v) if float(v).is_integer() else v
            for k, v in (("intra_node_bw", intra_bw), ("inter_node_bw", inter_bw))
            if v is not None
        }
        estimate = comm_analysis.estimate_nccl_collective_runtime_from_fx_node
        with inductor_config.patch(patch):
            if "use_nccl_estimator" in inspect.signature(estimate).parameters:
                return float(estimate(node, use_nccl_estimator=False))  # no CUDA: the analytical model
            return float(estimate(node))
    except Exception:
        return None


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
    import inspect

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


# ---- torch.distributed -------------------------------------------------------
@functools.cache
def has_functional_op(name: str) -> bool:
    """Whether ``torch.ops._c10d_functional.<name>`` exists in this build."""
    try:
        getattr(torch.ops._c10d_functional, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def optional_attr(module: str, name: str) -> Any:
    """``module.name`` or ``None`` when this torch release lacks it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


# ---- FSDP2 internals ---------------------------------------------------------
_FSDP = "torch.distributed.fsdp._fully_shard"


def fsdp_gradient_divide_factors(group: Any, reduce_dtype: Any, factor: Any, force_sum: bool) -> tuple[Any, Any, Any]:
    """(predivide factor, postdivide factor, reduce-scatter op) eager FSDP2 uses for a 1-D shard group.

    FSDP2's own ``_get_gradient_divide_factors`` (``_fsdp_collectives.py``):
    ``(rs_group, ar_group, reduce_dtype, device_type, factor, force_sum)`` on
    2.13+; releases without ``force_sum_reduction_for_comms`` take one argument less.
    """
    fn = optional_attr(f"{_FSDP}._fsdp_collectives", "_get_gradient_divide_factors")
    if fn is None:
        raise NotImplementedError("this torch release has no FSDP2 _get_gradient_divide_factors")
    try:
        pre, post, rs_op, _ = fn(group, None, reduce_dtype, "", factor, force_sum)
    except TypeError:
        pre, post, rs_op, _ = fn(group, None, reduce_dtype, "", factor)
    return pre, post, rs_op


@functools.cache
def checkpoint_tags_nested_ops() -> bool:
    """Whether a compiled ``torch.utils.checkpoint`` region marks every op in it for recompute (2.12+).

    2.12+ run plain activation checkpointing through the selective-checkpoint path with an
    always-recompute policy (``_always_prefer_recompute`` in ``torch/_higher_order_ops/wrap.py``), which
    also tags ops inside a custom ``autograd.Function`` in the region; 2.11 tags only the region's own
    graph nodes.
    """
    return optional_attr("torch._higher_order_ops.wrap", "_always_prefer_recompute") is not None


def fsdp_single_param_group() -> bool:
    """Whether FSDP2's state holds one optional param group (2.11's ``_fsdp_param_group``), not a list."""
    state_cls = optional_attr(f"{_FSDP}._fsdp_state", "FSDPState")
    return state_cls is not None and "_fsdp_param_groups" not in state_cls.__init__.__code__.co_names


def source_name(source: Any) -> str:
    """A Dynamo ``Source``'s name: a property from 2.13 on, a method before."""
    name = source.name
    return name() if callable(name) else name


def fsdp_param_module_fqn(fsdp_param: Any) -> str | None:
    """Root-relative path of the module holding an ``FSDPParam``'s parameter (``"output"`` for ``output.weight``).

    From the parameter's FQN that FSDP2's root lazy init sets (``_param_fqn``) minus its name in its module
    (``_module_info.param_name``); ``None`` before lazy init or where this release names them otherwise.
    """
    fqn = getattr(fsdp_param, "_param_fqn", None)
    name = getattr(getattr(fsdp_param, "_module_info", None), "param_name", None)
    if not isinstance(fqn, str) or not isinstance(name, str) or not (fqn == name or fqn.endswith("." + name)):
        return None
    return fqn[: -len(name)].rstrip(".")


@functools.cache
def fsdp_group_hook_codes() -> tuple[Any, Any, Any] | None:
    """Code objects of the forward hooks ``fully_shard([a, b, ...])`` registers, or ``None``.

    Returns ``(wrapper, pre, post)``: the code of FSDP2's ``_dynamo_disable``
    wrapper (the hook object a module holds) and of the group pre- and
    post-hooks it wraps (``hook.__wrapped__``; ``hook.__wrapped__.__wrapped__``
    is the state's bound ``_pre_forward`` / ``_post_forward``).  Probed by
    behaviour on two bare modules: ``None`` unless the hooks behave as the
    plugin's mirror (``variables/fsdp_groups.py``) assumes: the pre-hook runs
    the state's pre-forward at every module of the group, the post-hook runs
    the state's post-forward at the last module of the pass and only casts the
    output (``cast_output_dtype``) at the others.
    """
    register = optional_attr(f"{_FSDP}._fsdp_state", "_register_group_forward_hooks")
    if register is None or "cast_output_dtype" not in inspect.signature(register).parameters:
        return None
    calls: list[str] = []

    def pre(module: Any, args: Any, kwargs: Any) -> Any:
        calls.append(f"pre {module.name}")
        return args, kwargs

    def post(module: Any, input: Any, output: Any) -> Any:
        calls.append(f"post {module.name}")
        return output

    def cast(output: Any) -> Any:
        calls.append("cast")
        return output

    a, b = torch.nn.Module(), torch.nn.Module()
    a.name, b.name = "a", "b"
    handle = register((a, b), pre, post, set(), cast)
    try:
        pre_hooks = [next(iter(m._forward_pre_hooks.values())) for m in (a, b)]
        post_hooks = [next(iter(m._forward_hooks.values())) for m in (a, b)]
        for m, pre_hook, post_hook in zip((a, b), pre_hooks, post_hooks):
            pre_hook(m, (), {})
            post_hook(m, (), None)
        inner = [getattr(h, "__wrapped__", None) for h in (pre_hooks[0], post_hooks[0])]
        if calls != ["pre a", "cast", "pre b", "post b"] or any(getattr(i, "__wrapped__", None) is None for i in inner):
            return None
        return pre_hooks[0].__code__, inner[0].__code__, inner[1].__code__
    except Exception:  # a release whose group hooks look otherwise: not traced
        return None
    finally:
        handle.remove()


def fsdp_forward_training_state() -> Any:
    """FSDP2's ``TrainingState.FORWARD`` (a state whose eager forward hooks are running), ``None`` where absent."""
    return getattr(optional_attr(f"{_FSDP}._fsdp_common", "TrainingState"), "FORWARD", None)


@functools.cache
def fsdp_ddp_mesh_info() -> Any:
    """FSDP2's ``DDPMeshInfo`` class (an HSDP mesh's info is one), ``None`` where absent."""
    return optional_attr(f"{_FSDP}._fsdp_common", "DDPMeshInfo")


@functools.cache
def compiled_autograd_accumulate_grad_with_grad_arg() -> Any:
    """Compiled autograd's ``call_accumulate_grad(variable, grad, has_post_hooks)``, ``None`` where its form differs.

    Compiled autograd's graph calls it for every leaf (``torch/_dynamo/external_utils.py``); on 2.11 and
    2.12 it runs the C++ functional ``AccumulateGrad`` op; 2.14+ take ``variable_grad`` and return the
    new ``.grad`` instead.
    """
    fn = optional_attr("torch._dynamo.external_utils", "call_accumulate_grad")
    if fn is None:
        return None
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return fn if params == ["variable", "grad", "has_post_hooks"] else None


@functools.cache
def dtensor_new_empty_strided_drops_uneven_shard() -> bool:
    """Whether DTensor's ``new_empty_strided`` makes an unevenly sharded tensor's copy Replicate (2.11).

    Autograd's ``clone_obey_contract`` (accumulating a first gradient) allocates the ``.grad`` with
    ``new_empty_strided``; DTensor's ``new_factory_strategy`` on 2.11 keeps the input's placements for it
    only when the tensor is evenly shardable (its local-stride computation assumed even shards), so the
    gradient of an unevenly sharded parameter arrives full size and Replicate.
    """
    fn = optional_attr("torch.distributed.tensor._ops._tensor_ops", "new_factory_strategy")
    code = getattr(fn, "__code__", None)
    return code is not None and "is_tensor_evenly_shardable" in code.co_names


@functools.cache
def dtensor_strided_shard_shape_materializes_offsets() -> bool:
    """Whether a ``_StridedShard``'s local shape is computed through its offsets list (2.11, 2.12).

    ``_local_shard_size_and_offset`` without an ``offset_mode`` argument (``return_first_offset``
    instead) builds the offsets with ``.tolist()`` on an index tensor even when the caller wants only
    the size; under fake tensors that allocates unbacked SymInts no output binds, and Dynamo fails with
    ``PendingUnbackedSymbolNotFound`` on ``new_empty_strided`` of such a DTensor (autograd's
    ``clone_obey_contract``).
    """
    cls = optional_attr("torch.distributed.tensor.placement_types", "_StridedShard")
    fn = getattr(cls, "_local_shard_size_and_offset", None)
    if fn is None:
        return False
    try:
        return "offset_mode" not in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ---- module backward hooks (variables/backward_hooks.py) ----------------------
def backward_hook_variable_class() -> Any:
    """Dynamo's tracker for ``torch.utils.hooks.BackwardHook`` (``BackwardHookVariable``), or ``None``.

    In ``torch._dynamo.variables.distributed`` on 2.11 to 2.15, re-exported from ``torch._dynamo.variables``.
    """
    return getattr(_variables, "BackwardHookVariable", None)


def compiled_autograd_enabled() -> bool:
    """Whether compiled autograd is on while Dynamo traces (``compiled_autograd.compiled_autograd_enabled``)."""
    from torch._dynamo import compiled_autograd as ca

    return bool(getattr(ca, "compiled_autograd_enabled", False))


def wrap_fx_proxy(tx: Any, proxy: Any) -> Any:
    """A tracker for the result of a graph node (``torch._dynamo.variables.builder.wrap_fx_proxy``)."""
    return _builder.wrap_fx_proxy(tx, proxy)


TensorVariable = _variables.TensorVariable


# ---- DTensor internals (spmd/) ----------------------------------------------
def strided_shard_type() -> type:
    """``torch.distributed.tensor.placement_types._StridedShard`` (private, present on 2.11 to 2.15).

    The placement of a tensor dim sharded over several mesh axes out of mesh order.
    """
    from torch.distributed.tensor import placement_types

    return placement_types._StridedShard


def torch_dispatch_mode_base() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode`` (the base of every dispatch mode, 2.11 to 2.15)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


# ---- collective check (collective_check/) -------------------------------------
def op_schema(target: Any) -> Any:
    """The ``FunctionSchema`` of an ``OpOverload`` graph target (``target._schema``), ``None`` for anything else."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return target._schema


def distributed_initialized() -> bool:
    """Whether ``torch.distributed`` is available and its default group initialized."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def global_rank() -> int | None:
    """This process's rank in the default group, ``None`` when there is none."""
    import torch.distributed as dist

    return dist.get_rank() if distributed_initialized() else None


def _resolve_group(name: str) -> Any:
    """The live ``ProcessGroup`` named ``name`` (``distributed_c10d._resolve_process_group``), or ``None``."""
    if not name or not distributed_initialized():
        return None
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        return None


def group_ranks(name: str) -> tuple[int, ...]:
    """Sorted global ranks of the group named ``name``; ``()`` when no live group has that name."""
    import torch.distributed as dist

    group = _resolve_group(name)
    if group is None:
        return ()
    try:
        return tuple(sorted(dist.get_process_group_ranks(group)))
    except (RuntimeError, ValueError):
        return ()


def group_sequence_number(name: str) -> int | None:
    """How many collectives the group named ``name`` has issued so far, ``None`` when that cannot be read.

    Feature probe: ``ProcessGroup._get_sequence_number_for_group()`` (gloo and
    NCCL count every collective issued on the group, eager and
    ``_c10d_functional`` alike; Flight Recorder reads the same number).
    """
    group = _resolve_group(name)
    read = getattr(group, "_get_sequence_number_for_group", None)
    if read is None:
        return None
    try:
        return int(read())
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return None


def is_higher_order_op(target: Any) -> bool:
    """Whether an FX node's target is a higher-order op (``torch._ops.HigherOrderOperator``)."""
    hop = getattr(importlib.import_module("torch._ops"), "HigherOrderOperator", None)
    return hop is not None and isinstance(target, hop)


def group_is_fake(name: str) -> bool:
    """Whether the group named ``name`` runs on the single-process ``fake`` backend (no peer to meet)."""
    import torch.distributed as dist

    group = _resolve_group(name)
    if group is None:
        return False
    try:
        return dist.get_backend(group) == "fake"
    except (AttributeError, RuntimeError, ValueError):
        return False


def default_store() -> Any:
    """The default group's c10d store (``distributed_c10d._get_default_store()``), ``None`` without one."""
    if not distributed_initialized():
        return None
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def prefix_store(prefix: str, store: Any) -> Any:
    """``torch.distributed.PrefixStore(prefix, store)`` (public)."""
    import torch.distributed as dist

    return dist.PrefixStore(prefix, store)


def aot_backend_module() -> Any:
    """``torch._dynamo.backends.common``: AOTAutograd backends call ``aot_module_simplified`` through its globals."""
    return importlib.import_module("torch._dynamo.backends.common")


def default_partition() -> Any:
    """AOTAutograd's default ``partition_fn`` (``torch._functorch.partitioners.default_partition``)."""
    return importlib.import_module("torch._functorch.partitioners").default_partition


def serializable_compiler(compiler: Any, compiler_fn: Any) -> Any:
    """A copy of ``compiler`` (``SerializableAOTDispatchCompiler`` and the like) calling ``compiler_fn``."""
    import copy

    new = copy.copy(compiler)
    new.compiler_fn = compiler_fn
    return new


def aot_autograd_cache_off() -> Any:
    """Context manager: ``torch._functorch.config.enable_autograd_cache`` off (Inductor's FX cache stays on)."""
    return importlib.import_module("torch._functorch.config").patch(enable_autograd_cache=False)


def is_traceable_subclass(value: Any) -> bool:
    """Whether ``value`` is a traceable tensor subclass (DTensor, ...): ``torch._subclasses.fake_tensor``-free probe."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value)


def config_module() -> tuple[Any, Any]:
    """``(install_config_module, Config)`` from ``torch.utils._config_module`` (what torch's own configs use)."""
    mod = importlib.import_module("torch.utils._config_module")
    return mod.install_config_module, mod.Config


def install_checked_config_module(module: Any, check: Callable[[str, object], None]) -> None:
    """Make ``module`` a torch config module whose every write (attribute, ``patch``, ``load_config``) is checked.

    ``check(name, value)`` runs before a value is stored and raises to refuse it; the
    config module's own bookkeeping attributes are written unchecked.  Reading an unknown
    public name calls ``check(name, None)`` too, which must raise ``AttributeError`` for it.
    """
    install, _ = config_module()
    install(module)
    base = type(module)
    bypass = frozenset(getattr(base, "_bypass_keys", ()))

    class CheckedConfigModule(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: object) -> None:
            if name not in bypass:
                check(name, value)
            super().__setattr__(name, value)

        def __getattr__(self, name: str) -> Any:
            if not name.startswith("_") and name not in self._config:
                check(name, None)  # an unknown option (read, or patched: patch reads first): check's error
            return super().__getattr__(name)

    types.ModuleType.__setattr__(module, "__class__", CheckedConfigModule)  # the config module refuses it


def config_defaults(module: Any) -> dict[str, Any]:
    """``{name: default}`` of a torch config module's settings, in definition order."""
    return {name: entry.default for name, entry in module._config.items()}


# ---- end of collective check ----------------------------------------------------


# ---- guard soundness: what a guard must read to stay exact --------------------
def mesh_group_names(mesh: Any) -> tuple[str, ...] | None:
    """The names of a ``DeviceMesh``'s per-axis process groups (``mesh._dim_group_names``), ``None`` without them.

    These are the names functional collectives over the mesh bake into a graph;
    a mesh built with ``_init_backend=False`` has none.  Present on 2.11 to 2.15.
    """
    names = getattr(mesh, "_dim_group_names", None)
    return None if names is None else tuple(names)


def compile_lock() -> Any:
    """Dynamo's compile lock (``torch._dynamo.convert_frame.compile_lock``, a ``threading.RLock``).

    Held by Dynamo while it compiles a frame and by ``torch._dynamo.reset()``;
    ``dynamo_ext.install()`` holds it while patching so no frame is traced half
    patched.  On 2.11 to 2.15; a private lock of our own where absent.
    """
    from torch._dynamo import convert_frame

    return getattr(convert_frame, "compile_lock", _FALLBACK_COMPILE_LOCK)


_FALLBACK_COMPILE_LOCK = threading.RLock()


def dtensor_rejects_mixed_partials() -> bool:
    """Whether eager DTensor refuses mixed ``Partial`` reduce ops in one placement list.

    ``torch.distributed.tensor._utils.assert_no_mixed_partial_types`` (called by
    ``distribute_tensor`` and ``DTensor.from_local`` where it exists).
    """
    return optional_attr("torch.distributed.tensor._utils", "assert_no_mixed_partial_types") is not None


def global_state_source() -> Any:
    """Dynamo's ``GlobalStateSource()``: the source of guards on global state (grad mode, default device).

    In ``torch._dynamo.source`` on 2.11 to 2.15.
    """
    return _source.GlobalStateSource()


# ---- data_parallel: step tracing (spmd/step_trace.py) ------------------------
def reparametrize_module(module: Any, tensors: dict[str, Any]) -> Any:
    """Context manager swapping ``module``'s parameters and buffers for ``tensors`` (by qualified name).

    ``torch.nn.utils.stateless._reparametrize_module`` (2.11 to 2.15; what ``torch.func.functional_call``
    uses), with tied weights kept tied.
    """
    from torch.nn.utils import stateless

    return stateless._reparametrize_module(module, tensors, tie_weights=True)


def symbolic_fake_mode() -> Any:
    """A ``FakeTensorMode`` with its own ``ShapeEnv`` (symbolic sizes), as AOTAutograd builds one.

    Real tensors the traced code closes over (a mask in a gradient hook) are allowed: ``make_fx`` keeps them
    as constants of the graph.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)


def fake_tensor(mode: Any, t: Any, *, dynamic_dim: int | None, name: str) -> Any:
    """``t`` as a fake tensor of ``mode``: every size static except ``dynamic_dim`` (a fresh symbol, hint = its size).

    ``ConstantSource`` names the symbol's origin in guards (Dynamo's ``torch._dynamo.source``).
    """
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    if dynamic_dim is None:
        return mode.from_tensor(t, static_shapes=True)
    sizes = [DimDynamic.DYNAMIC if d == dynamic_dim else DimDynamic.STATIC for d in range(t.ndim)]
    ctx = StatelessSymbolicContext(dynamic_sizes=sizes)
    return mode.from_tensor(t, source=_source.ConstantSource(name), symbolic_context=ctx)


def no_duck_shapes() -> Any:
    """Context manager: Dynamo gives every dynamic size its own symbol (``torch.fx.experimental._config``).

    With duck shapes (the default) a batch size equal to a static size (3 samples, 3 channels) shares its
    symbol, and the guard that pins the channels pins the batch too: a recompile for the next batch size.
    """
    from torch.fx.experimental import _config

    return _config.patch(use_duck_shape=False)


def partitioners_module() -> Any:
    """``torch._functorch.partitioners`` (AOTAutograd's joint-graph partitioner; private in 2.11 to 2.15)."""
    return importlib.import_module("torch._functorch.partitioners")


def is_opaque_fx_node(node: Any) -> bool:
    """Whether an FX node's value is an opaque object (a mesh, a process group, a script object).

    AOTAutograd's own test (``graph_compile.is_opaque_node``, 2.12+); before it existed nothing was opaque.
    """
    fn = optional_attr("torch._functorch._aot_autograd.graph_compile", "is_opaque_node")
    return bool(fn is not None and fn(node))


# ---- split for overlap under DDP's python reducer ---------------------------------
def output_graph_class() -> type:
    """``torch._dynamo.output_graph.OutputGraph``: its ``call_user_compiler`` hands a Dynamo graph to the backend."""
    return importlib.import_module("torch._dynamo.output_graph").OutputGraph


def compiling_compiled_autograd_graph() -> bool:
    """Whether Dynamo is compiling a compiled-autograd backward graph now (the compile id's ``compiled_autograd_id``)."""
    current = getattr(torch._guards.CompileContext, "current_compile_id", None)
    compile_id = current() if current is not None else None
    return getattr(compile_id, "compiled_autograd_id", None) is not None


def compiled_autograd_hooks(output_graph: Any) -> Any:
    """The ``hooks`` argument of the compiled-autograd graph whose frame ``output_graph`` traces (its root
    instruction translator's ``f_locals``); None when there is none."""
    tx = getattr(output_graph, "root_tx", None)
    return (getattr(tx, "f_locals", None) or {}).get("hooks")


@contextlib.contextmanager
def backend_swapped(output_graph: Any, compiler_fn: Any) -> Iterator[Any]:
    """For one ``call_user_compiler``: ``output_graph.compiler_fn`` (the backend) replaced by ``compiler_fn``,
    restored on exit.  Yields the original backend (DDPOptimizer swaps the backend for one frame too, through
    ``_clone_with_backend``)."""
    original = output_graph.compiler_fn
    output_graph.compiler_fn = compiler_fn
    try:
        yield original
    finally:
        output_graph.compiler_fn = original


def reset_submod_compiler_state() -> None:
    """Undo what DDPOptimizer's ``SubmodCompiler`` leaves on the ``TracingContext`` (``ddp_optimizer_ctx``,
    ``fakify_first_call``), so the same Dynamo graph can be compiled whole after a failed split compile."""
    ctx = torch._guards.TracingContext.try_get()
    if ctx is None:
        return
    if hasattr(ctx, "ddp_optimizer_ctx"):
        ctx.ddp_optimizer_ctx = None
    if hasattr(ctx, "fakify_first_call"):
        ctx.fakify_first_call = False


def ddp_submod_compiler() -> tuple[Any, Any, Any]:
    """DDPOptimizer's ``(SubmodCompiler, propagate_dynamo_source, propagate_metadata)``
    (``torch._dynamo.backends.distributed``): compile each submodule of a split Dynamo graph with a backend."""
    mod = importlib.import_module("torch._dynamo.backends.distributed")
    return mod.SubmodCompiler, mod.propagate_dynamo_source, mod.propagate_metadata


def saved_tensors_hooks_off_during_tracing() -> Any:
    """``torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing()`` (DDPOptimizer wraps its submodule compiles in it)."""
    return importlib.import_module("torch._dynamo.utils")._disable_saved_tensors_hooks_during_tracing()


def ddp_first_bucket_bytes(ddp: Any) -> int:
    """A ``DistributedDataParallel``'s first-bucket cap in bytes (``_bucket_config.first_bucket_bytes_cap``;
    before that config object existed, ``dist._DEFAULT_FIRST_BUCKET_BYTES`` capped at ``bucket_bytes_cap``)."""
    config = getattr(ddp, "_bucket_config", None)
    if config is not None and hasattr(config, "first_bucket_bytes_cap"):
        return int(config.first_bucket_bytes_cap)
    import torch.distributed as dist

    return min(int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2**20)), int(ddp.bucket_bytes_cap))


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


def to_fake(mode: Any, value: Any) -> Any:
    """``value`` with each real tensor in it (lists and tuples too) made a fake tensor of ``mode``
    (``torch._dynamo.utils.to_fake_tensor``, memoized by the mode, as Dynamo made its example values)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, list | tuple):
        return type(value)(to_fake(mode, v) for v in value)
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        return importlib.import_module("torch._dynamo.utils").to_fake_tensor(value, mode)
    return value


# ---- AOTAutograd's input fakification ------------------------------------------
# Where AOTAutograd's callers read ``process_inputs`` from: its home module and the
# module that imports it by name (``aot_function``, ``aot_module_simplified``, export).
_PROCESS_INPUTS_HOMES = ("torch._functorch._aot_autograd.frontend_utils", "torch._functorch.aot_autograd")


def aot_process_inputs() -> tuple[Any, tuple[Any, ...]]:
    """AOTAutograd's input fakifier and the modules that hold it: ``(process_inputs, owners)``.

    ``process_inputs(flat_args, aot_config, fake_mode, shape_env, ...)`` turns the compiled
    region's inputs into fake tensors before tracing; it returns the fakes, or on releases that
    unwrap ``AsyncCollectiveTensor`` inputs first, ``(fakes, act_input_indices)``.  Probed by
    import, not by version; ``(None, ())`` where no such function exists.
    """
    original = None
    for name in _PROCESS_INPUTS_HOMES:
        original = optional_attr(name, "process_inputs")
        if callable(original):
            break
    if not callable(original):
        return None, ()
    owners = tuple(
        importlib.import_module(name)
        for name in _PROCESS_INPUTS_HOMES
        if optional_attr(name, "process_inputs") is original
    )
    return original, owners


def aot_unwraps_async_collective_inputs() -> bool:
    """Whether AOTAutograd replaces ``AsyncCollectiveTensor`` inputs by their waited local tensor before
    fakifying them: its ``ViewAndMutationMeta`` records where they were (``act_input_indices`` on 2.12 and
    2.13, ``act_input_paths`` on 2.14 and 2.15; neither on 2.11, which fakifies them as subclasses)."""
    import dataclasses

    meta = optional_attr("torch._functorch._aot_autograd.schemas", "ViewAndMutationMeta")
    if meta is None or not dataclasses.is_dataclass(meta):
        return False
    names = {f.name for f in dataclasses.fields(meta)}
    return bool(names & {"act_input_indices", "act_input_paths"})


def async_collective_tensor_type() -> type | None:
    """``torch.distributed._functional_collectives.AsyncCollectiveTensor`` (what ``DTensor.to_local()``
    returns after an ``async_op=True`` redistribute), or ``None`` where absent."""
    return optional_attr("torch.distributed._functional_collectives", "AsyncCollectiveTensor")


def tensor_hooks(t: Any) -> tuple[dict[int, Any], dict[int, Any]]:
    """``(register_hook hooks, register_post_accumulate_grad_hook hooks)`` of tensor ``t``, by handle id.

    ``Tensor._backward_hooks`` / ``Tensor._post_accumulate_grad_hooks`` (2.11 to 2.15; None when empty).
    """
    return dict(getattr(t, "_backward_hooks", None) or {}), dict(getattr(t, "_post_accumulate_grad_hooks", None) or {})
