"""DTensor entry points traced inside a compiled function.

- ``distribute_tensor``: the same steps as eager (torch/distributed/tensor/_api.py),
  with the scatter and broadcast from ``src_data_rank`` done as functional
  collectives, so the result is the same local shard on every rank.
- ``init_device_mesh`` / ``DeviceMesh(...)`` with constant arguments: built at
  trace time (see NOTE [meshes made while tracing]).
- ``implicit_replication()``: a context manager whose flag is set both while
  tracing and in the graph, like Dynamo's own ``torch.no_grad`` handling.

``DTensor.from_local`` / ``to_local`` / ``redistribute`` / ``full_tensor`` and
DTensor ops are traced by stock Dynamo with our mesh and placement trackers
as arguments (see NOTE [distributed objects in graphs] in base.py).
"""

from __future__ import annotations

import weakref
from typing import Any

from .. import _compat
from .._patching import Patcher
from .c10d.breaks import unsupported
from .functions import fold_call, register_handler, register_polyfill

# NOTE [meshes made while tracing]
# init_device_mesh(...) in a compiled function runs once, at trace time, with
# the same arguments on every rank (each rank traces the same code), so the
# process groups it creates match across ranks.  Later calls of the compiled
# code reuse that mesh: eager would build an equal mesh each call, so the
# results are the same, without a rendezvous per call.  Meshes are memoized
# by their arguments (per world) so a recompile does not create new groups
# either; the graph is guarded on the world and this rank (guards/world.py).
_MESH_CACHE: dict[Any, tuple[Any, Any]] = {}
# Set by register(): whether eager distribute_tensor refuses mixed Partial reduce ops (a _compat probe).
_REJECT_MIXED_PARTIALS = False


