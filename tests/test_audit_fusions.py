"""The audit lists the fusions dynamo-ext's Inductor passes applied, per graph.

- Tier 1, hand-made structured-trace records fed to the collector and events fed to the
  merge: a forward fusion (logged before its frame's ``compilation_metrics``) and a lazy
  backward one (logged after) land on the graph of their compile id, a reused compile id
  (after ``torch._dynamo.reset()``) on the new graph; ranks, terminal, HTML and JSON; the
  same records read back from TORCH_TRACE logs (``dynamo-ext audit merge DIR``).
- Tier 1, real: the residual + RMSNorm fusion compiled on the fake process group under the
  collector is listed for that graph.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import torch
from test_lowering_patterns import _args, _compile, block_manual

from dynamo_ext import _compat
from dynamo_ext.audit import Fusion, report_from_json
from dynamo_ext.audit.merge.merger import merge
from dynamo_ext.audit.merge.trace_reader import merge_trace_dir
from dynamo_ext.audit.rank.collector import FUSION_ARTIFACT, Collector
from dynamo_ext.audit.render.html import render_html
from dynamo_ext.audit.render.text import render_text
from dynamo_ext.inductor_lowerings import decisions


def _record(metadata, payload=""):
    rec = logging.LogRecord("torch.__trace", logging.DEBUG, __file__, 0, "", (), None)
    rec.metadata = metadata
    rec.payload = payload
    return rec


def _cid(frame):
    return {"frame_id": frame, "frame_compile_id": 0, "attempt": 0}


def _fusion(frame, node, kernel="epilogue", nbytes=256):
    payload = {
        "fusion": "residual_rms_norm",
        "kernel": kernel,
        "group_name": "0",
        "nbytes": nbytes,
        "compile_id": f"{frame}/0",
        "node": node,
    }
    md = {"artifact": {"name": FUSION_ARTIFACT, "encoding": "json"}, **_cid(frame)}
    return _record(md, json.dumps(payload))


def _compile_records(frame, function, line):
    graph = _record({"dynamo_output_graph": {"sizes": {}}, **_cid(frame)}, "")
    metrics = {
        "compile_id": f"{frame}/0",
        "co_name": function,
        "co_filename": "train.py",
        "co_firstlineno": line,
        "graph_op_count": 4,
        "entire_frame_compile_time_s": 0.1,
    }
    return graph, _record({"compilation_metrics": metrics})


def _rank_records(*, backward_fusion: bool):
    """One rank: ``block`` with a forward fusion and (optionally) a lazy backward one; ``other`` without."""
    block_graph, block_metrics = _compile_records(0, "block", 10)
    other_graph, other_metrics = _compile_records(1, "other", 30)
    records = [block_graph, _fusion(0, "all_reduce"), block_metrics, other_graph, other_metrics]
    if backward_fusion:
        records.append(_fusion(0, "all_reduce_1", kernel="one_shot", nbytes=512))
    return records


def _rank_events(*, backward_fusion: bool):
    c = Collector()
    for r in _rank_records(backward_fusion=backward_fusion):
        c.emit(r)
    events = [e for e in c.events if e["ev"] != "comm_graph"]
    assert not [e for e in events if e["ev"] == "internal"], events
    return [{"ev": "start", "plugin": {}}, *events, {"ev": "end", "counters": {}}]


def _report():
    return merge(
        {0: _rank_events(backward_fusion=True), 1: _rank_events(backward_fusion=False)},
        target="train.py",
        world_size=2,
        backend="inductor",
    )


def test_collector_records_one_event_per_fusion_artifact():
    events = [e for e in _rank_events(backward_fusion=True) if e["ev"] == "fusion"]
    assert [(e["compile_id"], e["node"], e["phase"], e["after_compile"]) for e in events] == [
        ("0/0", "all_reduce", "forward", False),
        ("0/0", "all_reduce_1", "backward", True),
    ]
    assert decisions.ARTIFACT_NAME == FUSION_ARTIFACT


def test_fusions_land_on_the_graph_of_their_compile_with_their_ranks():
    graphs = {g.function: g for g in _report().graphs}
    assert graphs["other"].fusions == ()
    assert graphs["block"].fusions == (
        Fusion("residual_rms_norm", "epilogue", "0", 256, "all_reduce", "forward", (0, 1)),
        Fusion("residual_rms_norm", "one_shot", "0", 512, "all_reduce_1", "backward", (0,)),
    )


def test_reused_compile_id_goes_to_the_new_graph():
    def comp(function):
        return {"ev": "compile", "compile_id": "0/0", "function": function, "file": "t.py", "line": 1}

    base = {"op_count": 3, "has_graph": True, "collectives": {}, "backward_collectives": {}}
    fusion = {"ev": "fusion", "compile_id": "0/0", "fusion": "residual_rms_norm", "kernel": "epilogue"}
    events = [
        {**comp("f"), **base},
        {**fusion, "node": "all_reduce", "after_compile": False},  # after a reset: g's compile, not f's
        {**comp("g"), **base},
        {**fusion, "node": "all_reduce_1", "after_compile": False},  # its compile never finished: left out
    ]
    graphs = {g.function: g for g in merge({0: events}, target="t", world_size=1, backend="").graphs}
    assert graphs["f"].fusions == ()
    assert [f.node for f in graphs["g"].fusions] == ["all_reduce"]


def test_terminal_html_and_json_list_the_fusions():
    report = _report()
    text = render_text(report, width=200)
    assert "fusions applied" in text
    assert "residual_rms_norm (epilogue) at all_reduce, group 0, 256 B" in text
    assert "residual_rms_norm (one_shot) at all_reduce_1 (bwd), group 0, 512 B [ranks 0]" in text
    page = render_html(report)
    assert "<th>fusions applied</th>" in page
    assert "residual_rms_norm (epilogue) at all_reduce, group 0, 256 B<br>" in page
    data = json.loads(json.dumps(report.to_json()))
    [block] = [g for g in data["graphs"] if g["function"] == "block"]
    assert block["fusions"][1] == {
        "fusion": "residual_rms_norm",
        "kernel": "one_shot",
        "group": "0",
        "nbytes": 512,
        "node": "all_reduce_1",
        "phase": "backward",
        "ranks": [0],
    }
    assert report_from_json(data) == report
    plain = dataclasses.replace(report, graphs=tuple(dataclasses.replace(g, fusions=()) for g in report.graphs))
    assert "fusions applied" not in str(plain) and "fusions applied" not in render_html(plain)


def test_torch_trace_logs_list_the_fusions(tmp_path):
    """``dynamo-ext audit merge DIR`` of TORCH_TRACE logs: the same records as glog lines, payloads tab-indented."""
    for rank in (0, 1):
        with open(tmp_path / f"dedicated_log_torch_trace_rank_{rank}_x.log", "w") as f:
            for r in _rank_records(backward_fusion=rank == 0):
                f.write(f"V1123 16:05:09.055000 20606 torch/_logging/structured.py:1] {json.dumps(r.metadata)}\n")
                f.writelines(f"\t{line}\n" for line in r.payload.splitlines())
    graphs = {g.function: g for g in merge_trace_dir(str(tmp_path)).graphs}
    assert graphs["block"].fusions == _report().graphs[0].fusions
    assert [f.phase for f in graphs["block"].fusions] == ["forward", "backward"]


def test_real_compile_lists_the_rms_norm_fusion(world):
    collector = Collector()
    collector.start()
    try:
        with _compat.inductor_config().patch(fx_graph_cache=False):  # a cache hit skips the passes
            _compile(block_manual, *_args(torch.float32, rows=4, hidden=16))
    finally:
        collector.stop()
    events = [{"ev": "start", "plugin": {}}, *collector.events, {"ev": "end", "counters": {}}]
    report = merge({0: events}, target="t", world_size=1, backend="inductor")
    [graph] = [g for g in report.graphs if g.function == "block_manual"]
    assert [(f.fusion, f.kernel, f.group, f.nbytes, f.phase, f.ranks) for f in graph.fusions] == [
        ("residual_rms_norm", "epilogue", "0", 256, "forward", (0,))
    ]
    assert graph.fusions[0].node.startswith("all_reduce")
    assert "residual_rms_norm (epilogue) at all_reduce" in render_text(report, width=200)
