"""Reading a JSON report back into the records: :func:`report_from_json`, :func:`load_report`."""

from __future__ import annotations

import json
from typing import Any

from . import codec
from .records import SCHEMA_VERSION, AuditReport


def report_from_json(data: dict[str, Any]) -> AuditReport:
    """Read back :meth:`.records.AuditReport.to_json` output (the stock run's report included).

    Keys a newer writer added are ignored; keys an older writer of the same schema version did not write take
    their defaults (``__json_defaults__``; ``world_size``: the number of ranks).

    Raises:
        ValueError: ``data`` is not an audit report, has a newer schema version, or a value does not fit its
            record (the message names the record and the key).
    """
    if not isinstance(data, dict) or "graph_breaks" not in data:
        raise ValueError("not a dynamo-ext audit report: expected a JSON object with a 'graph_breaks' key")
    version = data.get("schema_version", 1)
    if version > SCHEMA_VERSION:
        raise ValueError(
            f"audit report schema_version {version} is newer than this dynamo-ext reads ({SCHEMA_VERSION})"
        )
    data = {**data, "world_size": data.get("world_size", len(data.get("ranks", [])))}
    if data.get("stock") is not None:
        data["stock"] = report_from_json(data["stock"])
    return codec.decode(AuditReport, data)


def load_report(path: str) -> AuditReport:
    """Read a JSON report written by ``--json``.

    Raises:
        ValueError: the file is not valid JSON or not an audit report.
        FileNotFoundError: no such file.
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    return report_from_json(data)
