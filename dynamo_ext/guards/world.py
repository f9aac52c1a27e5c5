"""A guard on the default process group (the world), for graphs that made a mesh while tracing.

``init_device_mesh(...)`` / ``DeviceMesh(...)`` inside a compiled function run
once, at trace time (NOTE [meshes made while tracing]): the graph bakes that
mesh's group names and this rank's coordinate, and no argument carries the
mesh, so no source guards it.  When the world is destroyed and created again
(``destroy_process_group`` then ``init_process_group``, possibly as another
rank), the old graph must not run: this guard, on global state, checks that the
default group is the very object the graph was traced under (held weakly) and
that this process's rank is the same.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from .. import _compat
from .spec import FAILURES, _keys, marker


def world_record() -> tuple[Callable[[], Any] | None, int]:
    """(weak reference to the default process group or ``None`` without one, this process's rank)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None, -1
    return weakref.ref(dist.group.WORLD), dist.get_rank()


def make_world_check(key: str) -> Callable[[Any], bool]:
    """A guard check: True while the world and this rank are the ones seen now."""
    import torch.distributed as dist

    expected_world, expected_rank = world_record()

    def check(_: Any) -> bool:
        # Runs on every call of the guarded frame: no weak reference made here, only compared.
        alive = None if expected_world is None else expected_world()
        if (
            alive is not None
            and dist.is_initialized()
            and dist.group.WORLD is alive
            and dist.get_rank() == expected_rank
        ):
            return True
        rank = world_record()[1]
        FAILURES[key] = (
            "the default process group was destroyed and created again (or this process's rank changed: "
            f"{expected_rank} -> {rank}) since this graph made a DeviceMesh while tracing"
        )
        return False

    return check


@functools.cache
def _guard_fn() -> Callable[[Any, Any], None]:
    def DYNAMO_EXT_WORLD_MATCH(builder: Any, guard: Any) -> None:  # noqa: N802  (Dynamo's naming)
        key = str(next(_keys))
        _compat.root_lambda_guard(builder, guard, make_world_check(key), marker(key))

    return DYNAMO_EXT_WORLD_MATCH


def install_world_guard() -> None:
    """Guard the frame being traced on the current world and rank (once per frame: Dynamo dedups it)."""
    _compat.install_guard(_compat.global_state_source().make_guard(_guard_fn()))
