"""The JSON schema of :meth:`.records.AuditReport.to_json`, generated from the records' type hints.

``report.schema.json`` beside this module is its output, checked in (``tests/test_audit_schema.py`` checks
that it equals what the records generate).  After changing a record, regenerate it:
``python -m dynamo_ext.audit.model.json_schema --write``.  The same annotations drive :mod:`.codec`, so
the schema describes what the codec writes: each record an object with its fields and ``__json_extra__``
properties, tuples as arrays, enums as their values.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import types
import typing
from typing import Any

from . import codec
from .records import SCHEMA_VERSION, AuditReport

SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report.schema.json")
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of an audit report's JSON form."""
    defs: dict[str, Any] = {}
    _schema_of(AuditReport, defs)
    # AuditReport.to_json puts the schema version first, the stock run's report included.
    report = defs["AuditReport"]
    report["properties"] = {"schema_version": {"type": "integer", "const": SCHEMA_VERSION}, **report["properties"]}
    report["required"] = ["schema_version", *report["required"]]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "dynamo-ext audit report",
        "description": f"dynamo-ext audit --json output, schema_version {SCHEMA_VERSION} (docs/audit.md)",
        "$ref": "#/$defs/AuditReport",
        "$defs": dict(sorted(defs.items())),
    }


def _schema_of(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # placeholder: a record may contain itself (AuditReport.stock)
            defs[tp.__name__] = _record(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema_of(a, defs) for a in args if a is not type(None)] + [{"type": "null"}]}
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return {"type": "array", "items": _schema_of(args[0], defs)}
    if origin is tuple:
        n = len(args)
        return {"type": "array", "prefixItems": [_schema_of(a, defs) for a in args], "minItems": n, "maxItems": n}
    if origin is list:
        return {"type": "array", "items": _schema_of(args[0], defs) if args else {}}
    if origin is dict or tp is dict:
        return {"type": "object"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": "string", "enum": [m.value for m in tp]}
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if tp is Any:
        return {}
    raise TypeError(f"no JSON schema for annotation {tp!r}: add it to dynamo_ext/audit/model/json_schema.py")


def _record(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required = []
    for f, tp in codec.field_types(cls):
        props[f.name] = _schema_of(tp, defs)
        required.append(f.name)  # the codec writes every field
    for name in getattr(cls, "__json_extra__", ()):
        props[name] = _schema_of(typing.get_type_hints(getattr(cls, name).fget)["return"], defs)
        required.append(name)
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    return {
        "type": "object",
        "description": " ".join(doc.split()),
        "properties": props,
        "required": required,
    }


def render() -> str:
    """:func:`report_schema` as the text of ``report.schema.json``."""
    return json.dumps(report_schema(), indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``--write``: regenerate ``report.schema.json``; else print the schema."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        with open(SCHEMA_FILE, "w", encoding="utf-8") as f:
            f.write(render())
        print(f"wrote {SCHEMA_FILE}")
        return 0
    if argv:
        print("usage: python -m dynamo_ext.audit.model.json_schema [--write]", file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
