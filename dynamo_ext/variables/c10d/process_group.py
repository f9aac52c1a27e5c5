"""Trackers for ``ProcessGroup`` and ``dist.group`` / ``dist.GroupMember``.

A process group is guarded by identity (``guards.PROCESS_GROUP``): the group
name baked into functional collectives belongs to that very object.
"""

from __future__ import annotations

from typing import Any

from ... import guards
from ..base import DistributedObjectVariable


class ProcessGroupVariable(DistributedObjectVariable):
    """A ``torch.distributed.ProcessGroup``: ``rank()``, ``size()``, ``group_name`` fold to constants."""

    KIND = "process group"
    # A Python constant for stock code (``group or WORLD``, 2.13's folding of
    # get_rank(group)); groups reach graphs only as names in functional collectives.
    IS_VALUE = True
    CONSTANT_ATTRS = frozenset({"group_name", "group_desc", "bound_device_id"})
    PURE_METHODS = frozenset({"rank", "size", "name", "_get_backend_name"})


class WorldMetaClassVariable(DistributedObjectVariable):
    """``dist.group`` and ``dist.GroupMember``: ``.WORLD`` is the default group (guarded by identity)."""

    KIND = "dist.group"
    CONSTANT_ATTRS = frozenset({"NON_GROUP_MEMBER"})

    def var_getattr(self, tx: Any, name: str) -> Any:
        if name == "WORLD":
            from ... import _compat

            world = self.value.WORLD
            if self.source is None:
                return build_process_group(tx, world, None)
            return _compat.VariableBuilder(tx, _compat.AttrSource(self.source, "WORLD"))(world)
        return super().var_getattr(tx, name)


def build_process_group(tx: Any, value: Any, source: Any) -> ProcessGroupVariable:
    guards.install_spec_guard(source, guards.PROCESS_GROUP)
    return ProcessGroupVariable(value, source=source)


def build_world_meta(tx: Any, value: Any, source: Any) -> WorldMetaClassVariable:
    return WorldMetaClassVariable(value, source=source)
