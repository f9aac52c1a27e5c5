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
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from .. import _compat
from .._patching import Patcher

log = logging.getLogger(__name__)


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


# NOTE [user passes set after install]
# install() appends our passes after whatever the slot held (a user's pass set
# before install runs first).  A user (or library) may also set the slot after
# install: ``config.post_grad_custom_post_pass = theirs`` replaces our chain.
# So at the start of every Inductor compile (a wrapper of ``compile_fx``) the
# slot is checked, and when none of our passes is in it, ours are chained after
# what it holds now, in the config itself, so the FX graph cache key (computed
# from the slot's ``uuid()``s) covers them.  uninstall() then takes exactly our
# passes out of whatever chain the slot holds, and leaves a slot holding none of
# ours (the user's own value) alone; a slot still holding what install() set is
# restored to its value before install.  Compiles that bypass ``torch.compile``'s
# ``inductor`` backend (calling ``compile_fx`` imported earlier) see the slot as
# the user left it.
def _members(value: Any) -> list[Any]:
    """Every pass in ``value``, nested chains flattened."""
    out: list[Any] = []
    for p in _as_pass_list(value):
        out += _members(p) if isinstance(p, (ChainedGraphPass, list, tuple)) else [p]
    return out


def _holds_any(value: Any, passes: Sequence[Any]) -> bool:
    return any(m is p for m in _members(value) for p in passes)


def _without(value: Any, passes: Sequence[Any]) -> Any:
    """``value`` with ``passes`` taken out: ``None``, the one pass left, or a chain of the rest."""
    rest = [m for m in _members(value) if not any(m is p for p in passes)]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else ChainedGraphPass(rest)


def append_post_grad_passes(
    patches: Patcher, passes: Sequence[Any], *, slot: str = "post_grad_custom_post_pass"
) -> None:
    """Append ``passes`` after the pass(es) in ``inductor.config.<slot>``, now and at each later compile.

    See NOTE [user passes set after install].

    Raises:
        ValueError: ``slot`` is not one of Inductor's post-grad custom pass settings.
    """
    config = _compat.inductor_config()
    if not hasattr(config, slot):
        raise ValueError(
            f"torch._inductor.config has no {slot!r}; expected 'post_grad_custom_post_pass' or 'post_grad_custom_pre_pass'"
        )
    ours = tuple(passes)
    before = getattr(config, slot)
    installed = ChainedGraphPass([*_as_pass_list(before), *ours])
    setattr(config, slot, installed)

    def undo() -> None:
        current = getattr(config, slot)
        if current is installed:
            setattr(config, slot, before)
        elif _holds_any(current, ours):
            setattr(config, slot, _without(current, ours))

    patches.on_undo(undo)

    def ensure_chained() -> None:
        current = getattr(config, slot)
        if not _holds_any(current, ours):
            log.info("inductor.config.%s was replaced after install; chaining dynamo-ext's passes after it", slot)
            setattr(config, slot, ChainedGraphPass([*_as_pass_list(current), *ours]))

    module = _compat.compile_fx_module()
    stock_compile_fx = module.compile_fx

    @functools.wraps(stock_compile_fx)
    def compile_fx(*args: Any, **kwargs: Any) -> Any:
        ensure_chained()
        return stock_compile_fx(*args, **kwargs)

    patches.setattr(module, "compile_fx", compile_fx)


# NOTE [pass identity covers the lowerings]
# Inductor's FX graph cache keys a compiled graph on the custom passes' ``uuid()``,
# and our lowerings (the fused epilogue, the Triton kernels) are not part of that
# key at all.  A pass whose uuid hashed only its own file would let the cache serve
# kernels generated by an older version of a lowering: this happened (the CPU
# epilogue came back scalar from a cache entry written before the lowering changed).
# So every pass hashes every Python file of this package, kernels included, and of
# the compatibility package the lowerings reach Inductor and symmetric memory through.
@functools.cache
def package_sources() -> tuple[str, ...]:
    """Paths of every ``.py`` file the passes run (sorted), for their ``uuid()``: ``dynamo_ext/inductor_lowerings``,
    the compatibility package they reach Inductor and symmetric memory through (``dynamo_ext/_compat``), the FX
    readers they use (``dynamo_ext/fx``) and ``dynamo_ext/node_origin.py`` (NOTE [pass identity covers the
    lowerings])."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent
    pkg = root.parent
    files = [*root.rglob("*.py"), *(pkg / "_compat").rglob("*.py"), *(pkg / "fx").rglob("*.py"), pkg / "node_origin.py"]
    return tuple(sorted(str(p) for p in files))
