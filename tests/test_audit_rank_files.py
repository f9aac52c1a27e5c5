"""The rank-file format: typed events, the format version every rank file carries and the merge checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_audit import brk, comp, run_events

from dynamo_ext.audit.cli import main as cli_main
from dynamo_ext.audit.merge.merger import merge
from dynamo_ext.audit.merge.rank_files import merge_dir
from dynamo_ext.audit.model.kinds import BreakKind
from dynamo_ext.audit.schema import events as ev


def _write(directory, rank, events):
    directory.mkdir(exist_ok=True)
    (directory / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _header(**extra):
    return {"ev": "start", "format_version": ev.FORMAT_VERSION, "rank": 0, "world_size": 1, "host": "h", **extra}


def test_every_kind_parses_to_its_record_and_back():
    lines = [_header(), *run_events(brk(), comp())[1:], {"ev": "internal", "message": "m"},
             {"ev": "error", "type": "RuntimeError", "message": "boom", "traceback": ""},
             {"ev": "fusion", "compile_id": "0/0", "fusion": "f"}, {"ev": "comm_graph", "compile_id": "0/0",
             "graph": "forward"}, {"ev": "numerics", "compared": 1, "mismatches": []},
             {"ev": "stack", "stack": [["a.py", 1, "f", ""]]}]  # fmt: skip
    parsed = [ev.parse_event(e) for e in lines]
    assert {type(e) for e in parsed} == set(ev.EVENT_TYPES.values())
    b = next(e for e in parsed if isinstance(e, ev.Break))
    assert b.kind is BreakKind.GRAPH_BREAK and b.stack[1] == ("train.py", 10, "step", "print(x)")
    for e in parsed:
        assert ev.parse_event(json.loads(json.dumps(ev.to_dict(e)))) == e


def test_bad_events_name_the_kind_and_the_key():
    with pytest.raises(ValueError, match=r"unknown event kind 'brk'; the kinds are start, break, compile"):
        ev.parse_event({"ev": "brk"})
    with pytest.raises(ValueError, match=r"^Break: missing key 'gb_type'$"):
        ev.parse_event({k: v for k, v in brk().items() if k != "gb_type"})
    with pytest.raises(ValueError, match="not a rank-file event"):
        ev.parse_event(["ev", "start"])
    # The in-memory merge takes the same events, checked the same way.
    with pytest.raises(ValueError, match=r"^Compile: missing key 'file'$"):
        merge({0: [{k: v for k, v in comp().items() if k != "file"}]}, target="t", world_size=1, backend="")


@pytest.mark.parametrize(
    ("header", "seen"),
    [
        ({"format_version": 99}, "rank file of format version 99"),
        ({"format_version": None}, "rank file of no format version (written by a dynamo-ext from before"),
    ],
)
def test_a_rank_file_of_another_version_is_refused_by_name(tmp_path, capsys, header, seen):
    job = tmp_path / "job"
    _write(job, 0, [{**_header(), **header}, brk(), {"ev": "end", "counters": {}, "status": 0}])
    path = job / "rank0.jsonl"
    message = f"{path}: {seen}"
    with pytest.raises(ev.RankFileVersionError, match="this dynamo-ext reads format version 1") as info:
        merge_dir(str(job))
    assert str(info.value).startswith(message)
    assert cli_main(["audit", "merge", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"dynamo-ext audit merge: error: {message}" in " ".join(err.split())


def test_unknown_or_incomplete_lines_are_skipped_and_counted(tmp_path, caplog):
    job = tmp_path / "job"
    _write(job, 0, [_header(), {"ev": "gossip"}, {"ev": "break"}, brk(), {"ev": "end", "counters": {}, "status": 0}])
    report = merge_dir(str(job))
    assert [b.count for b in report.graph_breaks] == [1] and report.ranks[0].status == "ok"
    assert "2 line(s) that are not audit records were skipped" in caplog.text


def test_collect_writes_the_format_version_and_its_file_merges(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import torch\n\ntorch.compile(lambda x: x + 1, backend='eager')(torch.ones(2))\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dynamo_ext.audit.collect", "--no-plugin", "--out", str(out), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    header = json.loads((out / "rank0.jsonl").read_text().splitlines()[0])
    assert header["ev"] == "start" and header["format_version"] == ev.FORMAT_VERSION
    report = merge_dir(str(out))
    assert report.ok and report.ranks[0].graphs == 1
