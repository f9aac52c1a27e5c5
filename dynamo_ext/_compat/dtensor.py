"""DeviceMesh and DTensor internals: root meshes, per-axis group names, ``_StridedShard``, eager DTensor's behaviour."""

from __future__ import annotations

import functools
import inspect
from typing import Any

from .probes import optional_attr

__all__ = [
    "dtensor_around",
    "dtensor_new_empty_strided_drops_uneven_shard",
    "dtensor_rejects_mixed_partials",
    "dtensor_spec_key",
    "dtensor_spec_shard_order",
    "dtensor_strided_shard_shape_materializes_offsets",
    "dtensor_to_local_codes",
    "implicit_replication",
    "is_device_mesh",
    "is_placement",
    "local_tensor_of",
    "mesh_group_names",
    "mesh_state_for_cache_key",
    "root_mesh",
    "strided_shard_type",
]


def root_mesh(mesh: Any) -> Any:
    """The root ``DeviceMesh`` a submesh was sliced from (``DeviceMesh._get_root_mesh``), else ``mesh``."""
    get = getattr(mesh, "_get_root_mesh", None)
    return get() if callable(get) else mesh


def mesh_group_names(mesh: Any) -> tuple[str, ...] | None:
    """The names of a ``DeviceMesh``'s per-axis process groups (``mesh._dim_group_names``), ``None`` without them.

    These are the names functional collectives over the mesh bake into a graph;
    a mesh built with ``_init_backend=False`` has none.  Present on 2.11 to 2.15.
    """
    names = getattr(mesh, "_dim_group_names", None)
    return None if names is None else tuple(names)


def mesh_state_for_cache_key(mesh: Any) -> dict[str, Any]:
    """What pickling a ``DeviceMesh`` stores (its ``__getstate__``: the ``__dict__`` without the process-group
    registry) less ``_hash``, the ``hash()`` a mesh caches in its ``__dict__`` the first time it is hashed.

    ``_hash`` is ``hash()`` of the mesh's layout, rank map, device type, axis names and thread id (the
    fields ``__eq__`` compares, all kept in the returned state), so it adds nothing but a value that
    changes between processes (string hashing is randomized per process).  Present as a lazily set
    attribute on 2.11 to 2.15; a mesh that was never hashed has ``None`` or no ``_hash`` at all.
    """
    get_state = getattr(mesh, "__getstate__", None)
    state = get_state() if callable(get_state) else None
    state = dict(state if isinstance(state, dict) else vars(mesh))
    state.pop("_hash", None)
    return state


def strided_shard_type() -> type:
    """``torch.distributed.tensor.placement_types._StridedShard`` (private, present on 2.11 to 2.15).

    The placement of a tensor dim sharded over several mesh axes out of mesh order.
    """
    from torch.distributed.tensor import placement_types

    return placement_types._StridedShard


def dtensor_to_local_codes() -> tuple[Any, ...]:
    """The code objects of ``DTensor.to_local`` and of its autograd.Function's forward (``_ToTorchTensor``,
    private, in torch/distributed/tensor/_api.py on 2.11 to 2.15); the ones this release lacks are left out."""
    from torch.distributed.tensor import DTensor

    codes = [getattr(DTensor.to_local, "__code__", None)]
    to_torch = optional_attr("torch.distributed.tensor._api", "_ToTorchTensor")
    codes.append(getattr(getattr(to_torch, "forward", None), "__code__", None))
    return tuple(c for c in codes if c is not None)


def dtensor_rejects_mixed_partials() -> bool:
    """Whether eager DTensor refuses mixed ``Partial`` reduce ops in one placement list.

    ``torch.distributed.tensor._utils.assert_no_mixed_partial_types`` (called by
    ``distribute_tensor`` and ``DTensor.from_local`` where it exists).
    """
    return optional_attr("torch.distributed.tensor._utils", "assert_no_mixed_partial_types") is not None


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


def implicit_replication() -> Any:
    """``torch.distributed.tensor.experimental.implicit_replication`` (the context manager), ``None`` where absent."""
    return optional_attr("torch.distributed.tensor.experimental", "implicit_replication")


def dtensor_spec_shard_order(spec: Any) -> Any:
    """A ``DTensorSpec``'s ``shard_order`` (the order a tensor dim's mesh axes were sharded in), ``None`` without it.

    A field of ``DTensorSpec`` on 2.13 (checked here); a release without the field has no such order to
    guard, so ``None`` stands for it.
    """
    return getattr(spec, "shard_order", None)


def is_placement(value: Any) -> bool:
    """Whether ``value`` is a DTensor placement (``Shard``, ``Replicate``, ``Partial``, ``_StridedShard``)."""
    from torch.distributed.tensor.placement_types import Placement

    return isinstance(value, Placement)


def is_device_mesh(value: Any) -> bool:
    """Whether ``value`` is a ``DeviceMesh`` (its ``==`` compares the ranks, device type and axis names)."""
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(value, DeviceMesh)


def dtensor_spec_key(value: Any) -> Any:
    """A DTensor's layout as a hashable key: ``(mesh, placements, global shape, global stride)``; None for any
    other value.  The mesh compares by ``DeviceMesh.__eq__``: two slices of one mesh along the same axis are equal."""
    spec = getattr(value, "_spec", None)
    if spec is None or not hasattr(value, "_local_tensor"):
        return None
    return (spec.mesh, repr(tuple(spec.placements)), tuple(spec.shape), tuple(spec.stride))


def dtensor_around(value: Any, local: Any) -> Any:
    """A DTensor with ``value``'s spec (mesh, placements, global shape and stride) around ``local``, not
    requiring grad: what DTensor's dispatch of ``aten.detach`` returns for ``value`` when ``local`` is its
    local tensor detached, without the dispatch.  ``None`` where ``value`` is not a DTensor.

    DTensor's constructor (``DTensor(local_tensor, spec, *, requires_grad)``) and ``_spec`` are private;
    2.11 to 2.15 have both.
    """
    from torch.distributed.tensor import DTensor

    if type(value) is not DTensor:
        return None
    return DTensor(local, value._spec, requires_grad=False)


def local_tensor_of(value: Any) -> Any:
    """A DTensor's local tensor; any other tensor itself."""
    return getattr(value, "_local_tensor", value)
