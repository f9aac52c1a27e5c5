"""``DeviceMeshVariable``: a ``DeviceMesh`` whose layout is constant for the frame.

Guarded by layout, dim names, device type and ranks (``guards.DEVICE_MESH``),
so an equal mesh reuses the graph and any other mesh recompiles.  Slicing
(``mesh["tp"]``, ``mesh["dp", "tp"]``), ``get_group``, ``get_coordinate`` and
``_flatten`` run at trace time on the real mesh; the results are meshes and
groups derived from a guarded object, so they need no guard of their own.
"""

from __future__ import annotations

import weakref
from typing import Any

from .. import _compat, guards
from ..guards.world import world_record
from .base import DistributedObjectVariable, const_args, raise_user_error, wrap_constant


class CallableTupleVariable(_compat.TupleVariable):
    """A constant tuple that can also be called, such as ``dynamo_ext.spmd.Mesh.shape``.

    Indexing, unpacking and ``==`` behave as for the tuple; a call runs the real
    object's ``__call__`` at trace time on constant arguments (the value is an
    attribute of a guarded mesh, so the result is constant too).
    """

    _nonvar_fields = {"callable_tuple", *_compat.TupleVariable._nonvar_fields}

    def __init__(self, value: Any, **kwargs: Any) -> None:
        super().__init__([_compat.ConstantVariable.create(v) for v in value], **kwargs)
        self.callable_tuple = value

    def call_function(self, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        consts = const_args(args, kwargs)
        if consts is None:
            return super().call_function(tx, args, kwargs)
        try:
            result = self.callable_tuple(*consts[0], **consts[1])
        except Exception as e:
            raise_user_error(tx, e)
        return wrap_constant(tx, result)


class DeviceMeshVariable(DistributedObjectVariable):
    """A ``torch.distributed.device_mesh.DeviceMesh``."""

    KIND = "device mesh"
    CONSTANT_ATTRS = frozenset({"ndim", "shape", "mesh_dim_names", "device_type"})
    PURE_METHODS = frozenset(
        {
            "size",
            "get_group",
            "get_all_groups",
            "get_local_rank",
            "get_rank",
            "get_coordinate",
            "__getitem__",
            "_flatten",
            "_get_root_mesh",
            "__str__",
            "__repr__",
        }
    )

    def var_getattr(self, tx: Any, name: str) -> Any:
        if name == "mesh":
            # The layout as a new int64 tensor, like eager's attribute (a constant of the graph).
            import torch

            layout = wrap_constant(tx, self.value.mesh.tolist())
            return wrap_constant(tx, torch.tensor).call_function(tx, [layout], {})
        if name == "shape" and type(self.value.shape) is not tuple and callable(self.value.shape):
            # A DeviceMesh subclass whose shape is also callable (dynamo_ext.spmd.Mesh: torch_xla's shape()).
            return CallableTupleVariable(self.value.shape)
        return super().var_getattr(tx, name)


# Meshes a compiled frame used (by id; weak, so a mesh's life is not extended), with the world they were
# used in.  The audit's communication report names a collective's mesh axis from them when no DTensor of
# that mesh is in the graph, e.g. an explicit all_to_all_single(..., group=ep_mesh.get_group()).  A mesh of
# an earlier world (destroy_process_group, init again) may still be alive, and its group names are reused
# by the new world's groups: it would name their axes wrongly, so only the current world's meshes count.
_TRACED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_TRACED_WORLD: dict[int, Any] = {}


def traced_meshes() -> list[Any]:
    """The live ``DeviceMesh`` objects compiled frames have used in the current world, in no particular order."""
    world = world_record()
    return [mesh for key, mesh in list(_TRACED.items()) if _TRACED_WORLD.get(key) == world]


def _remember(mesh: Any) -> None:
    for key in [k for k in _TRACED_WORLD if k not in _TRACED]:  # ids of meshes that died
        del _TRACED_WORLD[key]
    _TRACED[id(mesh)] = mesh
    _TRACED_WORLD[id(mesh)] = world_record()


def build_device_mesh(tx: Any, value: Any, source: Any) -> DeviceMeshVariable | None:
    try:
        guards.DEVICE_MESH.extract(value)
    except AttributeError:
        # A mesh still in its __init__ (Dynamo traces that frame after a graph
        # break in the caller): not an object we can fold; stock handles it.
        return None
    guards.install_spec_guard(source, guards.DEVICE_MESH)
    _remember(value)
    return DeviceMeshVariable(value, source=source)
