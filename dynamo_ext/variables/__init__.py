"""dynamo-ext's VariableTrackers for distributed objects, and their registration."""

from __future__ import annotations

from .._patching import Patcher
from . import registry


def install(patches: Patcher) -> None:
    """Register every tracker and function handler; hook the registry into Dynamo."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.distributed_c10d import _WorldMeta
    from torch.distributed.tensor.placement_types import Placement

    from . import (
        accumulate_grad,
        backward_hooks,
        c10d_queries,
        collectives,
        device_mesh,
        dtensor,
        fsdp,
        fsdp_eager,
        fsdp_groups,
        placement,
        process_group,
    )

    patches.on_undo(registry.clear)
    registry.register_variable(dist.ProcessGroup, process_group.build_process_group, match="subclass")
    registry.register_variable(_WorldMeta, process_group.build_world_meta)
    registry.register_variable(DeviceMesh, device_mesh.build_device_mesh, match="subclass")
    registry.register_variable(Placement, placement.build_placement, match="subclass")
    registry.register_variable(Placement, placement.build_placement_class, match="class")
    c10d_queries.register()
    collectives.register()
    fsdp.register()
    fsdp_groups.register()
    fsdp_eager.install(patches)
    accumulate_grad.register()
    dtensor.register(patches)
    backward_hooks.register(patches)
    registry.hook_builders(patches)
