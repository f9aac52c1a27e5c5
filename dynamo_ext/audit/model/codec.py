"""A generic codec between frozen dataclasses and JSON values, driven by the dataclasses' type hints.

:func:`encode` turns a dataclass into a ``dict`` (fields in declaration order, then the properties named in
the class's ``__json_extra__``, such as a computed ``count``), tuples into lists, enums into their values.
A dataclass with its own ``to_json()`` is encoded by it.  :func:`decode` reads such a value back into the
class: it converts by the field's annotation (``tuple[X, ...]``, ``tuple[A, B]``, ``X | None``, nested
dataclasses, enums, ``int``/``float``; a value that already is the annotated dataclass stays), ignores keys that are not fields (``__json_extra__`` and keys a newer
writer added) and fills a missing key from the field's default or the class's ``__json_defaults__`` (keys
older writers did not write).  The same annotations give the JSON schema (:mod:`.json_schema`).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable
from typing import Any


def encode(obj: Any) -> Any:
    """``obj`` as plain JSON values (dicts, lists, str, int, float, bool, None)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        own = getattr(obj, "to_json", None)
        return own() if callable(own) else encode_fields(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [encode(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): encode(v) for k, v in obj.items()}
    return obj


def encode_fields(obj: Any) -> dict[str, Any]:
    """The fields of dataclass ``obj`` (then its ``__json_extra__`` properties), each :func:`encode`-d."""
    out = {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    for name in getattr(type(obj), "__json_extra__", ()):
        out[name] = encode(getattr(obj, name))
    return out


@functools.cache
def field_types(cls: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    """``(field, resolved annotation)`` of each field of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def decode(tp: Any, value: Any) -> Any:
    """``value`` (a JSON value) as type ``tp``.

    Raises:
        ValueError: a required field is missing, or a value does not fit its annotation (the message names
            the class and field).
    """
    return _converter(tp)(value)


def _identity(value: Any) -> Any:
    return value


def _to_int(value: Any) -> Any:
    return value if type(value) is int or isinstance(value, bool) else int(value)


# NOTE [codec converters]: each annotation is turned into a conversion function once (cached), so that reading
# a merge's many thousands of events does not inspect type hints per value.
@functools.cache
def _converter(tp: Any) -> Callable[[Any], Any]:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return lambda value: value if isinstance(value, tp) else _decode_dataclass(tp, value)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        (inner_tp,) = [a for a in args if a is not type(None)]
        inner = _converter(inner_tp)
        nullable = type(None) in args
        return lambda value: None if value is None and nullable else inner(value)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _converter(args[0])
        return tuple if item is _identity else lambda value: tuple(item(x) for x in value)
    if origin is tuple:
        items = [_converter(a) for a in args]

        def fixed(value: Any) -> tuple[Any, ...]:
            if len(items) != len(value):
                raise ValueError(f"expected {len(items)} items for {tp}, got {len(value)}")
            return tuple(c(x) for c, x in zip(items, value))

        return fixed
    if origin is dict:
        item = _converter(args[1]) if args else _identity
        return dict if item is _identity else lambda value: {k: item(v) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    if tp is float:
        return float
    if tp is int:
        return _to_int
    return _identity


@functools.cache
def _fields_of(cls: type) -> tuple[tuple[str, Callable[[Any], Any], bool], ...]:
    """``(name, converter, required)`` per field of ``cls``; required: no default and no ``__json_defaults__``."""
    defaults = getattr(cls, "__json_defaults__", {})
    return tuple(
        (
            f.name,
            _converter(tp),
            f.name not in defaults and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f, tp in field_types(cls)
    )


def _decode_dataclass(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    kwargs = {}
    for name, convert, required in _fields_of(cls):
        if name in data:
            try:
                kwargs[name] = convert(data[name])
            except (TypeError, ValueError, KeyError) as e:
                raise ValueError(f"{cls.__name__}.{name}: {e}") from None
        elif required:
            raise ValueError(f"{cls.__name__}: missing key {name!r}")
        elif name in getattr(cls, "__json_defaults__", {}):
            kwargs[name] = copy.copy(cls.__json_defaults__[name])  # type: ignore[attr-defined]
    return cls(**kwargs)
