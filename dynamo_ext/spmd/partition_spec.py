"""Partition specs (torch_xla / JAX style) to DTensor placements and back.

A partition spec has one entry per tensor dim: the mesh axis that shards
that dim (an axis name or an int index), ``None`` for a dim that is not
sharded, or a tuple of axes for a dim sharded over several mesh axes, major
to minor (the device at mesh coordinate ``c`` holds tile
``c[a0] * size(a1) + c[a1]`` of the dim for ``(a0, a1)``).  Mesh axes that no
entry names hold the tensor replicated.

torch_xla's tile of a dim of size ``S`` cut into ``n`` tiles is
``[i * ceil(S / n), min((i + 1) * ceil(S / n), S))`` (XLA pads the last
tiles), which is ``torch.chunk``'s and so DTensor's ``Shard`` split.  A dim
over several axes is one tiling in torch_xla and one split per mesh axis, in
the tuple's order, in DTensor (``_StridedShard`` where the tuple's order is not the mesh's; see
``DTensorSpec._convert_shard_order_to_StridedShard`` in torch, whose rule
:func:`to_placements` follows).  Both agree whenever ``S`` is divisible by
the number of tiles; otherwise :func:`to_placements` checks that they still
agree and raises ``ValueError`` when they do not, never a silently different
layout.

Everything here is plain Python on constants (mesh sizes and names, the
spec, the tensor's shape), so Dynamo folds it while tracing.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

from .. import _compat

log = logging.getLogger(__name__)

_StridedShard = _compat.strided_shard_type()

PartitionSpecEntry = str | int | tuple[str | int, ...] | None
"""One dim's entry: a mesh axis name, an axis index, a tuple of them (sharded over all, the first major), or None."""
PartitionSpec = tuple[PartitionSpecEntry, ...]


def _axis_names(mesh: Any) -> tuple[str, ...] | None:
    return mesh.mesh_dim_names


def _translate_entry(mesh: Any, entry: Any) -> Any:
    # torch_xla's _translate_named_partition_spec: names -> axis indices, checked types.
    if type(entry) is tuple:
        return tuple(_translate_entry(mesh, e) for e in entry)
    if entry is None or type(entry) is int:
        return entry
    if type(entry) is str:
        names = _axis_names(mesh)
        if names is None or entry not in names:
            raise ValueError(f"Axis name {entry} is not defined in the given mesh")
        return names.index(entry)
    raise ValueError(f"Spec type {type(entry)} is not supported in partition spec")


def translate(mesh: Any, partition_spec: PartitionSpec, ndim: int) -> tuple[tuple[int, ...], ...]:
    """The spec with every entry a tuple of mesh axis indices (``()`` for ``None``).

    Args:
        mesh: a ``DeviceMesh`` (``Mesh`` included).
        partition_spec: a tuple (or list) with one entry per tensor dim.
        ndim: the tensor's rank.

    Raises:
        ValueError: (torch_xla's messages) the spec's length is not ``ndim``, an
            entry's type is not int/str/None/tuple, an axis name is not the mesh's,
            an index is outside ``[0, mesh.ndim)``, or a mesh axis appears twice.
    """
    spec = tuple(partition_spec)
    if len(spec) != ndim:
        raise ValueError(f"Partition spec length ({len(spec)}) should be equal to the input rank ({ndim}).")
    translated = tuple(_translate_entry(mesh, e) for e in spec)
    axes_per_dim = tuple(() if e is None else (e if type(e) is tuple else (e,)) for e in translated)
    flat = [a for axes in axes_per_dim for a in axes]
    if any(a is None for a in flat) or any(type(a) is tuple for a in flat):
        raise ValueError(f"Spec type {type(None)} is not supported inside a tuple of partition spec {spec}")
    if not all(0 <= a < mesh.ndim for a in flat):
        raise ValueError(f"partition_spec ({spec}) contains out of bound index into mesh_shape.")
    if len(set(flat)) != len(flat):
        raise ValueError(f"Each device mesh dimension should appear at most once in partition_spec {spec}.")
    return axes_per_dim


