"""Manual sharding (torch_xla's ``enable_manual_sharding`` / ``disable_manual_sharding``) and the global mesh.

In torch_xla, manual sharding turns a sharded tensor into its per-device
shard, on which the user calls collectives by hand, and back.  DTensor has
exactly that pair: ``to_local()`` (global view to this rank's shard) and
``DTensor.from_local`` (shards back to a global view), both differentiable,
so the two functions are thin wrappers that translate the partition spec.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from . import partition_spec as _spec
from .sharding import mark_sharding

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

_global_mesh: DeviceMesh | None = None


def set_global_mesh(mesh: DeviceMesh | None) -> None:
    """Set the mesh that functions taking ``mesh=None`` use (torch_xla's ``xs.set_global_mesh``)."""
    global _global_mesh
    _global_mesh = mesh


def get_global_mesh() -> DeviceMesh | None:
    """The mesh set by :func:`set_global_mesh`, or ``None`` (torch_xla's ``xs.get_global_mesh``)."""
    return _global_mesh


def _mesh_or_global(mesh: DeviceMesh | None, what: str) -> DeviceMesh:
    if mesh is None:
        mesh = _global_mesh
    if mesh is None:
        raise ValueError(f"{what}: no mesh given and no global mesh set; pass mesh= or call set_global_mesh(mesh)")
    return mesh


def enable_manual_sharding(
    t: torch.Tensor, partition_spec: _spec.PartitionSpec, *, mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """This rank's shard of ``t`` under ``partition_spec``, as a plain tensor, to work on by hand.

    ``mark_sharding(t, mesh, partition_spec).to_local()``: ``t`` is the global
    tensor (or a DTensor on ``mesh``, redistributed first).  Collectives on the
    result are the user's (``torch.distributed`` calls or functional
    collectives); bring the result back with :func:`disable_manual_sharding`.

    Raises:
        ValueError: as :func:`mark_sharding`, or no mesh and no global mesh.
    """
    mesh = _mesh_or_global(mesh, "enable_manual_sharding")
    return mark_sharding(t, mesh, partition_spec).to_local()


def disable_manual_sharding(
    t: torch.Tensor, partition_spec: _spec.PartitionSpec, full_shape: Sequence[int], *, mesh: DeviceMesh | None = None
) -> DTensor:
    """The DTensor of global shape ``full_shape`` whose shard on this rank is ``t``.

    ``DTensor.from_local(t, mesh, placements, shape=full_shape)`` with the
    placements of ``partition_spec``: each rank's ``t`` must be its tile of
    ``full_shape`` (not checked, as in torch_xla, to save a collective).

    Raises:
        ValueError: as :func:`mark_sharding` for the spec against ``full_shape``, or no mesh.
    """
    mesh = _mesh_or_global(mesh, "disable_manual_sharding")
    full_shape = torch.Size(full_shape)
    placements = _spec.to_placements(mesh, partition_spec, full_shape)
    stride = []
    step = 1
    for size in reversed(full_shape):
        stride.insert(0, step)
        step *= size
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=full_shape, stride=tuple(stride))
