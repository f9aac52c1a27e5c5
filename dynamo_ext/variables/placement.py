"""Placements (``Shard``, ``Replicate``, ``Partial``, ``_StridedShard``, user subclasses).

Placements are frozen values: a ``PlacementVariable`` is guarded by value
(``guards.PLACEMENT``), so ``Shard(0)`` passed twice does not recompile and
``Replicate()`` in its place does.  Constructing a placement in a compiled
function runs the constructor at trace time on constant arguments.
"""

from __future__ import annotations

from typing import Any

from .. import _compat, graph_breaks, guards
from .base import DistributedObjectVariable, const_args, raise_user_error, wrap_constant


class PlacementVariable(DistributedObjectVariable):
    """An instance of a ``Placement`` subclass."""

    KIND = "placement"
    IS_VALUE = True
    CONSTANT_ATTRS = frozenset({"dim", "reduce_op", "split_factor"})
    PURE_METHODS = frozenset({"is_shard", "is_replicate", "is_partial", "__str__", "__repr__"})


class PlacementClassVariable(DistributedObjectVariable):
    """A ``Placement`` class: calling it makes a placement at trace time."""

    KIND = "placement class"
    IS_VALUE = True

    def call_function(self, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        consts = const_args(args, kwargs)
        if consts is None:
            graph_breaks.graph_break(
                graph_breaks.NON_CONSTANT_ARGUMENT,
                f"{self.value.__qualname__}(args={args}, kwargs={kwargs})",
            )
        try:
            placement = self.value(*consts[0], **consts[1])
        except Exception as e:
            raise_user_error(tx, e)
        return PlacementVariable(placement)

    def var_getattr(self, tx: Any, name: str) -> Any:
        attr = getattr(self.value, name)
        if callable(attr):
            return _compat.user_function_variable(attr) if not isinstance(attr, type) else wrap_constant(tx, attr)
        return wrap_constant(tx, attr)


def build_placement(tx: Any, value: Any, source: Any) -> PlacementVariable:
    guards.install_spec_guard(source, guards.PLACEMENT)
    return PlacementVariable(value, source=source)


def build_placement_class(tx: Any, value: Any, source: Any) -> PlacementClassVariable:
    # A class is guarded by identity; stock Dynamo does the same for classes.
    if source is not None:
        _compat.install_guard(source.make_guard(_compat.GuardBuilder.ID_MATCH))
    return PlacementClassVariable(value, source=source)
