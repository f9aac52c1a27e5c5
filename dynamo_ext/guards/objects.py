"""Guard specs for process groups, device meshes, placements and DTensor specs.

Each ``extract_*`` is total (any Python object gives a record; an object of the
wrong kind gives a record equal to no valid one) and each ``describe_*`` says
what changed, field by field, e.g. ``mesh dim names changed: ('dp', 'tp') ->
('tp',)``.
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .spec import GuardSpec


def _changes(kind: str, fields: tuple[str, ...], old: tuple[Any, ...], new: tuple[Any, ...]) -> str | None:
    if old == new:
        return None
    diffs = [f"{kind} {f} changed: {a!r} -> {b!r}" for f, a, b in zip(fields, old, new) if a != b]
    return "; ".join(diffs) or f"{kind} changed"


# ---- process group: by identity ---------------------------------------------
def extract_process_group(pg: Any) -> tuple[Any, ...]:
    """(id, type name, group name, global ranks, this process's group rank) of a ProcessGroup.

    The group rank is there because ``pg.rank()`` folds to a constant: a group
    re-created after ``destroy_process_group`` may reuse the old object's id.
    """
    import torch.distributed as dist

    if not isinstance(pg, dist.ProcessGroup):
        return (id(pg), type(pg).__name__, None, None, None)
    try:
        ranks = tuple(dist.get_process_group_ranks(pg))
    except (RuntimeError, ValueError):  # not registered with the default group
        ranks = None
    return (id(pg), type(pg).__name__, pg.group_name, ranks, pg.rank())


def describe_process_group(old: tuple[Any, ...], new: tuple[Any, ...]) -> str | None:
    if old == new:
        return None
    if old[1:] == new[1:]:
        return f"process group changed: another group object with the same name {old[2]!r} and ranks {old[3]}"
    return _changes("process group", ("object", "type", "name", "ranks", "rank"), old, new)


# ---- device mesh: by layout, dim names, device type, ranks and groups ----------
MESH_FIELDS = ("type", "device type", "shape", "dim names", "ranks", "process groups", "coordinate of this rank")


def extract_device_mesh(mesh: Any) -> tuple[Any, ...]:
    """(type name, device type, shape, dim names, flattened global ranks, group names, coordinate) of a DeviceMesh.

    The per-axis group names are part of the record because functional
    collectives over the mesh bake them into the graph: a mesh of the same
    layout built on other process groups must not run a graph compiled for
    the old groups.  The coordinate of this rank folds to constants
    (local chunks, ``get_local_rank``); it differs only when the process
    re-joins a re-created world as another rank.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        return (type(mesh).__name__, None, None, None, None, None, None)
    layout = mesh.mesh
    return (
        "DeviceMesh",
        mesh.device_type,
        tuple(layout.shape),
        mesh.mesh_dim_names,
        tuple(layout.flatten().tolist()),
        _compat.mesh_group_names(mesh),
        _coordinate(mesh),
    )


def _coordinate(mesh: Any) -> tuple[int, ...] | None:
    coordinate = mesh.get_coordinate()
    return None if coordinate is None else tuple(coordinate)


def describe_device_mesh(old: tuple[Any, ...], new: tuple[Any, ...]) -> str | None:
    return _changes("mesh", MESH_FIELDS, old, new)


# ---- placement: by value ------------------------------------------------------
def extract_placement(p: Any) -> tuple[Any, ...]:
    """(type, placement) — equal placements of the same class give equal records."""
    try:
        hash(p)
    except TypeError:
        return (type(p), id(p))
    return (type(p), p)


def describe_placement(old: tuple[Any, ...], new: tuple[Any, ...]) -> str | None:
    if old == new:
        return None
    return f"placement changed: {old[1]!r} -> {new[1]!r}"


# ---- DTensor spec: mesh, placements, shard order, dtype ----------------------------
SPEC_FIELDS = ("mesh", "placements", "shard order", "dtype")


def extract_dtensor_spec(spec: Any) -> tuple[Any, ...]:
    """(mesh record, placements, shard order, dtype) of a ``DTensorSpec``.

    Shapes and strides are left to Dynamo's tensor guards (as stock's
    ``DTENSOR_SPEC_MATCH`` does with ``skip_shapes=True``), so dynamic shapes
    keep working.
    """
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if not isinstance(spec, DTensorSpec):
        return (type(spec).__name__, None, None, None)
    meta = spec.tensor_meta
    return (
        extract_device_mesh(spec.mesh),
        tuple(spec.placements),
        _compat.dtensor_spec_shard_order(spec),
        None if meta is None else meta.dtype,
    )


def describe_dtensor_spec(old: tuple[Any, ...], new: tuple[Any, ...]) -> str | None:
    if old == new:
        return None
    parts = []
    if old[0] != new[0]:
        parts.append(describe_device_mesh(old[0], new[0]) or "mesh changed")
    parts += [f"{f} changed: {a!r} -> {b!r}" for f, a, b in zip(SPEC_FIELDS[1:], old[1:], new[1:]) if a != b]
    return "DTensor " + "; ".join(parts)


PROCESS_GROUP = GuardSpec("process group", extract_process_group, describe_process_group)
DEVICE_MESH = GuardSpec("mesh", extract_device_mesh, describe_device_mesh)
PLACEMENT = GuardSpec("placement", extract_placement, describe_placement)
DTENSOR_SPEC = GuardSpec("dtensor spec", extract_dtensor_spec, describe_dtensor_spec)