def _hashable(x: Any) -> Any:
    if isinstance(x, list | tuple):
        return tuple(_hashable(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    return x


def _memoized_mesh(fn: Any) -> Any:
    def make(*args: Any, **kwargs: Any) -> Any:
        # fold_call passes only trace-time constants (a traced tensor is a graph break first).
        # Memoized per world: after the world is destroyed and created again the old meshes'
        # groups are gone, so the entries of other worlds are dropped (which also bounds the table).
        import torch.distributed as dist

        world = dist.group.WORLD if dist.is_initialized() else None
        for stale in [k for k, (w, _) in _MESH_CACHE.items() if w() is not world]:
            del _MESH_CACHE[stale]
        key = (fn, _hashable(args), _hashable(kwargs))
        if key not in _MESH_CACHE:
            mesh = fn(*args, **kwargs)
            _MESH_CACHE[key] = ((lambda: None) if world is None else weakref.ref(world), mesh)
        return _MESH_CACHE[key][1]

    make.__qualname__ = getattr(fn, "__qualname__", "make_mesh")
    return make


def _mesh_handler(fn: Any) -> Any:
    make = _memoized_mesh(fn)

    def handler(tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        from ..guards.world import install_world_guard

        install_world_guard()  # the graph bakes this world's groups and this rank's coordinate
        return fold_call(make, tx, args, kwargs)

    return handler


def _shard_local(tensor: Any, dim: int, mesh: Any, axis: int, src_data_rank: Any) -> Any:
    """This rank's shard of ``tensor`` along ``dim`` over mesh axis ``axis`` (eager: ``Shard._make_shard_tensor``)."""
    import torch.distributed._functional_collectives as funcol

    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh
        return tensor.new_empty(0, requires_grad=tensor.requires_grad)
    if src_data_rank is not None:
        # Everyone takes the source rank's data, as eager's mesh_scatter does.
        tensor = funcol.broadcast(tensor.contiguous(), src_data_rank, (mesh, axis))
    pieces = torch_chunk(tensor, mesh.size(axis), dim)
    return pieces[coordinate[axis]].contiguous()


def torch_chunk(tensor: Any, n: int, dim: int) -> list[Any]:
    """``torch.chunk`` padded to ``n`` pieces with empty tensors (eager ``Shard._split_tensor``)."""
    import torch

    pieces = list(torch.chunk(tensor, n, dim=dim))
    while len(pieces) < n:
        shape = list(tensor.shape)
        shape[dim] = 0
        pieces.append(tensor.new_empty(shape))
    return pieces


def distribute_tensor(tensor: Any, device_mesh: Any = None, placements: Any = None, *, src_data_rank: Any = 0) -> Any:
    """Traceable ``torch.distributed.tensor.distribute_tensor`` (same checks and errors as eager)."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if device_mesh is None:
        from torch.distributed.device_mesh import _mesh_resources

        device_mesh = _mesh_resources.get_current_mesh()
    if placements is None:
        placements = [Replicate() for _ in range(device_mesh.ndim)]
    if len(placements) != device_mesh.ndim:
        raise ValueError(
            f"`placements` must have the same length as `device_mesh.ndim`! "
            f"Found placements length: {len(placements)}, and device_mesh.ndim: {device_mesh.ndim}."
        )
    if _REJECT_MIXED_PARTIALS:
        # Eager's assert_no_mixed_partial_types, with its message (the polyfill is traced, the helper is not).
        reduce_ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
        if len(reduce_ops) > 1 and reduce_ops != {"sum", "avg"}:
            raise ValueError(
                f"Mixed Partial reduce types are not supported in the same placement list. "
                f"Found reduce ops: {reduce_ops}. "
                f"Please ensure all Partial placements use the same reduce operation."
            )
    if isinstance(tensor, DTensor):
        if tensor.device_mesh != device_mesh:
            raise ValueError(
                f"Cannot distribute a DTensor with device mesh {tensor.device_mesh} "
                f"to a different device mesh {device_mesh}."
            )
        if tensor.placements != tuple(placements):
            raise ValueError(
                f"Cannot distribute a DTensor with placements {tensor.placements} "
                f"to a different placements {placements}. do you want to call "
                f"`redistribute` instead?"
            )
        return tensor
    local = tensor.detach()
    out_placements = []
    for axis, placement in enumerate(placements):
        if type(placement) is Shard:
            dim = placement.dim + tensor.ndim if placement.dim < 0 else placement.dim
            if dim < 0 or dim >= tensor.ndim:
                raise IndexError(
                    f"Dimension out of range (expected to be in range of [{-tensor.ndim}, {tensor.ndim - 1}], "
                    f"but got {placement.dim})"
                )
            local = _shard_local(local, dim, device_mesh, axis, src_data_rank)
            out_placements.append(Shard(dim))
        elif type(placement) is Replicate:
            if src_data_rank is not None:
                local = funcol.broadcast(local.contiguous(), src_data_rank, (device_mesh, axis))
            out_placements.append(placement)
        elif isinstance(placement, Partial):
            if src_data_rank is not None:
                local = funcol.broadcast(local.contiguous(), src_data_rank, (device_mesh, axis))
            local = placement._partition_value(local, device_mesh, axis)
            out_placements.append(placement)
        else:
            unsupported(
                "distribute_tensor",
                f"placement {placement!r} on mesh axis {axis}: distribute with Shard/Replicate/Partial, "
                "then redistribute to this placement",
            )
    if tensor.requires_grad:
        unsupported(
            "distribute_tensor",
            "the tensor requires grad: eager makes a new leaf DTensor that does not backpropagate to it; "
            "distribute parameters outside the compiled function",
        )
    return DTensor.from_local(
        local, device_mesh, out_placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


class ImplicitReplicationVariable(_compat.ContextWrappingVariable):
    """``implicit_replication()``: plain tensors in DTensor ops count as replicated inside the block."""

    @staticmethod
    def create(tx: Any) -> ImplicitReplicationVariable:
        return ImplicitReplicationVariable(target_values=[True], initial_values=[_get_flag()])

    def enter(self, tx: Any) -> Any:
        self._set(tx, self.target_values[0])
        return _compat.ConstantVariable.create(None)

    def exit(self, tx: Any, *args: Any) -> Any:
        assert self.initial_values is not None  # set by create()
        self._set(tx, self.initial_values[0])
        return _compat.ConstantVariable.create(None)

    def _set(self, tx: Any, value: bool) -> None:
        # In the graph (so AOTAutograd's retrace and the compiled code see it) and now (fake propagation).
        tx.output.create_node("call_function", set_implicit_replication, (value,), {})
        set_implicit_replication(value)

    def module_name(self) -> str:
        return "torch.distributed.tensor.experimental"

    def fn_name(self) -> str:
        return "implicit_replication"


def _get_flag() -> bool:
    from torch.distributed.tensor import DTensor

    return bool(DTensor._op_dispatcher._allow_implicit_replication)


def set_implicit_replication(value: bool) -> None:
    """Set DTensor's implicit-replication flag (what ``implicit_replication()`` toggles)."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher._allow_implicit_replication = value


def register(patches: Patcher) -> None:
    """Register the DTensor entry points this torch release has."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import distribute_tensor as eager_distribute_tensor

    # NOTE [mesh construction frames]: when mesh creation fails at trace time
    # (bad arguments), Dynamo falls back to running it eagerly and would then
    # trace DeviceMesh.__init__ as a frame of its own, with a half-built mesh
    # as `self`.  Those frames are construction code, never user code: skip them.
    for code in (init_device_mesh.__code__, DeviceMesh.__init__.__code__):
        patches.on_undo(_compat.skip_frames_of(code))
    # NOTE [to_local frames]: `x.to_local()` inside a traced frame is traced (the autograd.Function's
    # backward included).  Called from code that runs eagerly (a caller Dynamo skipped after a graph break,
    # e.g. transformers' _use_local_dtensor_params), `DTensor.to_local` and then `_ToTorchTensor.forward`
    # become frames of their own, whose backward calls the C++ compute_global_tensor_info: a graph break,
    # then one-op graphs recompiled per shape.  Those frames hold no user code: run them eagerly.
    for code in _compat.dtensor_to_local_codes():
        patches.on_undo(_compat.skip_frames_of(code))
    global _REJECT_MIXED_PARTIALS
    _REJECT_MIXED_PARTIALS = _compat.dtensor_rejects_mixed_partials()
    register_polyfill(eager_distribute_tensor, distribute_tensor)
    register_handler(init_device_mesh, _mesh_handler(init_device_mesh))
    register_handler(DeviceMesh, _mesh_handler(DeviceMesh))
    implicit = _compat.implicit_replication()
    if implicit is not None:
        register_handler(implicit, lambda tx, args, kwargs: ImplicitReplicationVariable.create(tx))
