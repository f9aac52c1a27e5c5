"""dynamo-ext's VariableTrackers for distributed objects, and their registration.

The package is cut by the torch subsystem a module traces, not by kind of code
(tracker, polyfill, argument helper).  The modules of one subsystem import one
another (a c10d polyfill needs the c10d argument helpers, graph breaks and
``FunctionalWork``; the FSDP2 hooks need FSDP2's gradient reduction), so
cutting by subsystem keeps those arrows inside one folder, and the arrows
between folders point one way: ``c10d/``, ``fsdp/`` and ``autograd/`` import
the shared modules here (:mod:`.registry`, :mod:`.base`, :mod:`.functions`),
which import none of them; ``fsdp/`` and :mod:`.dtensor` import ``c10d/``, and
``c10d/`` imports neither.  Cut by kind of code, the
c10d polyfills and their ``ReduceOp`` tracker would sit in different folders
that import each other.

- shared: :mod:`.registry` (the one table of trackers), :mod:`.base` (the
  trackers' base class), :mod:`.functions` (function handlers: polyfills,
  constant folds, graph breaks);
- DTensor and its parts: :mod:`.device_mesh`, :mod:`.placement`, :mod:`.dtensor`;
- :mod:`.c10d`: ``torch.distributed``: process groups, ``ReduceOp``, queries,
  collectives (``torch.distributed.nn.functional`` included), P2P;
- :mod:`.fsdp`: FSDP2's hooks, module groups and gradient reduction;
- :mod:`.autograd`: what the autograd engine runs in the backward: module
  backward hooks without compiled autograd, and a DTensor leaf's gradient
  accumulation under compiled autograd.
"""

from __future__ import annotations

from .._patching import Patcher
from . import registry


def install(patches: Patcher) -> None:
    """Register every tracker and function handler; hook the registry into Dynamo."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.distributed_c10d import _WorldMeta
    from torch.distributed.tensor.placement_types import Placement

    from . import device_mesh, dtensor, placement
    from .autograd import accumulate_grad, backward_hooks
    from .c10d import handlers, process_group, queries
    from .fsdp import eager as fsdp_eager
    from .fsdp import groups as fsdp_groups
    from .fsdp import hooks as fsdp_hooks

    patches.on_undo(registry.clear)
    registry.register_variable(dist.ProcessGroup, process_group.build_process_group, match="subclass")
    registry.register_variable(_WorldMeta, process_group.build_world_meta)
    registry.register_variable(DeviceMesh, device_mesh.build_device_mesh, match="subclass")
    registry.register_variable(Placement, placement.build_placement, match="subclass")
    registry.register_variable(Placement, placement.build_placement_class, match="class")
    queries.register()
    handlers.register()
    fsdp_hooks.register()
    fsdp_groups.register()
    fsdp_eager.install(patches)
    accumulate_grad.register()
    dtensor.register(patches)
    backward_hooks.register(patches)
    registry.hook_builders(patches)