def _tiles(size: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the ``n`` tiles of ``range(size)`` (``torch.chunk``'s split, empty tiles padded)."""
    step = -(-size // n) if size else 0
    return [(min(i * step, size), min((i + 1) * step, size)) for i in range(n)]


def _nested_tiles(size: int, sizes: list[int]) -> list[tuple[int, int]]:
    """Tiles when each mesh axis of ``sizes`` (major first) splits the previous axis's tile.

    DTensor's layout of a dim over several axes, ``Shard`` and ``_StridedShard``
    alike: each axis, in shard order (the tuple's), ``torch.chunk``s the tile
    the axes before it left (checked on 4 gloo ranks in tests/test_spmd_gloo.py).
    """
    tiles = [(0, size)]
    for n in sizes:
        tiles = [(lo + a, lo + b) for lo, hi in tiles for a, b in _tiles(hi - lo, n)]
    return tiles


def _check_uneven(mesh: Any, dim: int, size: Any, axes: tuple[int, ...]) -> None:
    sizes = [mesh.size(a) for a in axes]
    n = 1
    for s in sizes:
        n *= s
    if size % n == 0:
        return
    if _nested_tiles(size, sizes) == _tiles(size, n):
        return
    names = _axis_names(mesh)
    shown = tuple(names[a] for a in axes) if names is not None else axes
    raise ValueError(
        f"Tensor dim {dim} of size {size} is sharded over mesh axes {shown} ({n} shards), and {size} is not "
        f"divisible by {n}: torch_xla cuts it into tiles of {-(-size // n)}, DTensor splits it one mesh axis at "
        f"a time, and for this size the two layouts differ. Pad dim {dim} to a multiple of {n}, or shard it over "
        "one mesh axis."
    )


def to_placements(mesh: Any, partition_spec: PartitionSpec, shape: Any) -> tuple[Any, ...]:
    """DTensor placements (one per mesh axis) whose local shards are the spec's tiles.

    Args:
        mesh: a ``DeviceMesh`` (``Mesh`` included).
        partition_spec: see the module docstring.
        shape: the global tensor's shape (its length is the rank the spec must match).

    Returns:
        A tuple of ``mesh.ndim`` placements: ``Replicate()`` on axes the spec does
        not name, ``Shard(d)`` on an axis sharding dim ``d``, ``_StridedShard(d,
        split_factor=k)`` where a tuple entry names axes out of mesh order (``k``
        is the product of the sizes of the axes before it in the tuple and after
        it in the mesh, torch's shard-order rule).

    Raises:
        ValueError: see :func:`translate`; or a dim sharded over several axes whose
            size makes DTensor's layout differ from torch_xla's (see the module docstring).
    """
    axes_per_dim = translate(mesh, partition_spec, len(shape))
    placements: list[Any] = [Replicate()] * mesh.ndim
    for dim, axes in enumerate(axes_per_dim):
        if len(axes) > 1:
            _check_uneven(mesh, dim, shape[dim], axes)
        for i, axis in enumerate(axes):
            split_factor = 1
            for earlier in axes[:i]:
                if earlier > axis:
                    split_factor *= mesh.size(earlier)
            placements[axis] = Shard(dim) if split_factor == 1 else _StridedShard(dim, split_factor=split_factor)
    return tuple(placements)


def _has_split_factor(p: Any, k: int) -> bool:
    # By equality with a constant placement: a traced DTensor's placements are
    # opaque values whose split_factor Dynamo cannot read, but can compare.
    if isinstance(p, _StridedShard):
        return k > 1 and p == _StridedShard(p.dim, split_factor=k)
    return k == 1


def from_placements(mesh: Any, placements: Any, ndim: int) -> PartitionSpec:
    """The partition spec of a DTensor's placements (inverse of :func:`to_placements`).

    Entries name mesh axes by name when the mesh has names, else by index.

    Raises:
        ValueError: a ``Partial`` placement (a pending reduction has no partition
            spec), a placement type other than Shard/_StridedShard/Replicate, or
            ``_StridedShard`` split factors that no order of mesh axes produces.
    """
    orders: list[list[int]] = [[] for _ in range(ndim)]
    # Right to left, each axis goes where the sizes before it multiply to its split
    # factor (torch's DTensorSpec._maybe_convert_StridedShard_to_shard_order).
    for axis in range(len(placements) - 1, -1, -1):
        p = placements[axis]
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            raise ValueError(
                f"mesh axis {axis} holds a Partial placement, a pending reduction, which no partition spec "
                "describes: redistribute the tensor to Replicate() or Shard placements first"
            )
        if not isinstance(p, (Shard, _StridedShard)):
            raise ValueError(
                f"mesh axis {axis} holds a {type(p).__name__} placement, which has no partition spec "
                "(expected Shard or Replicate)"
            )
        order = orders[p.dim]
        product, pos = 1, None
        for i in range(len(order) + 1):
            if _has_split_factor(p, product):
                pos = i
                break
            if i < len(order):
                product *= mesh.size(order[i])
        if pos is None:
            raise ValueError(f"the _StridedShard on mesh axis {axis} corresponds to no order of mesh axes")
        order.insert(pos, axis)
    names = _axis_names(mesh)
    spec: list[Any] = []
    for order in orders:
        entry = tuple(order) if names is None else tuple(names[a] for a in order)
        spec.append(None if not entry else entry[0] if len(entry) == 1 else entry)
    return tuple(spec)
