"""Size symbols of a submodule's inputs: keys that do not depend on their names, and the guards carried over.

NOTE [blocks that differ only in their size symbols]
Compiled autograd gives some sizes a symbol of their own per block: under
activation checkpointing that keeps the RNG state, each block's saved RNG
state (a 5056-byte tensor on CPU) has its own size symbol.  Two segments of
its backward graph whose inputs differ only in which symbols they carry
compute the same function of their inputs; :func:`~.split.structural_key`
therefore names the symbols by their order among the inputs, with the value
range the shape environment gives each.  The first segment's compile may
still rely on what the shape environment knows of its own symbols: the
guards that mention them (Dynamo's, and those the compile added), which
Inductor also reads as facts.  The second segment runs that compile only
when :func:`carry_guards` finds every such guard, its symbols renamed to the
second segment's, true at the current sizes; each is then a guard of the
frame, so a later call whose sizes break one recompiles the frame instead of
running a compile whose assumptions no longer hold.  A symbol the shape
environment has replaced (specialized, or unified with another) is never
renamed.  Only compiled-autograd backward graphs rename: they are compiled
whole when compiled, while a forward submodule's backward would be compiled
later, adding guards after the reuse was decided.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from .. import _compat

log = logging.getLogger(__name__)

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _sizes(value: Any) -> tuple[Any, ...]:
    if isinstance(value, torch.Tensor):
        return (*value.shape, *value.stride(), value.storage_offset())
    return (value,) if isinstance(value, _SYMBOLIC) else ()


def input_symbols(inputs: list[Any]) -> list[Any]:
    """The size symbols of ``inputs`` (their sizes, strides, offsets, and symbolic scalars), in order of first
    appearance."""
    seen: dict[Any, None] = {}
    for x in inputs:
        for size in _sizes(x):
            if isinstance(size, _SYMBOLIC):
                for sym in sorted(size.node.expr.free_symbols, key=str):
                    seen.setdefault(sym, None)
    return list(seen)


def canonical_names(symbols: list[Any]) -> dict[Any, Any]:
    """Each symbol renamed by its position: ``{s57: _b0, s12: _b1, ...}`` (sympy symbols of the same class)."""
    return {s: type(s)(f"_b{i}", integer=True) for i, s in enumerate(symbols)}


def size_key(size: Any, names: dict[Any, Any] | None = None) -> Any:
    """A size, stride or offset as a key: an int as it is, a symbolic one by its expression with its symbols
    renamed by ``names`` (two inputs of one graph whose sizes have the same expression have the same sizes at
    run time), None for an unbacked one."""
    if isinstance(size, int):
        return size
    if _compat.free_unbacked_symbols(size):
        return None
    expr = size.node.expr
    return ("sym", str(expr.xreplace(names) if names else expr))


def symbol_facts(inputs: list[Any], symbols: list[Any]) -> tuple[Any, ...]:
    """What the key needs of each symbol besides its position: its value range, and whether it was replaced."""
    facts = _facts(inputs)
    if facts is None:
        return ()
    _, _, replacements, ranges = facts
    return tuple((str(ranges.get(s)), s in replacements) for s in symbols)


def _facts(inputs: list[Any]) -> tuple[Any, Iterable[Any], dict[Any, Any], dict[Any, Any]] | None:
    for x in inputs:
        for size in _sizes(x):
            if isinstance(size, _SYMBOLIC):
                return _compat.shape_env_facts(size)
    return None


def carry_guards(inputs: list[Any], compiled: list[Any], symbols: list[Any]) -> bool:
    """Whether a compile made for inputs with size symbols ``compiled`` may run for ``inputs`` (whose symbols
    are ``symbols``, in the same positions): every guard mentioning ``compiled`` holds with them renamed, and
    is then recorded as a guard of the frame (NOTE [blocks that differ only in their size symbols])."""
    facts = _facts(inputs)
    if facts is None or len(compiled) != len(symbols):
        return False
    shape_env, guards, replacements, _ = facts
    if any(s in replacements for s in (*compiled, *symbols)):
        return False
    renamed = dict(zip(compiled, symbols, strict=True))
    moved = [g.xreplace(renamed) for g in guards if g.free_symbols & renamed.keys()]
    # All checked before any is recorded: a block that gets its own compile adds no guard to the frame.
    for guard in moved:
        if not _compat.holds_at_hints(shape_env, guard):
            log.info("blocks compiled once: %s does not hold for a block's own size symbols; compiled", guard)
            return False
    return all(_compat.evaluate_guard(shape_env, guard) for guard in moved)


def may_rename(inputs: list[Any], compiled: list[Any], symbols: list[Any]) -> bool:
    """Whether a compile made for inputs with size symbols ``compiled`` may run for ``inputs``, whose key is the
    same with ``symbols`` instead: only in a compiled-autograd backward graph, and only where the guards on
    ``compiled`` hold renamed (:func:`carry_guards`)."""
    return _compat.compiling_compiled_autograd_graph() and carry_guards(inputs, compiled, symbols)
