"""XLA-style SPMD sharding over DTensor (``Mesh``, ``mark_sharding``, ``with_sharding_constraint``) and ``data_parallel``.

    from dynamo_ext.spmd import Mesh, mark_sharding, with_sharding_constraint

    mesh = Mesh(range(4), (2, 2), ("dp", "tp"))
    w = mark_sharding(weight, mesh, (None, "tp"))

See ``docs/spmd.md`` for how each function of torch_xla's ``xla_sharding``
module maps here.  Importing this package creates no process group.
"""

from .batch_dim import analyze_batch_dims, analyze_step
from .manual import disable_manual_sharding, enable_manual_sharding, get_global_mesh, set_global_mesh
from .mesh import HybridMesh, Mesh, MeshShape, get_1d_mesh
from .parallel_step import DataParallelStep, data_parallel
from .partition_spec import PartitionSpec
from .sharding import ShardingSpec, clear_sharding, get_sharding, mark_sharding, with_sharding_constraint

__all__ = [
    "DataParallelStep",
    "HybridMesh",
    "Mesh",
    "MeshShape",
    "PartitionSpec",
    "ShardingSpec",
    "analyze_batch_dims",
    "analyze_step",
    "clear_sharding",
    "data_parallel",
    "disable_manual_sharding",
    "enable_manual_sharding",
    "get_1d_mesh",
    "get_global_mesh",
    "get_sharding",
    "mark_sharding",
    "set_global_mesh",
    "with_sharding_constraint",
]
