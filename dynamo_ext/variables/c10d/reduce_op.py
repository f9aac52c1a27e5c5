"""``ReduceOpVariable``: the ``dist.ReduceOp.SUM`` ... members, as constants on every torch release.

Stock Dynamo wraps them as opaque objects where it can (2.12+) and cannot
wrap them at all when made during tracing on 2.11 (a polyfill's default
``op=ReduceOp.SUM`` is one).  Here a member is a constant value: it folds into
the polyfills' trace-time helpers, compares with ``==``, hashes, and is guarded
by value when it comes from a source (an argument, a global).  ``ReduceOp``
instances (``PREMUL_SUM`` from ``_make_nccl_premul_sum``) are not members and
stay stock; the c10d checks turn them into a named graph break.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ... import guards
from .. import registry
from ..base import DistributedObjectVariable

RedOpType = type(dist.ReduceOp.SUM)


def _extract(value: Any) -> tuple[str, str]:
    return type(value).__qualname__, str(getattr(value, "name", repr(value)))


def _describe(old: tuple[str, str], new: tuple[str, str]) -> str | None:
    return None if old == new else f"reduce op changed: {old[1]} -> {new[1]}"


REDUCE_OP = guards.GuardSpec("reduce op", _extract, _describe)


class ReduceOpVariable(DistributedObjectVariable):
    """A member of ``torch.distributed.ReduceOp`` (``RedOpType``)."""

    KIND = "reduce op"
    IS_VALUE = True
    CONSTANT_ATTRS = frozenset({"name", "value"})
    PURE_METHODS = frozenset({"__str__", "__repr__", "__int__", "__index__"})


def build_reduce_op(tx: Any, value: Any, source: Any) -> ReduceOpVariable:
    guards.install_spec_guard(source, REDUCE_OP)
    return ReduceOpVariable(value, source=source)


def register() -> None:
    """Wrap ``ReduceOp`` members as :class:`ReduceOpVariable`."""
    registry.register_variable(RedOpType, build_reduce_op, match="type")
