"""Trace-time arguments of c10d polyfills: groups, ranks, reduce ops, devices.

Each helper here takes process groups and Python constants and returns
constants.  ``register()`` makes Dynamo evaluate them at trace time (the group
argument is guarded by identity, so the folded value is exact); called
eagerly, for instance from a ``FunctionalWork.wait()`` after the graph, they
are ordinary Python.  Error messages and exception types copy eager c10d's, so
a compiled call fails the way the eager call would.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ... import _compat
from ..functions import register_constant_fold

ReduceOp = dist.ReduceOp

# dist.ReduceOp -> the name _c10d_functional ops take (REDUCE_OP_TO_STR in
# torch/distributed/_functional_collectives.py, public enum values only).
REDUCE_OPS: dict[Any, str] = {
    ReduceOp.SUM: "sum",
    ReduceOp.AVG: "avg",
    ReduceOp.PRODUCT: "product",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.BAND: "band",
    ReduceOp.BOR: "bor",
    ReduceOp.BXOR: "bxor",
}


def reduce_op_name(op: Any) -> str | None:
    """The functional name of ``op`` (``ReduceOp.SUM`` -> ``"sum"``), ``None`` when it has none."""
    try:
        return REDUCE_OPS.get(op)
    except TypeError:  # an unhashable ReduceOp instance (PREMUL_SUM)
        return None


def group_or_default(group: Any) -> Any:
    """``group``, or the default group for ``None`` (eager's ``group or _get_default_group()``)."""
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise ValueError(
                "Default process group has not been initialized, please make sure to call init_process_group."
            )
    return group


def group_info(group: Any) -> tuple[str, int, int]:
    """``(group_name, size, this rank's group rank)`` of ``group`` (``None``: the default group)."""
    group = group_or_default(group)
    return group.group_name, group.size(), group.rank()


def not_in_group(group: Any) -> bool:
    """Whether this rank is outside ``group``: eager c10d then returns ``None`` without communicating."""
    # new_group() hands non-members the sentinel GroupMember.NON_GROUP_MEMBER (-100).
    return group is not None and isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER


def group_peer(group: Any, global_rank: int | None, group_rank: int | None, what: str) -> int:
    """The group rank of a peer given as a global rank or a group rank (eager's ``_canonicalize_group_rank``).

    Raises:
        ValueError: both or neither given, or the global rank is not in ``group`` (eager's messages).
        RuntimeError: the rank is out of range for the group (what eager's backends raise).
    """
    group = group_or_default(group)
    if group_rank is not None:
        if global_rank is not None:
            raise ValueError("Can't specify both group_rank and global_rank")
    elif global_rank is None:
        raise ValueError("Must specify global_rank or group_rank")
    else:
        group_rank = global_rank if group is dist.group.WORLD else dist.get_group_rank(group, global_rank)
    if not not_in_group(group) and not 0 <= group_rank < group.size():
        raise RuntimeError(
            f"{what}: invalid {'' if global_rank is None else 'global '}rank "
            f"{group_rank if global_rank is None else global_rank}; the group has {group.size()} ranks "
            f"(group ranks 0..{group.size() - 1})"
        )
    return group_rank


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group``."""
    group = group_or_default(group)
    return group_rank if group is dist.group.WORLD else dist.get_global_rank(group, group_rank)


def barrier_device(group: Any, device_ids: Any) -> torch.device:
    """The device eager ``dist.barrier`` would synchronise on (its selection order, see its docstring)."""
    group = group_or_default(group)
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    accel_type = "cpu" if accelerator is None else accelerator.type
    if isinstance(device_ids, list) and device_ids:
        return torch.device(accel_type, device_ids[0])
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return bound
    if accel_type == "cpu" or _compat.object_collective_device(group) in (None, "cpu"):
        return torch.device("cpu")
    return torch.device(accel_type, torch.accelerator.current_device_index())


class KeepAliveTokens:
    """One one-byte tensor per device, as attributes (``cpu``, ``cuda_0``): see NOTE [keep-alive]."""


def keep_alive_token(device: torch.device) -> str:
    """The name of ``device``'s token on :class:`KeepAliveTokens`, made on first use."""
    name = str(device).replace(":", "_")
    if not hasattr(KeepAliveTokens, name):
        setattr(KeepAliveTokens, name, torch.zeros((), dtype=torch.uint8, device=device))
    return name


HELPERS = (
    keep_alive_token,
    reduce_op_name,
    group_or_default,
    group_info,
    not_in_group,
    group_peer,
    global_rank,
    barrier_device,
)


def register() -> None:
    """Fold every helper above to a constant at trace time."""
    for fn in HELPERS:
        register_constant_fold(fn)
