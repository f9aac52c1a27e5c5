"""FSDP2 (``fully_shard``) forward hooks traced into the graph.

FSDP2 marks its module hooks ``torch._dynamo.disable`` (``_dynamo_disable`` in
torch/distributed/fsdp/_fully_shard/_fsdp_common.py), so stock Dynamo breaks
the graph at every FSDP module.  We trace, in their place, what the hooks do
to the numbers of a forward pass:

- pre-forward: each parameter's local shard is all-gathered over the shard
  mesh axis (a functional collective, with autograd: its backward is a
  reduce-scatter), the padding FSDP adds to dim 0 is cut off, and the
  unsharded tensor (for FSDP over TP, a DTensor on the TP mesh) is set on the
  module as the parameter, as ``FSDPParam.to_unsharded`` does;
- post-forward: the sharded parameter is set back, as ``FSDPParam.to_sharded``
  does.

Lazy initialisation (choosing the root, building param groups) runs once at
trace time on the real FSDP state, as the root's first eager pre-forward would.
Streams, prefetching and memory reuse are eager-only concerns: inside a graph
the scheduler and Inductor order the collectives.  Backward hooks (gradient
reduce-scatter through FSDP's own post-backward) are not traced here.
"""

from __future__ import annotations

from typing import Any

from .. import _compat, graph_breaks
from .functions import register_polyfill


def _all_gather_autograd() -> Any:
    import torch.distributed._functional_collectives as funcol

    # all_gather_tensor_autograd: backward is a reduce-scatter (sum).
    return getattr(funcol, "all_gather_tensor_autograd", funcol.all_gather_tensor)


def unshard_param(fsdp_param: Any) -> Any:
    """The unsharded parameter of one ``FSDPParam``: ``orig_size``, ``param_dtype`` or its own dtype.

    Gathers ``sharded_param``'s local tensor (shape ``[ceil(d0 / W), ...]`` after
    padding, W = shard world size) along dim 0 over the shard group, then keeps
    the first ``orig_size[0]`` rows.
    """
    import torch
    import torch.nn.functional as F  # noqa: N812

    local = fsdp_param.sharded_param.to_local()
    if fsdp_param.param_dtype is not None:
        local = local.to(fsdp_param.param_dtype)
    padded_rows = fsdp_param.padded_sharded_param_size[0]
    if local.size(0) < padded_rows:
        pad = [0, 0] * (local.dim() - 1) + [0, padded_rows - local.size(0)]
        local = F.pad(local, pad)
    group = fsdp_param.mesh_info.shard_process_group
    full = _all_gather_autograd()(local.contiguous(), 0, group)
    size = fsdp_param._orig_size
    full = torch.narrow(full, 0, 0, size[0]).reshape(size)
    if fsdp_param.is_dtensor:
        # FSDP over TP: the gathered tensor is this rank's TP shard; the
        # unsharded parameter is that shard as a DTensor on the TP mesh.
        from torch.distributed.tensor import DTensor

        spec = unsharded_spec(fsdp_param)
        meta = spec.tensor_meta
        full = DTensor.from_local(
            full, spec.mesh, spec.placements, run_check=False, shape=meta.shape, stride=meta.stride
        )
    return full


def unsharded_spec(fsdp_param: Any) -> Any:
    """The ``DTensorSpec`` of an FSDP-over-TP parameter once unsharded (2.12+: ``_unsharded_dtensor_spec``, 2.11: ``_tp_spec``)."""
    spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None)
    return spec if spec is not None else fsdp_param._tp_spec


def _set_param(fsdp_param: Any, tensor: Any) -> None:
    # Write the module's parameter dict directly, like FSDP's unsafe_setattr_param
    # fast path: the unsharded value is a graph tensor, not an nn.Parameter.
    info = fsdp_param._module_info
    info.module._parameters[info.param_name] = tensor
    for module, name in zip(info.shared_modules, info.shared_param_names):
        module._parameters[name] = tensor


def param_groups(state: Any) -> list[Any]:
    """The state's ``FSDPParamGroup``s: a list from 2.12 on, one optional group on 2.11."""
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    group = state._fsdp_param_group
    return [] if group is None else [group]


def pre_forward(state: Any, module: Any, args: Any, kwargs: Any) -> Any:
    """Traceable ``FSDPState._pre_forward``: unshard every parameter of the state's groups."""
    policy = state._mp_policy
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        args, kwargs = _cast_floats((args, kwargs), policy.param_dtype)
    for group in param_groups(state):
        for fsdp_param in group.fsdp_params:
            _set_param(fsdp_param, unshard_param(fsdp_param))
    return args, kwargs


def post_forward(state: Any, module: Any, input: Any, output: Any) -> Any:
    """Traceable ``FSDPState._post_forward``: put the sharded parameters back."""
    for group in param_groups(state):
        for fsdp_param in group.fsdp_params:
            _set_param(fsdp_param, fsdp_param.sharded_param)
    if state._mp_policy.output_dtype is not None:
        output = _cast_floats(output, state._mp_policy.output_dtype)
    return output


def _cast_floats(tree: Any, dtype: Any) -> Any:
    """Cast every floating-point tensor in ``tree`` to ``dtype`` (FSDP's MixedPrecisionPolicy casts)."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def _check_state(tx: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Lazy-init the real FSDP state at trace time; refuse layouts we do not gather."""
    state = getattr(args[0], "value", None)
    if state is None:
        graph_breaks.graph_break(
            graph_breaks.FSDP_LAYOUT, "FSDP hook called on an FSDP state created inside the compiled function"
        )
    if getattr(state, "_is_root", False) is None:
        state._lazy_init()
    for group in param_groups(state):
        for p in group.fsdp_params:
            spmd = getattr(p.mesh_info, "is_spmd_mesh", False)
            # torch 2.11 (one optional param group per state): FSDP over TP
            # fails in Dynamo's guards on TP's hook closures; break cleanly there.
            old_tp = p.is_dtensor and not hasattr(state, "_fsdp_param_groups")
            if p.fsdp_placement.dim != 0 or spmd or old_tp:
                graph_breaks.graph_break(
                    graph_breaks.FSDP_LAYOUT,
                    f"fully_shard parameter {p._module_info.param_name!r} with {p.fsdp_placement} "
                    f"(SPMD mesh: {spmd}, FSDP over TP on torch 2.11: {old_tp})",
                )


def register() -> None:
    """Trace FSDP2's forward hooks when this torch release has FSDP2."""
    state_cls = _compat.optional_attr("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState")
    if state_cls is None:
        return
    register_polyfill(state_cls.__dict__["_pre_forward"], pre_forward, check=_check_state)
    register_polyfill(state_cls.__dict__["_post_forward"], post_forward, check=_check_state)
