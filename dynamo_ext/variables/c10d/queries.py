"""``torch.distributed`` queries folded to constants at trace time.

``get_rank``, ``get_world_size``, ``get_process_group_ranks`` and friends read
process-group state that is fixed once the group exists; their group argument
is guarded by identity, so folding them is exact.
"""

from __future__ import annotations

from ... import _compat
from ..functions import register_constant_fold

# (module, name): probed, so a helper missing from a release is skipped.
QUERIES = (
    ("torch.distributed", "get_rank"),
    ("torch.distributed", "get_world_size"),
    ("torch.distributed", "get_global_rank"),
    ("torch.distributed", "get_group_rank"),
    ("torch.distributed", "get_process_group_ranks"),
    ("torch.distributed", "get_backend"),
    ("torch.distributed", "is_initialized"),
    ("torch.distributed", "is_available"),
    ("torch.distributed", "get_node_local_rank"),
    ("torch.distributed.distributed_c10d", "_get_group_size_by_name"),
    ("torch.distributed.distributed_c10d", "_get_group_tag"),
    ("torch.distributed.distributed_c10d", "_rank_not_in_group"),
    ("torch.distributed.distributed_c10d", "_resolve_group_name_by_ranks_and_tag"),
    ("torch.distributed.distributed_c10d", "_get_default_group"),
)


def register() -> None:
    """Register a constant-folding handler for each query this torch release has."""
    seen: set[int] = set()
    for module, name in QUERIES:
        fn = _compat.optional_attr(module, name)
        if fn is not None and id(fn) not in seen:
            seen.add(id(fn))
            register_constant_fold(fn)
