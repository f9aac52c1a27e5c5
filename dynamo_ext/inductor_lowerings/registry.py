"""Lowering rules (predicate, fast path, fallback) and post-grad pass chaining.

Both go in through Inductor's own extension points and through the patcher:
a lowering is wrapped by Inductor's ``register_lowering`` into a scratch table
and then set into ``lowerings`` entry by entry (uninstall puts the previous
entries back); our post-grad passes are appended to whatever
``post_grad_custom_post_pass`` already held, as one ``CustomGraphPass`` whose
``uuid()`` combines every member's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .._patching import Patcher
from . import _compat


@dataclasses.dataclass(frozen=True)
class LoweringRule:
    """``fast_path(*args)`` when ``predicate(*args)`` holds, else ``fallback(*args)``.

    The fallback is the stock behaviour for the op (or the closest stock
    composition); the predicate must be cheap and side-effect free.
    """

    name: str
    op: Any
    predicate: Callable[..., bool]
    fast_path: Callable[..., Any]
    fallback: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.predicate(*args, **kwargs):
            return self.fast_path(*args, **kwargs)
        return self.fallback(*args, **kwargs)


def install_lowerings(patches: Patcher, rules: Sequence[LoweringRule]) -> None:
    """Register each rule for every overload of its op; duplicates are refused."""
    table = _compat.lowering_table()
    seen: set[Any] = set()
    for rule in rules:
        for key, wrapped in _compat.make_lowering(rule.op, rule).items():
            if key in seen:
                raise ValueError(f"lowering rule {rule.name!r}: {key} already has a rule from this install")
            seen.add(key)
            patches.setitem(table, key, wrapped)


class ChainedGraphPass(_compat.custom_graph_pass_base()):  # type: ignore[misc]
    """Run several post-grad passes in order; cacheable only when every member is."""

    def __init__(self, passes: Sequence[Any]) -> None:
        self.passes = tuple(passes)

    def __call__(self, graph: Any) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        ids = []
        for p in self.passes:
            uuid = getattr(p, "uuid", None)
            if uuid is None:
                return None  # a plain callable: Inductor cannot key its cache on it
            value = uuid()
            if value is None:
                return None
            ids.append(value)
        return tuple(ids)


def _as_pass_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, ChainedGraphPass):
        return list(value.passes)
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def append_post_grad_passes(
    patches: Patcher, passes: Sequence[Any], *, slot: str = "post_grad_custom_post_pass"
) -> None:
    """Append ``passes`` after the pass(es) already in ``inductor.config.<slot>``."""
    config = _compat.inductor_config()
    if not hasattr(config, slot):
        raise ValueError(
            f"torch._inductor.config has no {slot!r}; expected 'post_grad_custom_post_pass' or 'post_grad_custom_pre_pass'"
        )
    chained = ChainedGraphPass([*_as_pass_list(getattr(config, slot)), *passes])
    patches.setattr(config, slot, chained)
