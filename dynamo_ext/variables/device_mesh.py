"""``DeviceMeshVariable``: a ``DeviceMesh`` whose layout is constant for the frame.

Guarded by layout, dim names, device type and ranks (``guards.DEVICE_MESH``),
so an equal mesh reuses the graph and any other mesh recompiles.  Slicing
(``mesh["tp"]``, ``mesh["dp", "tp"]``), ``get_group``, ``get_coordinate`` and
``_flatten`` run at trace time on the real mesh; the results are meshes and
groups derived from a guarded object, so they need no guard of their own.
"""

from __future__ import annotations

from typing import Any

from .. import guards
from .base import DistributedObjectVariable, wrap_constant


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
        return super().var_getattr(tx, name)


def build_device_mesh(tx: Any, value: Any, source: Any) -> DeviceMeshVariable | None:
    try:
        guards.DEVICE_MESH.extract(value)
    except AttributeError:
        # A mesh still in its __init__ (Dynamo traces that frame after a graph
        # break in the caller): not an object we can fold; stock handles it.
        return None
    guards.install_spec_guard(source, guards.DEVICE_MESH)
    return DeviceMeshVariable(value, source=source)
