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
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return value if isinstance(value, tp) else _decode_dataclass(tp, value)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return decode(inner, value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], x) for x in value)
        if len(args) != len(value):
            raise ValueError(f"expected {len(args)} items for {tp}, got {len(value)}")
        return tuple(decode(a, x) for a, x in zip(args, value))
    if origin is dict:
        return {k: decode(args[1], v) for k, v in value.items()} if args else dict(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    if tp is float:
        return float(value)
    if tp is int and not isinstance(value, bool):
        return int(value)
    return value


def _decode_dataclass(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    defaults = getattr(cls, "__json_defaults__", {})
    kwargs = {}
    for f, tp in field_types(cls):
        if f.name in data:
            try:
                kwargs[f.name] = decode(tp, data[f.name])
            except (TypeError, ValueError, KeyError) as e:
                raise ValueError(f"{cls.__name__}.{f.name}: {e}") from None
        elif f.name in defaults:
            kwargs[f.name] = copy.copy(defaults[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}: missing key {f.name!r}")
    return cls(**kwargs)
