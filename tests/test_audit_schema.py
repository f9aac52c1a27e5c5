"""The report's JSON form: the checked-in JSON schema is what the records generate, reports round-trip through
the generic codec, and what ``to_json`` writes fits the schema."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_audit import brk, comp, run_events
from test_audit_comm import _coll

from dynamo_ext.audit import report_from_json
from dynamo_ext.audit.merge.merger import merge
from dynamo_ext.audit.model import codec, json_schema
from dynamo_ext.audit.model.kinds import BreakKind, MismatchKind, RankStatus
from dynamo_ext.audit.model.records import Frame, RankSummary


def _full_report():
    """A report with every record: breaks (a frame skip too), graphs with a fusion, a recompile, numerics with a
    mismatch, the communication report with a count difference, a rank that died, and a stock run."""

    def events(rank):
        fusion = {
            "ev": "fusion",
            "compile_id": "0/0",
            "fusion": "residual_rms_norm",
            "kernel": "one_shot",
            "group_name": "1",
            "nbytes": 64,
            "node": "all_reduce",
            "phase": "forward",
            "after_compile": False,
        }
        numerics = {
            "ev": "numerics",
            "compared": 3,
            "eager_comm": {"forward": {"all_gather": 2}, "backward": {}},
            "mismatches": [{"index": 1, "kind": "grad", "name": "w", "detail": "", "max_abs": 0.5, "max_rel": 0.25}],
        }
        comm = {
            "ev": "comm_graph",
            "compile_id": "0/0",
            "graph": "forward",
            "aot_id": 0,
            "inlined_aot_ids": [],
            "collectives": [
                {
                    **_coll(0, "all_gather_into_tensor", "all_gather", origin="explicit"),
                    "shape_in": "[4]",
                    "shape_out": "[8]",
                }
            ],
        }
        return run_events(
            brk(),
            brk(line=20, kind="frame_skip"),
            fusion,
            comp(colls={"all_gather_into_tensor": 1}),
            comp(recompile="0/1: x.size()[0] == 4"),
            comm,
            numerics,
        )  # fmt: skip

    died = run_events(brk())[:-1]
    stock = merge({0: run_events(brk()), 1: run_events()}, target="t.py", world_size=2, backend="aot_eager")
    report = merge({0: events(0), 1: events(1), 2: died}, target="t.py", world_size=4, backend="aot_eager")
    return dataclasses.replace(report, stock=stock, errors=("rank 3 never started",), notes=("a note",))


def test_the_full_report_has_every_record():
    r = _full_report()
    assert {b.kind for b in r.graph_breaks} == {BreakKind.GRAPH_BREAK, BreakKind.FRAME_SKIP}
    assert r.recompiles and any(g.fusions for g in r.graphs) and r.comm.collectives and r.comm.count_differences
    assert r.numerics.mismatches[0].kind is MismatchKind.GRAD
    assert [s.status for s in r.ranks] == [RankStatus.OK, RankStatus.OK, RankStatus.DIED, RankStatus.DIED]
    assert r.stock is not None and r.stock.graph_breaks


def test_checked_in_schema_is_what_the_records_generate():
    checked_in = Path(json_schema.SCHEMA_FILE).read_text(encoding="utf-8")
    assert checked_in == json_schema.render(), (
        "dynamo_ext/audit/model/report.schema.json is stale: python -m dynamo_ext.audit.model.json_schema --write"
    )


def test_round_trip_through_json_text():
    r = _full_report()
    data = json.loads(json.dumps(r.to_json()))
    back = report_from_json(data)
    assert back == r
    assert back.to_json() == data
    assert type(back.ranks[0].status) is RankStatus and type(back.graph_breaks[0].stack[0]) is Frame


def _validate(value, schema, root, path="$"):
    """The errors of ``value`` against the subset of JSON Schema that ``json_schema`` writes."""
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    if "anyOf" in schema:
        options = [_validate(value, s, root, path) for s in schema["anyOf"]]
        return [] if any(not o for o in options) else [f"{path}: fits no option: {options}"]
    types = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float), "boolean": bool,
             "null": type(None)}  # fmt: skip
    kind = schema.get("type")
    if kind and (not isinstance(value, types[kind]) or (kind in ("integer", "number") and isinstance(value, bool))):
        return [f"{path}: expected {kind}, got {type(value).__name__}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} is not {schema['const']!r}")
    if kind == "object":
        errors += [f"{path}: missing {k!r}" for k in schema.get("required", ()) if k not in value]
        for k, sub in schema.get("properties", {}).items():
            if k in value:
                errors += _validate(value[k], sub, root, f"{path}.{k}")
    if kind == "array":
        if "prefixItems" in schema and len(value) != len(schema["prefixItems"]):
            errors.append(f"{path}: expected {len(schema['prefixItems'])} items, got {len(value)}")
        for i, x in enumerate(value):
            sub = schema["prefixItems"][i] if "prefixItems" in schema else schema.get("items", {})
            errors += _validate(x, sub, root, f"{path}[{i}]") if i < len(schema.get("prefixItems", value)) else []
    return errors


def test_to_json_fits_the_schema_and_the_check_can_fail():
    schema = json_schema.report_schema()
    data = json.loads(json.dumps(_full_report().to_json()))
    assert _validate(data, schema, schema) == []
    bad = json.loads(json.dumps(data))
    bad["ranks"][0]["status"] = "asleep"
    del bad["graph_breaks"][0]["count"]
    bad["graphs"][0]["op_count_by_rank"][0] = [0]
    bad["stock"]["world_size"] = "2"
    assert _validate(bad, schema, schema) == [
        "$.graph_breaks[0]: missing 'count'",
        "$.graphs[0].op_count_by_rank[0]: expected 2 items, got 1",
        "$.ranks[0].status: 'asleep' not one of ['ok', 'error', 'died', 'timeout', 'stopped', 'missing', 'unknown']",
        "$.stock: fits no option: [['$.stock.world_size: expected integer, got str'], ['$.stock: expected null, got dict']]",
    ]


def test_decode_errors_name_the_record_and_key_and_older_keys_default():
    data = _full_report().to_json()
    del data["graph_breaks"][0]["wrapper"]  # written before breaks had a wrapper
    del data["stock"]["graphs"]
    back = report_from_json(data)
    assert back.graph_breaks[0].wrapper == "" and back.stock.graphs == ()
    del data["graph_breaks"][0]["gb_type"]
    with pytest.raises(ValueError, match=r"^AuditReport.graph_breaks: GraphBreak: missing key 'gb_type'$"):
        report_from_json(data)
    with pytest.raises(ValueError, match=r"^RankSummary.status: 'asleep' is not a valid RankStatus$"):
        codec.decode(RankSummary, {**codec.encode(_full_report().ranks[0]), "status": "asleep"})
    with pytest.raises(ValueError, match="newer than this dynamo-ext reads"):
        report_from_json({"schema_version": 99, "graph_breaks": []})
