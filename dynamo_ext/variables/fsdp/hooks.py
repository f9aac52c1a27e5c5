"""FSDP2 (``fully_shard``) hooks traced into the graph, forward and backward.

FSDP2 marks its module hooks ``torch._dynamo.disable`` (``_dynamo_disable`` in
torch/distributed/fsdp/_fully_shard/_fsdp_common.py), so stock Dynamo breaks
the graph at every FSDP module.  We trace, in their place, what the hooks do
to the numbers of a training step:

- pre-forward: each param group's local shards are padded to FSDP's padded
  shard size and all-gathered together over the shard mesh axis, one
  collective per group as eager FSDP2 issues (NOTE [FSDP2 gathers per group],
  ``unshard.py``); each parameter's rows pass through an ``autograd.Function``
  whose backward is FSDP2's gradient reduction (NOTE [FSDP2 gradients in
  traced graphs], ``reduce.py``); the padding is cut off, and each unsharded tensor (for FSDP over TP, a
  DTensor on the TP mesh) is set on the module as the parameter, as
  ``FSDPParam.to_unsharded`` does; with ``reshard_after_forward`` the gather
  is recomputed in backward (NOTE [FSDP2 memory: re-gather in backward]);
- post-forward: the sharded parameter is set back, as ``FSDPParam.to_sharded``
  does.  FSDP2's eager backward hooks are not registered: the gradient flows
  through the gather's backward into the sharded parameter's ``.grad``.

NOTE [FSDP2 over an SPMD mesh]
torchtitan 0.3.0's default backend (``spmd_types``) keeps parameters as plain
local tensors annotated with spmd_types types and calls ``fully_shard`` on the
whole dp x tp mesh (``dp_mesh_dims``).  FSDP2 (torch 2.15) then stores each
such parameter as a DTensor on that mesh, sharded on dim 0 over the DP axis
(``_StridedShard`` where TP shards the same dim), and unshards it to the plain
TP-local tensor.  Traced the same way: the local shard is all-gathered over
the DP shard group (the TP-local tensor, as for FSDP over TP) and set on the
module as a plain tensor.  Its gradient: eager FSDP2 wraps it as a DTensor on
the full mesh with the backward types of the annotations (``R`` gives
``Partial``) and sums the non-DP axes where it is ``Partial`` before the DP
reduce-scatter (``_get_grad_inner_tensor``); the traced gather's output passes
through ``reduce.AllReduceGrad`` per such axis, so the backward does that sum
at the same point, in the gradient's dtype.  An SPMD mesh without spmd_types
annotations (``full_dtensor``: DTensor parameters on the full mesh) reduces
otherwise and is refused (``dynamo_ext: unsupported FSDP2 layout``).

Lazy initialisation (choosing the root, building param groups) runs once at
trace time on the real FSDP state, as the root's first eager pre-forward would.
Streams, prefetching and memory reuse are eager-only concerns: inside a graph
the scheduler and Inductor order the collectives.  Settings whose eager
reduction differs (:func:`untraced_reasons`) break the graph so FSDP2's own
hooks run; the settings are guarded (:data:`CONFIG_GUARD`).  Module groups
(``fully_shard([norm, output])``, one state for several modules) reach the
same pre- and post-forward through their own hooks (``groups.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from ... import _compat, graph_breaks
from ...guards.spec import GuardSpec, install_spec_guard
from ..functions import register_handler, register_polyfill
from . import passes, sources, unshard

log = logging.getLogger(__name__)
# FSDP2's TrainingState.IDLE: a state or param group between passes.
_IDLE = _compat.fsdp_idle_training_state()


def _set_param(fsdp_param: Any, tensor: Any) -> None:
    # Write the module's parameter dict directly, like FSDP's unsafe_setattr_param
    # fast path: the unsharded value is a graph tensor, not an nn.Parameter.
    info = fsdp_param._module_info
    info.module._parameters[info.param_name] = tensor
    for module, name in zip(info.shared_modules, info.shared_param_names):
        module._parameters[name] = tensor


def pre_forward(state: Any, module: Any, args: Any, kwargs: Any) -> Any:
    """Traceable ``FSDPState._pre_forward``: unshard every parameter of the state's groups.

    The first state to run forward begins the traced pass (NOTE [FSDP2 passes in traced frames]):
    its post-forward finishes the module groups whose pass did not reach their last module.  The
    tree's root always begins one.
    """
    ctx = state._state_ctx
    if state._is_root:
        ctx._dynamo_ext_forward_root = state
        if _IDLE is not None:  # what FSDP2's final backward callback resets (NOTE [FSDP2 passes in traced frames])
            ctx.iter_forward_root = None
    elif ctx._dynamo_ext_forward_root is None:
        ctx._dynamo_ext_forward_root = state
    args, kwargs = cast_inputs(state, args, kwargs)
    for group in _compat.fsdp_param_groups(state):
        for fsdp_param, full in zip(group.fsdp_params, unshard.unshard_group(group, state._is_root)):
            _set_param(fsdp_param, full)
    return args, kwargs


def post_forward(state: Any, module: Any, input: Any, output: Any) -> Any:
    """Traceable ``FSDPState._post_forward``: put the sharded parameters back."""
    reshard(state)
    ctx = state._state_ctx
    if ctx._dynamo_ext_forward_root is state:
        # FSDPState._force_complete_incomplete_states: a module group (fully_shard([a, b]))
        # whose traced pass skipped a module is finished by the pass's first state.
        for other in reversed(ctx.all_states):
            if other is not state and other._dynamo_ext_modules_to_run is not None:
                reshard(other)
                output = cast_output(other, output)
                other._dynamo_ext_modules_to_run = None
        ctx._dynamo_ext_forward_root = None
        if state._is_root and _IDLE is not None:
            # what FSDP2's final backward callback resets, at the end of the root's pass: the states are reached
            # through the root only after the blocks (NOTE [FSDP2 passes in traced frames])
            for other in ctx.all_states:
                other._training_state = _IDLE
                for group in _compat.fsdp_param_groups(other):
                    group._training_state = _IDLE
    return cast_output(state, output)


def reshard(state: Any) -> None:
    """Set the sharded parameters of every group of ``state`` back on their modules."""
    for group in _compat.fsdp_param_groups(state):
        for fsdp_param in group.fsdp_params:
            _set_param(fsdp_param, fsdp_param.sharded_param)


def cast_inputs(state: Any, args: Any, kwargs: Any) -> Any:
    """``FSDPState._cast_forward_inputs``: floating-point inputs to ``param_dtype`` when the policy says so."""
    policy = state._mp_policy
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        args, kwargs = _cast_floats((args, kwargs), policy.param_dtype)
    return args, kwargs


def cast_output(state: Any, output: Any) -> Any:
    """``FSDPState._cast_output_dtype``: floating-point outputs to ``output_dtype`` when set."""
    if state._mp_policy.output_dtype is not None:
        output = _cast_floats(output, state._mp_policy.output_dtype)
    return output


def _cast_floats(tree: Any, dtype: Any) -> Any:
    """Cast every floating-point tensor in ``tree`` to ``dtype`` (FSDP's MixedPrecisionPolicy casts)."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def untraced_reasons(state: Any) -> list[str]:
    """Why FSDP2's eager reduction of ``state``'s gradients is not the traced one; empty when it is.

    The traced backward (NOTE [FSDP2 gradients in traced graphs]) reduce-scatters
    every gradient at once over the shard group.  Eager FSDP2 does something
    else when gradient sync is off (it accumulates unsharded gradients), for
    HSDP (an extra all-reduce), with a user all-reduce hook, custom
    collectives, CPU offload, zero gradients for unused parameters, and while
    an unsharded gradient accumulated without sync waits to be reduced.
    """
    ddp_mesh_info = _compat.fsdp_ddp_mesh_info()
    reasons = []
    for group in _compat.fsdp_param_groups(state):
        checks = {
            "gradient sync is off (set_requires_gradient_sync(False))": not getattr(group, "reduce_grads", True),
            "HSDP (a replicate mesh axis)": ddp_mesh_info is not None and isinstance(group.mesh_info, ddp_mesh_info),
            "an all-reduce hook (set_all_reduce_hook)": getattr(group, "_all_reduce_hook", None) is not None,
            "custom collectives (set_custom_all_gather / set_custom_reduce_scatter)": any(
                type(getattr(group, a, None)).__name__ not in ("DefaultAllGather", "DefaultReduceScatter", "NoneType")
                for a in ("_all_gather_comm", "_reduce_scatter_comm")
            ),
            "CPU offload (OffloadPolicy)": any(p.offload_to_cpu for p in group.fsdp_params),
            "set_reduce_scatter_unused_params(True)": getattr(group, "reduce_scatter_unused_params", False),
            "an unsharded gradient accumulated without sync is pending": any(map(_pending_grad, group.fsdp_params)),
        }
        reasons += [r for r, hit in checks.items() if hit and r not in reasons]
    return reasons


def _pending_grad(fsdp_param: Any) -> bool:
    # Left by a backward with gradient sync off; FSDP2's next post-backward adds it before reducing.
    if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
        return True
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return unsharded is not None and unsharded.grad is not None


def config_record(state: Any) -> tuple[Any, ...]:
    """What the traced hooks of ``state`` depend on beyond its parameters (for its guard)."""
    policy = getattr(state, "_mp_policy", None)
    groups = []
    for group in _compat.fsdp_param_groups(state):
        # The traced gathers and reductions name the shard group in the graph (``reduce.plan``, read at trace time).
        shard_group = getattr(getattr(group, "mesh_info", None), "shard_process_group", None)
        groups.append(
            (
                None if shard_group is None else (shard_group.group_name, shard_group.size()),
                len(group.fsdp_params),
                getattr(group, "gradient_divide_factor", None),
                getattr(group, "force_sum_reduction_for_comms", False),
                getattr(group, "is_sharded", True),  # NOTE [FSDP2 passes in traced frames]
                tuple((p.param_dtype, p.reduce_dtype) for p in group.fsdp_params),
            )
        )
    # The policy is a frozen dataclass: compared by value.  Runs on every call (guard): keep it cheap.
    return (tuple(untraced_reasons(state)), policy, tuple(groups))


CONFIG_FIELDS = ("untraced configuration", "mixed precision policy", "param groups")


def describe_config(old: tuple[Any, ...], new: tuple[Any, ...]) -> str | None:
    """The FSDP2 settings that changed between two :func:`config_record` results, in words."""
    diffs = [f"FSDP2 {f} changed: {a!r} -> {b!r}" for f, a, b in zip(CONFIG_FIELDS, old, new) if a != b]
    return "; ".join(diffs) or None


# Mutable settings: no identity fast path (the state object stays, its settings change).
CONFIG_GUARD = GuardSpec(
    "FSDP2 settings", config_record, describe_config, identity_fast_path=False, on_source=sources.remember_state
)


def check_state(tx: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Lazy-init the real FSDP state at trace time; refuse layouts and settings we do not trace."""
    state = getattr(args[0], "value", None)
    if state is None:
        graph_breaks.graph_break(
            graph_breaks.FSDP_LAYOUT, "FSDP hook called on an FSDP state created inside the compiled function"
        )
    if getattr(state, "_is_root", False) is None:
        state._lazy_init()
    passes.init(state)
    if _compat.inside_higher_order_op(tx):
        # The hooks set the module's parameters: a side effect Dynamo refuses inside a
        # higher-order op body (activation checkpointing replays its region in backward).
        graph_breaks.graph_break(
            graph_breaks.FSDP_UNTRACED,
            "an FSDP2 module called inside torch.utils.checkpoint (or another higher-order op); "
            "checkpoint inside the FSDP2 module instead (around its submodules' compute)",
        )
    install_spec_guard(args[0].source, CONFIG_GUARD)
    sources.remember_state(args[0].source, state)  # NOTE [modules reached through an FSDP2 state]
    if passes.eagerly_unsharded(state):
        graph_breaks.graph_break(
            graph_breaks.FSDP_UNTRACED,
            "an FSDP2 module whose pass FSDP2's eager hooks started and left unsharded (after an earlier graph "
            "break or a skipped frame, or reshard_after_forward=False with no backward since); its hooks run "
            "eagerly too",
        )
    # One decision for the whole FSDP tree: traced hooks and eager FSDP2 hooks
    # do not mix within one backward (the eager root would not queue its callback).
    states = getattr(getattr(state, "_state_ctx", None), "all_states", None) or [state]
    for other in states:
        reasons = untraced_reasons(other)
        if reasons:
            log.info("FSDP2 hooks run eagerly (graph break): %s", "; ".join(reasons))
            graph_breaks.graph_break(graph_breaks.FSDP_UNTRACED, "; ".join(reasons))
    for group in _compat.fsdp_param_groups(state):
        for p in group.fsdp_params:
            # An SPMD mesh (fully_shard(..., dp_mesh_dims=...)) is traced for spmd_types parameters only
            # (NOTE [FSDP2 over an SPMD mesh]); full_dtensor's DTensor parameters reduce otherwise.
            spmd = getattr(p.mesh_info, "is_spmd_mesh", False) and not _annotated(p)
            # torch 2.11 (one optional param group per state): FSDP over TP
            # fails in Dynamo's guards on TP's hook closures; break cleanly there.
            old_tp = p.is_dtensor and _compat.fsdp_single_param_group()
            if p.fsdp_placement.dim != 0 or spmd or old_tp:
                graph_breaks.graph_break(
                    graph_breaks.FSDP_LAYOUT,
                    f"fully_shard parameter {p._module_info.param_name!r} with {p.fsdp_placement} "
                    f"(SPMD mesh without spmd_types annotations: {spmd}, FSDP over TP on torch 2.11: {old_tp})",
                )


def _annotated(fsdp_param: Any) -> bool:
    """Whether ``fsdp_param`` carries spmd_types annotations (its reduction's own refusal is :func:`_spmd_handler`'s)."""
    try:
        return _compat.fsdp_spmd_types_reductions(fsdp_param) is not None
    except ValueError:
        return True


def register() -> None:
    """Trace FSDP2's forward hooks when this torch release has FSDP2."""
    state_cls = _compat.fsdp_state_class()
    if state_cls is None:
        return
    register_handler(unshard.gather_with_fsdp_backward, unshard._gather_handler)
    register_handler(unshard.spmd_types_reductions, unshard._spmd_handler)
    register_polyfill(state_cls.__dict__["_pre_forward"], pre_forward, check=check_state)
    register_polyfill(state_cls.__dict__["_post_forward"], post_forward, check=check_state)
