"""FSDP2 (``torch.distributed.fsdp._fully_shard``) internals the traced hooks mirror."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from .probes import optional_attr

__all__ = [
    "fsdp_ddp_mesh_info",
    "fsdp_gradient_divide_factors",
    "fsdp_group_hook_codes",
    "fsdp_idle_training_state",
    "fsdp_module_class",
    "fsdp_param_group_class",
    "fsdp_param_groups",
    "fsdp_param_module_fqn",
    "fsdp_single_param_group",
    "fsdp_spmd_types_reductions",
    "fsdp_state_class",
    "fsdp_unsharded_spec",
]

_FSDP = "torch.distributed.fsdp._fully_shard"


def fsdp_state_class() -> type | None:
    """FSDP2's per-module state class (``_fully_shard._fsdp_state.FSDPState``), ``None`` without FSDP2.

    Its ``_pre_forward`` / ``_post_forward`` are what the traced hooks mirror; present on 2.11 to 2.15.
    """
    return optional_attr(f"{_FSDP}._fsdp_state", "FSDPState")


def fsdp_param_group_class() -> type | None:
    """FSDP2's parameter group class (``_fully_shard._fsdp_param_group.FSDPParamGroup``), ``None`` without FSDP2."""
    return optional_attr(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup")


def fsdp_module_class() -> type | None:
    """``torch.distributed.fsdp.FSDPModule`` (the class ``fully_shard`` mixes into a module), ``None`` without it."""
    return optional_attr("torch.distributed.fsdp", "FSDPModule")


def fsdp_param_groups(state: Any) -> list[Any]:
    """An ``FSDPState``'s ``FSDPParamGroup``s.

    A list (``_fsdp_param_groups``) from 2.12 on; 2.11 holds one optional group (``_fsdp_param_group``),
    returned as a list of zero or one.
    """
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def fsdp_unsharded_spec(fsdp_param: Any) -> Any:
    """The ``DTensorSpec`` of an FSDP-over-TP parameter once unsharded.

    ``FSDPParam._unsharded_dtensor_spec`` on 2.12+; 2.11 has only ``_tp_spec`` (the same spec there).
    """
    spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None)
    return spec if spec is not None else fsdp_param._tp_spec


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


def fsdp_single_param_group() -> bool:
    """Whether FSDP2's state holds one optional param group (2.11's ``_fsdp_param_group``), not a list (2.12+).

    Read from the names ``FSDPState.__init__`` sets, so it holds before any module is sharded.
    """
    state_cls = fsdp_state_class()
    return state_cls is not None and "_fsdp_param_groups" not in state_cls.__init__.__code__.co_names


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


class _Named(torch.nn.Module):
    """A module with a name, for the hook probe below."""

    name: str

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


@functools.cache
def fsdp_group_hook_codes() -> tuple[Any, Any, Any] | None:
    """Code objects of the forward hooks ``fully_shard([a, b, ...])`` registers, or ``None``.

    Returns ``(wrapper, pre, post)``: the code of FSDP2's ``_dynamo_disable``
    wrapper (the hook object a module holds) and of the group pre- and
    post-hooks it wraps (``hook.__wrapped__``; ``hook.__wrapped__.__wrapped__``
    is the state's bound ``_pre_forward`` / ``_post_forward``).  Probed by
    behaviour on two bare modules: ``None`` unless the hooks behave as the
    plugin's mirror (``variables/fsdp/groups.py``) assumes: the pre-hook runs
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

    a, b = _Named("a"), _Named("b")
    handle = register((a, b), pre, post, set(), cast)
    try:
        pre_hooks = [next(iter(m._forward_pre_hooks.values())) for m in (a, b)]
        post_hooks = [next(iter(m._forward_hooks.values())) for m in (a, b)]
        for m, pre_hook, post_hook in zip((a, b), pre_hooks, post_hooks):
            pre_hook(m, (), {})
            post_hook(m, (), None)
        pre_inner, post_inner = (getattr(h, "__wrapped__", None) for h in (pre_hooks[0], post_hooks[0]))
        wrapped_twice = all(getattr(i, "__wrapped__", None) is not None for i in (pre_inner, post_inner))
        if (
            calls != ["pre a", "cast", "pre b", "post b"]
            or pre_inner is None
            or post_inner is None
            or not wrapped_twice
        ):
            return None
        return pre_hooks[0].__code__, pre_inner.__code__, post_inner.__code__
    except Exception:  # a release whose group hooks look otherwise: not traced
        return None
    finally:
        handle.remove()


def fsdp_idle_training_state() -> Any:
    """FSDP2's ``TrainingState.IDLE`` (a state or param group between passes), ``None`` where absent."""
    return getattr(optional_attr(f"{_FSDP}._fsdp_common", "TrainingState"), "IDLE", None)


@functools.cache
def fsdp_ddp_mesh_info() -> Any:
    """FSDP2's ``DDPMeshInfo`` class (an HSDP mesh's info is one), ``None`` where absent."""
    return optional_attr(f"{_FSDP}._fsdp_common", "DDPMeshInfo")


def fsdp_spmd_types_reductions(fsdp_param: Any) -> tuple[tuple[str, int], ...] | None:
    """For an FSDP2 parameter annotated with ``spmd_types``: the sum all-reduces its gradient gets outside DP.

    ``None`` for any other parameter.  torch 2.15's ``FSDPParam`` marks such a parameter ``is_spmd_types``
    (``spmd_types`` installed and the parameter annotated when ``fully_shard`` ran: torchtitan 0.3.0's default
    backend); its unsharded parameter is the plain local tensor, and ``_get_grad_inner_tensor`` wraps the
    gradient as a DTensor on the full SPMD mesh with ``_spmd_grad_placements`` and redistributes the non-DP
    mesh axes (``_dp_dim_indices`` left out) to ``_unsharded_dtensor_spec``'s placements before the DP
    reduce-scatter.  Returns ``(group name, group size)`` per mesh axis where that is ``Partial(sum)`` to
    ``Replicate`` (a sum all-reduce), in mesh order.  Raises ``ValueError`` for any other change of
    placement (none that spmd_types' ``R/P/I/S`` types give a parameter).
    """
    if not getattr(fsdp_param, "is_spmd_types", False):
        return None
    spec = fsdp_param._unsharded_dtensor_spec
    dp_axes = fsdp_param._dp_dim_indices
    out = []
    for axis, (grad, target) in enumerate(zip(fsdp_param._spmd_grad_placements, spec.placements)):
        if axis in dp_axes or grad == target:
            continue
        if not (grad.is_partial() and getattr(grad, "reduce_op", None) == "sum" and target.is_replicate()):
            raise ValueError(f"gradient placement {grad} redistributed to {target} on mesh axis {axis}")
        group = spec.mesh.get_group(axis)
        out.append((group.group_name, group.size()))
    return tuple(out)
