"""``mark_sharding``, ``clear_sharding``, ``get_sharding``, ``with_sharding_constraint``, ``ShardingSpec``.

torch_xla's ``mark_sharding`` annotates the global (full) tensor so that
each device computes with its tile; the value of the tensor does not change.
Here the same call returns a DTensor whose local shard on the rank at mesh
coordinate ``c`` is the tile of the spec (see :mod:`.partition_spec`).  It is
built as ``DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim).redistribute(
mesh, placements)``: every rank holds the full tensor, the redistribute only
slices it (no communication), and autograd sees an identity, as torch_xla's
annotation is: the gradient of ``t`` is the full gradient on every rank (the
backward of the slice is an all-gather).  Every rank must pass the same
global value, as in torch_xla, where it is one logical tensor.

All of these trace under ``torch.compile(fullgraph=True)`` with the plugin
installed: the spec is folded at trace time (the mesh is guarded by the
plugin's mesh guard, a spec of constants by Dynamo's constant guards) and the
redistribute is traced like any DTensor redistribute.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from . import partition_spec as _spec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


def _replicated(t: torch.Tensor, mesh: Any) -> DTensor:
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _check_same_mesh(t: DTensor, mesh: Any, what: str) -> None:
    if t.device_mesh != mesh:
        raise ValueError(
            f"{what}: the tensor is a DTensor on {t.device_mesh}, not on the given mesh {mesh}; "
            "use the DTensor's own mesh, or clear_sharding(t) first"
        )


def _check_arguments(t: Any, mesh: Any, what: str) -> None:
    """TypeError naming the argument when ``t`` is no tensor or ``mesh`` no DeviceMesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor (or DTensor) to shard, got {type(t).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{what}: mesh must be a dynamo_ext.spmd.Mesh or a DeviceMesh, got {type(mesh).__name__}; "
            "build one with Mesh(device_ids, mesh_shape, axis_names) or init_device_mesh"
        )


def mark_sharding(t: torch.Tensor, mesh: DeviceMesh, partition_spec: _spec.PartitionSpec) -> DTensor:
    """Shard ``t`` over ``mesh`` as ``partition_spec`` says (torch_xla's ``xs.mark_sharding``).

    Args:
        t: the global tensor (the same value on every rank), any shape and dtype;
            or a DTensor on ``mesh``, which is redistributed to the spec.
        mesh: a :class:`~dynamo_ext.spmd.Mesh` or any ``DeviceMesh``.
        partition_spec: one entry per dim of ``t``: a mesh axis name, an axis
            index, ``None`` (not sharded) or a tuple of axes (sharded over all of
            them, the first one major).  Axes not named are replicated.

    Returns:
        A DTensor of ``t``'s shape and dtype whose local tensor on the rank at
        mesh coordinate ``c`` is ``t``'s tile for ``c``.  Unlike torch_xla, ``t``
        itself is not changed: use the returned tensor.

    Raises:
        TypeError: ``t`` is not a tensor or ``mesh`` not a ``DeviceMesh``.
        ValueError: a bad spec (torch_xla's messages: length not the rank of
            ``t``, unknown axis name, an axis used twice, an index out of range);
            a layout DTensor cannot represent (see :mod:`.partition_spec`); ``t`` is
            a DTensor on another mesh.

    Example (4 ranks)::

        mesh = Mesh(range(4), (2, 2), ("x", "y"))
        d = mark_sharding(torch.arange(16.0).reshape(4, 4), mesh, ("x", None))
        d.placements      # (Shard(dim=0), Replicate())
        d.to_local()      # rows 0-1 on ranks 0, 1; rows 2-3 on ranks 2, 3
    """
    _check_arguments(t, mesh, "mark_sharding")
    placements = _spec.to_placements(mesh, partition_spec, t.shape)
    if isinstance(t, DTensor):
        _check_same_mesh(t, mesh, "mark_sharding")
        return t if t.placements == placements else t.redistribute(mesh, placements)
    return _replicated(t, mesh).redistribute(mesh, placements)


def with_sharding_constraint(t: torch.Tensor, mesh: DeviceMesh, partition_spec: _spec.PartitionSpec) -> DTensor:
    """Constrain ``t`` to the layout of ``partition_spec`` inside compiled code (JAX's ``with_sharding_constraint``).

    A DTensor already laid out as the spec is returned as is (no op in the
    graph); another DTensor on ``mesh`` is redistributed (the collectives
    DTensor's redistribute issues, traced as functional collectives); a plain
    tensor is taken as the global value and sharded like :func:`mark_sharding`.
    Arguments, return value and errors are :func:`mark_sharding`'s.
    """
    return mark_sharding(t, mesh, partition_spec)


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    """The full (global) tensor of a DTensor; a plain tensor is returned as is (torch_xla's ``clear_sharding``).

    For a DTensor this is ``t.full_tensor()``: the collectives that make every
    rank hold the whole value (all-gathers for shards, all-reduces for
    ``Partial``), differentiable.  torch_xla drops the annotation in place; a
    DTensor cannot become a plain tensor in place, so use the returned tensor.
    """
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def get_sharding(t: torch.Tensor) -> _spec.PartitionSpec:
    """The partition spec of ``t``'s layout: ``get_sharding(mark_sharding(t, mesh, spec))`` is ``spec``.

    The spec comes back normalised: axes by name when the mesh has names (else by
    index), one-axis tuples as the bare axis.  A plain tensor is unsharded:
    ``(None,) * t.ndim``.

    Raises:
        ValueError: ``t`` has a ``Partial`` placement (a pending reduction) or a
            placement no partition spec describes.
    """
    if not isinstance(t, DTensor):
        return (None,) * t.ndim
    return _spec.from_placements(t.device_mesh, t.placements, t.ndim)


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """A mesh and a partition spec to apply to tensors later (torch_xla's ``xs.ShardingSpec``).

    torch_xla's ``minibatch`` flag (shard a per-host batch along the batch dim)
    has no counterpart: DTensor inputs are global tensors.
    """

    mesh: DeviceMesh
    partition_spec: _spec.PartitionSpec

    def can_apply(self, t: torch.Tensor) -> bool:
        """Whether the spec has one entry per dim of ``t`` (torch_xla's check)."""
        return len(t.shape) == len(self.partition_spec)

    def apply(self, t: torch.Tensor) -> DTensor:
        """``mark_sharding(t, self.mesh, self.partition_spec)``."""
        return mark_sharding(t, self.mesh, self.partition_spec)
