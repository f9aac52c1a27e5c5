"""``Mesh``: a ``DeviceMesh`` built with torch_xla's constructor, plus ``HybridMesh`` and ``get_1d_mesh``.

torch_xla (``torch_xla/distributed/spmd/xla_sharding.py``) describes devices
as ``Mesh(device_ids, mesh_shape, axis_names)``: a raveled list of global
device ids reshaped to ``mesh_shape`` in C (row-major) order.  Here a device
is a global rank, and the result *is* a ``DeviceMesh`` (same layout, same
process groups, usable wherever DTensor takes a mesh), with torch_xla's
attributes and methods added.  torch_xla is not installable on this project's
machines: the semantics and error wording below are paraphrased from its
documentation and source as we know them (torch_xla 2.5-2.7), not checked
against a running copy.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, SupportsInt

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


class MeshShape(tuple):
    """``DeviceMesh.shape`` (a tuple of axis sizes) that torch_xla code can also call.

    ``mesh.shape`` is ``(2, 2)`` as for any ``DeviceMesh`` (DTensor reads it);
    ``mesh.shape()`` is torch_xla's ``OrderedDict`` of axis name (or index, on
    a mesh without names) to size.
    """

    axis_names: tuple[str, ...] | None

    def __new__(cls, sizes: Sequence[int], axis_names: Sequence[str] | None = None) -> MeshShape:
        self = super().__new__(cls, sizes)
        self.axis_names = None if axis_names is None else tuple(axis_names)
        return self

    def __call__(self) -> collections.OrderedDict[Any, int]:
        keys = range(len(self)) if self.axis_names is None else self.axis_names
        return collections.OrderedDict(zip(keys, self))


def _default_device_type() -> str:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return "cpu" if accelerator is None else accelerator.type


def _as_id_list(device_ids: Any) -> list[int]:
    """``device_ids`` (list, range, numpy array, tensor) raveled to Python ints."""
    if isinstance(device_ids, torch.Tensor):
        return [int(d) for d in device_ids.reshape(-1).tolist()]
    if hasattr(device_ids, "ravel"):  # a numpy array, as torch_xla's examples pass
        return [int(d) for d in device_ids.ravel().tolist()]
    return [int(d) for d in device_ids]


class Mesh(DeviceMesh):
    """A ``DeviceMesh`` made with torch_xla's constructor.

    Args:
        device_ids: the global ranks of all devices, raveled, in any order (a list,
            range, numpy array or int tensor); reshaped to ``mesh_shape`` in C
            order, so ``device_ids[i]`` sits at the mesh coordinate
            ``numpy.unravel_index(i, mesh_shape)``.
        mesh_shape: the size of each mesh axis.
        axis_names: optional unique names of the mesh axes (become ``mesh_dim_names``).
        device_type: keyword-only, the ``DeviceMesh`` device type; default the
            current accelerator's type, else ``"cpu"``.

    As in torch_xla the mesh must cover every device: ``len(device_ids)`` must
    equal the world size (needs an initialized default process group).
    ``mesh.shape`` is the tuple of sizes (``DeviceMesh``'s attribute) and
    ``mesh.shape()`` torch_xla's ``OrderedDict``; ``mesh.size()`` is the number
    of devices, ``mesh.size(axis)`` one axis's size.

    Raises:
        ValueError: with torch_xla's wording (which asserts instead): the number of
            ids differs from the world size or from ``prod(mesh_shape)``, the axis
            names do not match the mesh dimensions or repeat, an id repeats or is
            not a rank of the world.
        RuntimeError: no default process group is initialized.

    Example (4 ranks)::

        mesh = Mesh([0, 1, 2, 3], (2, 2), ("x", "y"))
        mesh.get_logical_mesh()   # tensor([[0, 1], [2, 3]], dtype=torch.int32)
        mesh.shape()              # OrderedDict([('x', 2), ('y', 2)])
        mesh.get_axis_name_idx("y")  # 1
    """

    device_ids: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...] | None

    def __init__(
        self,
        device_ids: Iterable[SupportsInt] | torch.Tensor,
        mesh_shape: Sequence[int],
        axis_names: Sequence[str] | None = None,
        *,
        device_type: str | None = None,
    ) -> None:
        ids = _as_id_list(device_ids)
        mesh_shape = tuple(int(s) for s in mesh_shape)
        if not dist.is_initialized():
            raise RuntimeError(
                "Mesh(...) needs the default process group: call torch.distributed.init_process_group() first"
            )
        num_devices = dist.get_world_size()
        if len(ids) != num_devices:
            raise ValueError(
                f"Number of device IDs ({len(ids)}) must match the global number of devices ({num_devices})"
            )
        if axis_names is not None:
            axis_names = tuple(axis_names)
            if len(axis_names) != len(mesh_shape):
                raise ValueError(
                    f"Number of axis names ({len(axis_names)}) must match mesh dimensions ({len(mesh_shape)})"
                )
            if len(set(axis_names)) != len(axis_names):
                raise ValueError(f"Axis names must be unique, got: {axis_names}")
        expected = math.prod(mesh_shape)
        if len(ids) != expected:
            raise ValueError(f"Number of device IDs ({len(ids)}) must match mesh size ({expected})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"Device IDs must be unique, got: {ids}")
        if any(d < 0 or d >= num_devices for d in ids):
            raise ValueError(f"Device IDs must be global ranks in [0, {num_devices}), got: {ids}")
        layout = torch.tensor(ids, dtype=torch.int).reshape(mesh_shape)
        super().__init__(device_type or _default_device_type(), layout, mesh_dim_names=axis_names)
        self.device_ids = tuple(ids)
        self.mesh_shape = mesh_shape
        self.axis_names = axis_names
        log.debug("Mesh %s over ranks %s, axis names %s", mesh_shape, ids, axis_names)

    @property
    def shape(self) -> MeshShape:  # type: ignore[override]
        """The axis sizes (a tuple); call it for torch_xla's ``OrderedDict`` of axis name to size."""
        return MeshShape(super().shape, self.mesh_dim_names)

    def get_logical_mesh(self) -> torch.Tensor:
        """The device ids laid out in ``mesh_shape`` (an int tensor; torch_xla returns a numpy array)."""
        return self.mesh

    def get_axis_name_idx(self, name: str) -> int | None:
        """The index of the mesh axis called ``name``; ``None`` when there is none (as torch_xla)."""
        if self.axis_names is None or name not in self.axis_names:
            return None
        return self.axis_names.index(name)


def get_1d_mesh(axis_name: str | None = None, *, device_type: str | None = None) -> Mesh:
    """A 1-D ``Mesh`` over all ranks in rank order (torch_xla's ``get_1d_mesh``)."""
    world = dist.get_world_size()
    return Mesh(range(world), (world,), None if axis_name is None else (axis_name,), device_type=device_type)


class HybridMesh(Mesh):
    """A ``Mesh`` for hosts of several devices (torch_xla's ``HybridMesh``).

    Axis ``i`` has ``dcn_mesh_shape[i] * ici_mesh_shape[i]`` devices: its
    major part steps across hosts (torch_xla's DCN, data-center network), its
    minor part within a host (ICI, inter-chip interconnect).  Hosts are
    consecutive blocks of ``prod(ici_mesh_shape)`` ranks (``torchrun``'s rank
    order), host ``h`` is laid out in ``dcn_mesh_shape`` in C order, and its
    ranks in ``ici_mesh_shape`` in C order, as torch_xla builds the mesh from
    per-host sub-meshes.  torch_xla additionally orders the devices within a
    host by the TPU's physical torus; here the in-host order is rank order.

    Raises:
        ValueError: the two shapes have different lengths, or their product is not the world size.
    """

    def __init__(
        self,
        *,
        ici_mesh_shape: Sequence[int],
        dcn_mesh_shape: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        device_type: str | None = None,
    ) -> None:
        ici = tuple(int(s) for s in ici_mesh_shape)
        dcn = (1,) * len(ici) if dcn_mesh_shape is None else tuple(int(s) for s in dcn_mesh_shape)
        if len(ici) != len(dcn):
            raise ValueError(
                f"ici_mesh_shape {ici} and dcn_mesh_shape {dcn} must have the same length (one entry per mesh axis)"
            )
        n = len(ici)
        world = dist.get_world_size() if dist.is_initialized() else math.prod(ici) * math.prod(dcn)
        if math.prod(ici) * math.prod(dcn) != world:
            raise ValueError(
                f"prod(ici_mesh_shape) * prod(dcn_mesh_shape) = {math.prod(ici) * math.prod(dcn)} "
                f"must match the global number of devices ({world})"
            )
        # ranks as (host coordinate in dcn, device coordinate in ici), then (dcn_0, ici_0, dcn_1, ici_1, ...)
        ids = torch.arange(world).reshape(dcn + ici)
        ids = ids.permute([p for i in range(n) for p in (i, n + i)])
        mesh_shape = tuple(d * i for d, i in zip(dcn, ici))
        self.ici_mesh_shape = ici
        self.dcn_mesh_shape = dcn
        super().__init__(ids.reshape(-1), mesh_shape, axis_names, device_type=device_type)
