"""End-to-end: ``dynamo-ext audit`` on real gloo ranks, the HTML in headless Chromium, bad input, the fixture."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dynamo_ext.audit.pytest_plugin import dynamo_audit  # noqa: F401  (registers the fixture here)

REPO = Path(__file__).resolve().parent.parent
TARGETS = Path(__file__).resolve().parent / "audit_targets"
KNOWN = TARGETS / "known_breaks.py"
MISBEHAVES = TARGETS / "misbehaves.py"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "dynamo_ext", "audit", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def marker_line(path: Path, marker: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if marker in line)


def worker_pids() -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if b"dynamo_ext.audit.collect" in cmd and b"misbehaves.py" in cmd:
                out.append(int(d))
    return out


@pytest.fixture(scope="module")
def known_run():
    """One 2-rank run of the known-breaks target with the plugin, JSON and HTML written."""
    tmp = Path(tempfile.mkdtemp(prefix="audit-e2e-"))
    proc = cli(
        "--nproc",
        "2",
        "--json",
        str(tmp / "out.json"),
        "--html",
        str(tmp / "out.html"),
        str(KNOWN.relative_to(REPO)),
        "--",
        "--object-collective",
    )
    yield proc, tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.gloo
def test_known_breaks_every_rank_right_lines_and_exact_counts(known_run):
    proc, tmp = known_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp / "out.json").read_text())
    assert data["plugin"]["installed"] is True
    rel = str(KNOWN.relative_to(REPO))
    by_line = {b["line"]: b for b in data["graph_breaks"] if b["file"] == rel}
    for marker, distributed in (("BREAK_PRINT", False), ("BREAK_ITEM", False), ("BREAK_OBJECT", True)):
        b = by_line[marker_line(KNOWN, marker)]
        assert b["ranks"] == [0, 1], b
        assert b["function"] == "step"
        assert b["distributed"] is distributed, b
        assert marker in b["source"]
        assert not b["hang_risk"]
    assert (
        "print" in by_line[marker_line(KNOWN, "BREAK_PRINT")]["gb_type"]
        or "builtin" in by_line[marker_line(KNOWN, "BREAK_PRINT")]["gb_type"]
    )
    assert "item" in by_line[marker_line(KNOWN, "BREAK_ITEM")]["gb_type"]
    for r in data["ranks"]:
        assert r["status"] == "ok"
        # Exact: the audit's count of graph breaks equals Dynamo's own counter on that rank.
        assert r["graph_breaks"] == r["dynamo_graph_breaks"], r
        assert r["graph_breaks"] + r["frame_skips"] >= 3
    assert data["totals"]["graph_breaks"] >= 3
    assert "Graph breaks, by impact" in proc.stdout


@pytest.mark.gloo
def test_stock_counts_and_skipped_frame_and_recompile():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "lr.json")
        proc = cli("--no-plugin", "--quiet", "--json", out, str(TARGETS / "loop_and_recompile.py"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        data = json.loads(Path(out).read_text())
    assert data["plugin"]["installed"] is False
    (b,) = data["graph_breaks"]
    assert (b["kind"], b["line"], b["ranks"]) == (
        "frame_skip",
        marker_line(TARGETS / "loop_and_recompile.py", "BREAK_LOOP"),
        [0, 1],
    )
    (rc,) = data["recompiles"]
    assert rc["function"] == "shaped" and "size mismatch" in rc["reason"] and rc["ranks"] == [0, 1]
    for r in data["ranks"]:
        assert (r["graph_breaks"], r["frame_skips"], r["recompiles"]) == (0, 1, 1)
        assert r["graph_breaks"] == r["dynamo_graph_breaks"]


@pytest.mark.gloo
def test_hang_risk_only_where_collectives_differ_and_identities_are_machine_independent():
    """Rank-dependent graphs: `agree` is fine, `differ` fails the gate; `later` keeps its identity although
    rank 1 recompiled `shaped` once more; run from another directory with an absolute target path, the
    files are still relative to the checkout."""
    target = TARGETS / "rank_dependent.py"
    rel = str(target.relative_to(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rd.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        proc = subprocess.run(
            [sys.executable, "-m", "dynamo_ext", "audit", "--nproc", "2", "--quiet", "--json", out, str(target)],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 1, proc.stderr[-3000:]
        data = json.loads(Path(out).read_text())
    graphs = {g["id"]: g for g in data["graphs"]}
    agree = graphs[f"{rel}:{marker_line(target, 'def agree')} agree"]
    assert agree["divergent"] and not agree["hang_risk"], agree
    assert dict(agree["op_count_by_rank"])[0] != dict(agree["op_count_by_rank"])[1]
    assert agree["collective_sequence_by_rank"] == [[0, ["all_reduce"]], [1, ["all_reduce"]]]
    differ = graphs[f"{rel}:{marker_line(target, 'def differ')} differ"]
    assert differ["hang_risk"], differ
    assert differ["collective_sequence_by_rank"] == [[0, ["all_reduce"]], [1, []]]
    later = graphs[f"{rel}:{marker_line(target, 'def later')} later"]
    assert later["ranks"] == [0, 1] and not later["divergent"], later
    (extra,) = [g for g in data["graphs"] if "| recompile: tensor 'x' size mismatch" in g["id"]]
    assert extra["ranks"] == [1] and extra["divergent"] and not extra["hang_risk"]
    (risk,) = data["totals"]["hang_risks"]
    assert f"{rel}:{marker_line(target, 'def differ')} differ" in risk
    assert "budget --max-hang-risks 0" in proc.stderr
    assert all(not g["file"].startswith("/") for g in data["graphs"])
    assert all(not r["file"].startswith("/") for r in data["recompiles"])


@pytest.mark.gloo
def test_numerics_gate_names_the_gradient_wrong_only_under_compile():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "nw.json")
        proc = cli("--nproc", "2", "--quiet", "--check-numerics", "--json", out, str(TARGETS / "numerics_wrong.py"))
        assert proc.returncode == 1, proc.stderr[-3000:]
        data = json.loads(Path(out).read_text())
    assert "numerics: " in proc.stderr and "first: gradient of lin.weight on rank 0: max abs error" in proc.stderr
    num = data["numerics"]
    assert num["ranks"] == [0, 1] and num["compared"] == 1 + 1 + 4 + 4  # loss, out, 4 grads, 4 params
    first = num["mismatches"][0]
    assert (first["kind"], first["name"], first["rank"]) == ("grad", "lin.weight", 0)
    assert {m["rank"] for m in num["mismatches"]} == {0, 1}
    assert data["totals"]["numerics_mismatches"] == len(num["mismatches"])
    # The target's own check_step (a tolerance the 1% error passes) is what gets reported: make_step() is not
    # checked again (with the default tolerances it would fail, as above).
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "own.json")
        target = str(TARGETS / "numerics_wrong.py")
        proc = cli("--nproc", "2", "--quiet", "--check-numerics", "--json", out, target, "--", "--self-check")
        assert proc.returncode == 0, proc.stderr[-3000:]
        num = json.loads(Path(out).read_text())["numerics"]
    assert num["ranks"] == [0, 1] and num["compared"] == 10 and num["mismatches"] == []


@pytest.mark.gloo
def test_gate_budget_and_baseline(known_run):
    _, tmp = known_run
    base = tmp / "out.json"
    proc = cli("--nproc", "2", "--quiet", "--max-breaks", "1", "--baseline", str(base), str(KNOWN.relative_to(REPO)))
    assert proc.returncode == 1, proc.stderr
    assert "budget --max-breaks 1" in proc.stderr
    assert "new graph break" not in proc.stderr  # a subset of the baseline's breaks
    diff = subprocess.run(
        [sys.executable, "-m", "dynamo_ext", "audit", "diff", str(base), str(base)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert diff.returncode == 0 and diff.stdout.startswith("new: 0\nfixed: 0\nunchanged: ")


@pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium for the headless render (apt-get install -y chromium)"
)
def test_html_renders_in_headless_chromium(known_run):
    proc, tmp = known_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp / "out.json").read_text())
    page = (tmp / "out.html").as_uri()
    flags = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
        f"--user-data-dir={tmp / 'profile'}",
    ]  # fmt: skip
    shot = tmp / "shot.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1280,1600", page], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dom = subprocess.run([*flags, "--dump-dom", page], capture_output=True, text=True, timeout=120).stdout
    title = re.search(r"<title>(.*?)</title>", dom).group(1)
    assert title == f"dynamo-ext audit: {KNOWN.relative_to(REPO)}"
    rows = len(re.findall(r'<tr class="break-row"', dom))
    assert rows == len(data["graph_breaks"]) >= 3
    # The page's script ran and counted the same rows.
    assert f'data-break-rows="{rows}"' in dom


# ---- library warnings: in the rank logs, one summary line for the command's own process -------
@pytest.mark.gloo
def test_library_warnings_go_to_rank_logs_not_the_terminal(tmp_path):
    out = tmp_path / "noisy.json"
    proc = cli("--nproc", "2", "--keep-logs", "--json", str(out), "tests.audit_targets.noisy:main")
    data = json.loads(out.read_text()) if out.exists() else {"ranks": []}
    logs = [Path(r["log"]) for r in data["ranks"] if r["log"]]
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "warning on rank" not in proc.stderr + proc.stdout
        # Raised in the command's process (it imports the target to check it): summarised once, at the end.
        line = marker_line(TARGETS / "noisy.py", 'warnings.warn("noisy target: warning at import"')
        assert proc.stderr.strip().splitlines() == [
            "dynamo-ext audit: note: library warning, not shown where raised: UserWarning: noisy target: warning at "
            f"import (noisy.py:{line}); python -W default shows them"
        ]
        assert len(logs) == 2
        for r, log in zip((0, 1), logs, strict=True):
            text = log.read_text()
            assert f"noisy target: warning on rank {r}" in text and "noisy target: warning at import" in text, text
    finally:
        for log in logs:
            work = next(p for p in log.parents if p.name.startswith("dynamo-ext-audit-"))
            shutil.rmtree(work, ignore_errors=True)


def test_warning_summary_names_the_first_and_counts_the_rest():
    import warnings

    from dynamo_ext.audit.cli import warning_summary

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("first\n  of two", DeprecationWarning, stacklevel=1)
        warnings.warn("second", UserWarning, stacklevel=1)
    assert warning_summary(caught) == (
        "dynamo-ext audit: note: library warning, not shown where raised: DeprecationWarning: first of two "
        f"(test_audit_e2e.py:{caught[0].lineno}); 1 more; python -W default shows them"
    )


# ---- bad input: one line, non-zero exit, partial report, no stray processes ----------------
def test_missing_file():
    proc = cli("no/such/script.py")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "dynamo-ext audit: error: target not found: 'no/such/script.py' is neither a file nor module:function"
    )


def test_unknown_module_and_function():
    proc = cli("no_such_module_xyz:main")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("dynamo-ext audit: error: unknown module 'no_such_module_xyz'")
    proc = cli("dynamo_ext.audit.targets.example_llama:no_such_function")
    assert proc.returncode == 2
    assert "has no function 'no_such_function'" in proc.stderr


WAITS = TARGETS / "waits_in_compiled.py"
HANG_TIMEOUT = 30  # long enough for both ranks to start (over 20 s on a loaded 2-core machine) and reach the hang


def _rank_failure_run(mode: str, timeout: float, tmp: str) -> tuple[subprocess.CompletedProcess[str], str, Path]:
    """``dynamo-ext audit`` of misbehaves.py in ``mode``: the process, the JSON's path and the HTML's."""
    out, html = os.path.join(tmp, "partial.json"), Path(tmp) / "partial.html"
    proc = cli(
        *("--nproc", "2", "--quiet", "--timeout", str(timeout), "--json", out, "--html", str(html)),
        *(str(MISBEHAVES.relative_to(REPO)), "--", mode),
        timeout=timeout + 60,
    )
    return proc, out, html


@pytest.fixture(scope="module")
def hang_runs():
    """The two runs that wait out their --timeout (a rank hung), started together so the waits overlap:
    ``{"waits_in_compiled": proc, "hang": (proc, json path, html path)}``."""
    tmp = tempfile.mkdtemp(prefix="audit-e2e-hang-")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waits = pool.submit(
            cli, *("--nproc", "2", "--quiet", "--timeout", str(HANG_TIMEOUT), str(WAITS.relative_to(REPO))), timeout=300
        )
        hang = pool.submit(_rank_failure_run, "hang", HANG_TIMEOUT, tmp)
        yield {"waits_in_compiled": waits.result(), "hang": hang.result()}
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.gloo
def test_a_rank_waiting_in_a_compiled_collective_is_placed_at_the_collective(hang_runs):
    """NOTE [where each rank waits]: rank 0 blocks in a compiled all-reduce after a graph break, rank 1 sleeps
    before it; the report names rank 0's collective, its stream position and line (not the resumed function's
    print line), and rank 1 as behind on the group."""
    target = WAITS
    proc = hang_runs["waits_in_compiled"]
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[0].split("; rank logs")[0]
    sleep, all_reduce = marker_line(target, "SLEEP_LINE"), marker_line(target, "ALL_REDUCE_LINE")
    assert f"rank 1 hung at tests/audit_targets/waits_in_compiled.py:{sleep} in main" in line, line
    assert re.search(
        r"rank 0 waiting in a compiled collective: forward all_reduce\(float32\[4\], sum\) on group '0' "
        rf"\(ranks 0, 1\), position (\d+), at \S*waits_in_compiled\.py:{all_reduce}: dist\.all_reduce\(x\)",
        line,
    ), line
    position = int(re.search(r"position (\d+), at", line).group(1))
    assert f"rank(s) 1 behind on group '0' (last entered position {position - 1}; rank(s) 0 at {position})" in line
    assert line.endswith("; killed"), line


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("mode", "status", "message", "timeout"),
    [
        # raise and die end by themselves: a timeout they never reach (a loaded 2-core machine can take over
        # 20 s to start two ranks); hang waits for it, long enough for both ranks to reach the print break.
        ("raise", "error", "rank 1 raised ValueError: rank 1 refuses (at tests/audit_targets/misbehaves.py:", 240),
        ("kill", "died", "rank 1 ended without finishing (exit code -9 (signal 9))", 240),
        ("hang", "timeout", "timeout: after 30 s: rank 1 hung at tests/audit_targets/misbehaves.py:", HANG_TIMEOUT),
    ],
)
def test_rank_failures(mode, status, message, timeout, request):
    """A rank that raised, was killed or hung: exit 2 naming it, and the partial JSON and HTML are written
    (``audit merge`` exits 1 for the same ranks: test_audit_multinode.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "hang":  # run beside the other hang (the hang_runs fixture)
            proc, out, html = request.getfixturevalue("hang_runs")["hang"]
        else:
            proc, out, html = _rank_failure_run(mode, timeout, tmp)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dynamo-ext audit: error: " + message), lines
        data = json.loads(Path(out).read_text())
        page = html.read_text()
    assert data["ranks"][1]["status"] == status
    if mode == "hang":  # the hung rank is named with its line; the other waits for it in a collective
        line = marker_line(MISBEHAVES, "time.sleep(3600)")
        assert (
            lines[0]
            .split("; rank logs")[0]
            .endswith(
                f"misbehaves.py:{line} in main (time.sleep(3600)); rank(s) 0 waiting in torch.distributed; killed"
            )
        ), lines
        assert data["ranks"][0]["error"].startswith(
            f"still running after {timeout} s, waiting in torch.distributed (barrier)"
        )
    rows = re.findall(r'<tr class="rank-row"><td class="num">(\d)</td><td>[^<]*</td><td class="(\w+)">(\w+)</td>', page)
    assert rows[1] == ("1", "bad", status)
    assert "error: " + message.split(" (at ")[0] in page.replace("&#x27;", "'")
    # What was collected before the failure is in the report: the print break, on both ranks.
    (b,) = data["graph_breaks"]
    assert b["line"] == marker_line(MISBEHAVES, "BREAK_PRINT") and b["ranks"] == [0, 1]
    assert worker_pids() == []


# ---- the pytest fixture -------------------------------------------------------------------
def _whole(x):
    return (x * 2).relu()


def test_fixture_passes_and_returns_report(dynamo_audit):  # noqa: F811
    import torch

    report = dynamo_audit(_whole, torch.ones(3), backend="eager", max_breaks=0)
    assert report.total_breaks == 0 and report.ranks[0].graphs == 1


def test_fixture_fails_past_budget(dynamo_audit):  # noqa: F811
    import torch

    def chatty(x):
        print("hi")
        return x + 1

    with pytest.raises(pytest.fail.Exception, match=r"1 graph break\(s\) per rank, budget --max-breaks 0"):
        dynamo_audit(chatty, torch.ones(3), backend="eager", max_breaks=0)
