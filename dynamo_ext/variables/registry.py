"""The one table that maps Python objects to dynamo-ext VariableTrackers.

An entry matches a value by identity (functions such as ``dist.broadcast``),
by code (functions made at run time from one ``def``, such as the hook
closures FSDP2 makes per ``fully_shard`` call), by exact type, by subclass
(instances of ``Placement`` subclasses users write), or by class (the value
is itself a class deriving from the key, such as ``Shard``).  Dynamo's
``VariableBuilder`` (values with a source: arguments, globals, closures,
attributes) and ``SourcelessBuilder`` (values made during tracing) consult the
table before their own dispatch; :func:`hook_builders` installs that, through
:data:`dynamo_ext._patching.PATCHES`.

A builder is ``builder(tx, value, source) -> VariableTracker | None``; ``source``
is ``None`` for sourceless values.  Returning ``None`` defers to stock Dynamo.
Registering a key twice is an error, like Dynamo's own ``_type_dispatch_impl``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Literal

from .. import _compat
from .._patching import Patcher

Builder = Callable[[Any, Any, Any], Any]
Match = Literal["identity", "code", "type", "subclass", "class"]

_by_id: dict[int, tuple[Any, Builder]] = {}
# match="code": the value is a function whose ``__code__`` is the key (its builder may return None).
_by_code: dict[types.CodeType, Builder] = {}
_by_type: dict[type, Builder] = {}
_by_subclass: list[tuple[type, Builder]] = []
# match="class": the value is itself a class deriving from the key (Shard, user Placements).
_by_class: list[tuple[type, Builder]] = []
# type -> builder (or None); rebuilt lazily after any (un)registration.
_type_cache: dict[type, Builder | None] = {}


def register_variable(key: Any, builder: Builder, *, match: Match = "type") -> None:
    """Map ``key`` to ``builder``.

    Raises:
        ValueError: ``key`` is already registered with this ``match`` kind.
        TypeError: ``match`` is ``"type"``/``"subclass"`` and ``key`` is not a class.
    """
    if match == "identity":
        if id(key) in _by_id:
            raise ValueError(f"{key!r} already has a dynamo-ext variable builder")
        _by_id[id(key)] = (key, builder)
        return
    if match == "code":
        if not isinstance(key, types.CodeType):
            raise TypeError(f"register_variable(match='code') needs a code object, got {key!r}")
        if key in _by_code:
            raise ValueError(f"code {key.co_name} already has a dynamo-ext variable builder")
        _by_code[key] = builder
        return
    if not isinstance(key, type):
        raise TypeError(f"register_variable(match={match!r}) needs a class, got {key!r}")
    if match == "type":
        if key in _by_type:
            raise ValueError(f"type {key.__qualname__} already has a dynamo-ext variable builder")
        _by_type[key] = builder
    elif match in ("subclass", "class"):
        table = _by_subclass if match == "subclass" else _by_class
        if any(k is key for k, _ in table):
            raise ValueError(f"class {key.__qualname__} already has a dynamo-ext {match} builder")
        table.append((key, builder))
    else:
        raise ValueError(f"match must be 'identity', 'code', 'type', 'subclass' or 'class', got {match!r}")
    _type_cache.clear()


def unregister_variable(key: Any, *, match: Match = "type") -> None:
    """Remove ``key``'s builder.  Raises ``KeyError`` when it was not registered."""
    if match == "identity":
        del _by_id[id(key)]
        return
    if match == "code":
        del _by_code[key]
        return
    if match == "type":
        del _by_type[key]
    else:
        table = _by_subclass if match == "subclass" else _by_class
        idx = next((i for i, (k, _) in enumerate(table) if k is key), None)
        if idx is None:
            raise KeyError(key)
        del table[idx]
    _type_cache.clear()


def lookup(value: Any) -> Builder | None:
    """The builder for ``value``, or ``None``.  Hot path: one or two dict lookups."""
    hit = _by_id.get(id(value))
    if hit is not None and hit[0] is value:
        return hit[1]
    if type(value) is types.MethodType:  # a bound method of a registered function
        hit = _by_id.get(id(value.__func__))
        return hit[1] if hit is not None and hit[0] is value.__func__ else None
    if _by_code and type(value) is types.FunctionType:
        found = _by_code.get(value.__code__)
        if found is not None:
            return found
    if _by_class and isinstance(value, type):
        for k, b in _by_class:
            if issubclass(value, k):
                return b
    cls = type(value)
    try:
        return _type_cache[cls]
    except KeyError:
        pass
    found = _by_type.get(cls)
    if found is None:
        found = next((b for k, b in _by_subclass if issubclass(cls, k)), None)
    _type_cache[cls] = found
    return found


def clear() -> None:
    """Forget every entry (``uninstall()``)."""
    _by_id.clear()
    _by_code.clear()
    _by_type.clear()
    _by_subclass.clear()
    _by_class.clear()
    _type_cache.clear()


_stock: dict[str, Callable[..., Any]] = {}


def stock_variable(tx: Any, value: Any, source: Any) -> Any:
    """The tracker stock Dynamo would build for ``value`` (bypassing this table)."""
    if source is not None:
        builder = _compat.VariableBuilder(tx, source)
        return _stock["wrap"](builder, value)
    return _stock["create"](tx, value)


def hook_builders(patches: Patcher) -> None:
    """Make ``VariableBuilder._wrap`` and ``SourcelessBuilder.create`` consult the table first."""
    vb = _compat.VariableBuilder
    sb = _compat.SourcelessBuilder
    orig_wrap = vb._wrap
    orig_create = sb.create

    def _wrap(self: Any, value: Any) -> Any:
        builder = lookup(value)
        if builder is not None:
            vt = builder(self.tx, value, self.source)
            if vt is not None:
                return vt
        return orig_wrap(self, value)

    def create(tx: Any, value: Any) -> Any:
        builder = lookup(value)
        if builder is not None:
            vt = builder(tx, value, None)
            if vt is not None:
                return vt
        if type(value) is types.MethodType and lookup(value.__self__) is not None:
            # A bound method of one of our objects, made by constant folding
            # ``getattr(placement, "is_shard")`` (torch 2.11): a method of our tracker.
            return _compat.GetAttrVariable(create(tx, value.__self__), value.__name__)
        return orig_create(tx, value)

    _stock.update(wrap=orig_wrap, create=orig_create)
    patches.on_undo(_stock.clear)
    patches.setattr(vb, "_wrap", _wrap)
    patches.setattr(sb, "create", staticmethod(create))
