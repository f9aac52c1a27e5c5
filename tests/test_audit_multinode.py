"""Collect under the user's launcher, merge afterwards: ``python -m dynamo_ext.audit.collect`` and ``audit merge``.

Tier 1: the rank's identity from torchrun/SLURM variables, rank ranges, merging
synthetic rank files (missing and cut-short ranks by host, 1,024 ranks in
ranges).  Tier 2 (gloo): one batch of launches started together and shared by
the tests: a two-node torchrun job simulated on this machine, the same target
under ``dynamo-ext audit --nproc 4``, four plain processes with SLURM variables
and one rank killed, and a stock 2-rank run with ``TORCH_TRACE``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import free_port

from dynamo_ext.audit.cli import main as cli_main
from dynamo_ext.audit.merge.rank_files import incomplete_ranks, merge_dir
from dynamo_ext.audit.model.ranges import format_counts, format_ranks, group_by
from dynamo_ext.audit.rank.target import rank_identity
from dynamo_ext.audit.render.text import render_text

REPO = Path(__file__).resolve().parent.parent
TARGET = Path(__file__).resolve().parent / "audit_targets" / "multinode.py"
REL = str(TARGET.relative_to(REPO))
PY = sys.executable


def merge_main(argv: list[str]) -> int:
    """``dynamo-ext audit merge ARGV...``: its exit status."""
    return cli_main(["audit", "merge", *argv])


def _bench():
    spec = importlib.util.spec_from_file_location("bench_audit_merge", REPO / "benchmarks" / "bench_audit_merge.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def marker_line(marker: str) -> int:
    return next(n for n, line in enumerate(TARGET.read_text().splitlines(), 1) if marker in line)


# ---- tier 1 ---------------------------------------------------------------------------
def test_rank_identity_torchrun_slurm_and_none():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    env["TORCHELASTIC_RUN_ID"] = "x"
    ident = rank_identity(env)
    assert {k: ident[k] for k in ("rank", "world_size", "local_rank", "local_world_size", "node_rank")} == {
        "rank": 5, "world_size": 8, "local_rank": 1, "local_world_size": 4, "node_rank": 1,
    }  # fmt: skip
    assert ident["launcher"] == "torchrun" and ident["host"] == socket.gethostname()
    # SLURM only: read, and exported for init_process_group(); RANK wins when both are set.
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1"}
    env["SLURM_NTASKS_PER_NODE"] = "4(x2)"
    ident = rank_identity(env)
    assert (ident["rank"], ident["world_size"], ident["local_rank"], ident["node_rank"]) == (6, 8, 2, 1)
    assert ident["local_world_size"] == 4 and ident["launcher"] == "slurm"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["GROUP_RANK"]) == ("6", "8", "2", "1")
    assert rank_identity({**env, "RANK": "3"})["rank"] == 3
    ident = rank_identity({})
    assert (ident["rank"], ident["world_size"], ident["launcher"]) == (0, 1, "none")
    with pytest.raises(ValueError, match=r"SLURM_PROCID='x' is not an integer"):
        rank_identity({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"})
    with pytest.raises(ValueError, match=r"rank 4 is outside the world of 4 ranks"):
        rank_identity({"RANK": "4", "WORLD_SIZE": "4"})


def test_collect_rejects_bad_rank_variables(monkeypatch, capsys):
    from dynamo_ext.audit.rank import collect

    monkeypatch.setenv("RANK", "one")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert collect.main(["--out", tempfile.gettempdir(), str(TARGET)]) == 2
    assert capsys.readouterr().err.strip() == (
        "dynamo_ext.audit.collect: error: environment variable RANK='one' is not an integer; the launcher sets it "
        "to this process's place in the job (unset it, or start the job with torchrun or srun)"
    )


def test_rank_ranges():
    assert format_ranks([*range(512), *range(513, 1024)]) == "0\u2013511, 513\u20131023"
    assert format_ranks(range(4), world_size=4) == "all"
    assert format_ranks([3, 4, 7]) == "3, 4, 7"
    assert format_ranks([]) == "-"
    assert group_by([(0, "a"), (2, "b"), (1, "a")]) == [("a", (0, 1)), ("b", (2,))]
    assert format_counts([(0, 1), (1, 1)]) == "1/rank"
    assert format_counts([(0, 1), (1, 3), (2, 1), (3, 1)]) == "1 on 0, 2, 3; 3 on 1"


def test_merge_names_missing_and_cut_short_ranks_by_host(tmp_path, capsys):
    d = tmp_path / "job"
    _bench().write_rank_files(str(d), 6, ranks_per_node=2, outlier=5)
    (d / "rank3.jsonl").unlink()  # never started: its node's host is inferred from rank 2
    lines = (d / "rank4.jsonl").read_text().splitlines(keepends=True)
    (d / "rank4.jsonl").write_text("".join(lines[:3]) + lines[3][:40])  # killed while writing its 4th record
    report = merge_dir(str(d))
    assert report.world_size == 6
    assert [r.status for r in report.ranks] == ["ok", "ok", "ok", "missing", "died", "ok"]
    assert incomplete_ranks(report) == [
        "rank 3 (host node001, node 1): missing: no rank file for rank 3 of 6 (host node001, node 1): the rank "
        "never started or wrote elsewhere",
        "rank 4 (host node002, node 2): died: rank file cut short after 3 record(s) (last: break, then a torn "
        "line): the process was killed before it finished",
    ]
    # What the cut-short rank recorded still counts; the outlier is named by rank and host.
    b = next(b for b in report.graph_breaks if b.line == 100)
    assert b.ranks == (0, 1, 2, 4, 5)
    rows = [line.split() for line in render_text(report, width=200).split("Ranks")[1].splitlines()]
    rows = {r[0]: r[1:] for r in rows if r and r[0][0].isdigit()}
    assert rows["0\u20132"][:5] == ["2", "hosts", "(2", "nodes)", "ok"]  # hosts of a group are counted
    assert rows["5"][:4] == ["node002", "(node", "2)", "ok"]  # the outlier by rank and host
    assert rows["4"][:4] == ["node002", "(node", "2)", "died:"]
    assert cli_main(["audit", "merge", str(d), "--quiet"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "dynamo-ext audit merge: gate: " + line for line in incomplete_ranks(report)
    ]


def test_merge_of_1024_ranks_reads_as_ranges(tmp_path):
    _bench().write_rank_files(str(tmp_path), 1024, ranks_per_node=8, outlier=512)
    report = merge_dir(str(tmp_path))
    assert [r.status for r in report.ranks] == ["ok"] * 1024 and not incomplete_ranks(report)
    rows = [line.split() for line in render_text(report, width=160).split("Ranks")[1].splitlines()]
    rows = [r for r in rows if r and r[0][0].isdigit()]
    assert rows[0][:5] == ["0\u2013511,", "513\u20131023", "128", "hosts", "(128"]
    assert rows[1][:4] == ["512", "node064", "(node", "64)"]
    assert len(rows) == 2
    extra = next(b for b in report.graph_breaks if b.ranks == (512,))
    assert extra.line == 106


def test_merge_bad_input_exits_2(tmp_path, capsys):
    assert merge_main([str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert merge_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no rank files (rank<R>.jsonl" in err and "no TORCH_TRACE logs" in err


def test_signals_stack_then_sigterm_leave_a_complete_rank_file(tmp_path):
    """SIGUSR1: where the main thread is, and the rank goes on; SIGTERM: Terminated and the end line, exit 143."""
    script = tmp_path / "sleeper.py"
    script.write_text('import time\nprint("ready", flush=True)\ntime.sleep(120)  # SLEEPS\n')
    cmd = [PY, "-m", "dynamo_ext.audit.collect", "--no-plugin", "--out", str(tmp_path / "out"), str(script)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        rank_file = tmp_path / "out" / "rank0.jsonl"
        time.sleep(0.5)
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while '"ev": "stack"' not in rank_file.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
    finally:
        proc.kill()
        proc.wait()
    events = [json.loads(line) for line in rank_file.read_text().splitlines()]
    assert [e["ev"] for e in events] == ["start", "stack", "error", "end"]
    # Where the main thread is: in the sleep, or (on a loaded machine) still returning from the print before it.
    file, line, function, _ = events[1]["stack"][events[1]["user_index"]]
    assert (file.endswith("sleeper.py"), line in (2, 3), function) == (True, True, "<module>"), events[1]
    assert events[1]["in_distributed"] is False
    assert (events[2]["type"], events[3]["status"]) == ("Terminated", 143)
    assert merge_dir(str(tmp_path / "out")).ranks[0].status == "stopped"


# ---- tier 2: one batch of real launches --------------------------------------------------
@pytest.fixture(scope="module")
def launches():
    """Every launch of this module, started together; ``{name: (returncode, output, path)}``."""
    tmp = Path(tempfile.mkdtemp(prefix="audit-multinode-"))
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs: dict[str, list[subprocess.Popen[str]]] = {}

    def start(name, cmd, env):
        log = open(tmp / f"{name}-{len(procs.get(name, []))}.log", "w")  # noqa: SIM115
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        procs.setdefault(name, []).append(p)

    # 1. Two nodes of 2 ranks each, c10d rendezvous, as torchrun on two machines would be started.
    port = free_port()
    for node in (0, 1):
        start(
            "two_node",
            [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
             "-m", "dynamo_ext.audit.collect", "--out", str(tmp / "two_node"), REL],
            base,
        )  # fmt: skip
    # 2. The local audit of the same target.
    start("local", [PY, "-m", "dynamo_ext", "audit", "--nproc", "4", "--quiet", "--json", str(tmp / "local.json"),
                    "--html", str(tmp / "local.html"), REL], base)  # fmt: skip
    # 3. srun-style: four plain processes with SLURM variables (two "nodes"), a module:function target that does
    #    not call init_process_group itself, and rank 3 killed (SIGKILL) after its findings.
    port = free_port()
    for rank in range(4):
        env = {k: v for k, v in base.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(
            SLURM_PROCID=str(rank), SLURM_NTASKS="4", SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(rank // 2),
            SLURM_NTASKS_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AUDIT_TARGET_KILL_RANK="3",
        )  # fmt: skip
        start("slurm", [PY, "-m", "dynamo_ext.audit.collect", "--out", str(tmp / "slurm"),
                        "tests.audit_targets.multinode:main_function"], env)  # fmt: skip
    # 4. Stock torch, no audit: 2 ranks with TORCH_TRACE.
    start("trace", [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", REL],
          dict(base, TORCH_TRACE=str(tmp / "trace")))  # fmt: skip
    deadline = time.monotonic() + 540
    out = {}
    try:
        for name, ps in procs.items():
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in ps]
            logs = "".join((tmp / f"{name}-{i}.log").read_text(errors="replace")[-3000:] for i in range(len(ps)))
            out[name] = (codes, logs, tmp / name)
    finally:
        for ps in procs.values():
            for p in ps:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    yield out, tmp


def _findings(data: dict) -> dict:
    """What two runs of the same target must agree on: breaks, graphs and recompiles with their per-rank counts."""
    return {
        "breaks": sorted(
            (b["id"], tuple(map(tuple, b["count_by_rank"])), b["divergent"]) for b in data["graph_breaks"]
        ),
        "graphs": sorted((g["id"], tuple(map(tuple, g["op_count_by_rank"])), g["hang_risk"]) for g in data["graphs"]),
        "recompiles": sorted((r["id"], tuple(map(tuple, r["count_by_rank"]))) for r in data["recompiles"]),
    }


@pytest.mark.gloo
def test_two_node_collect_then_merge_equals_local_audit(launches, capsys):
    out, tmp = launches
    codes, logs, _ = out["two_node"]
    assert codes == [0, 0], logs
    codes, logs, _ = out["local"]
    assert codes == [0], logs
    code = merge_main([str(tmp / "two_node"), "--json", str(tmp / "merged.json"), "--html", str(tmp / "merged.html")])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    merged = json.loads((tmp / "merged.json").read_text())
    local = json.loads((tmp / "local.json").read_text())
    assert _findings(merged) == _findings(local)
    assert merged["target"] == local["target"] == REL
    (b,) = merged["graph_breaks"]
    assert (b["line"], b["ranks"], b["count_by_rank"]) == (
        marker_line("BREAK_PRINT"),
        [0, 1, 2, 3],
        [[r, 2] for r in range(4)],
    )
    assert {g["file"] for g in merged["graphs"]} == {REL}
    # Host and node per rank, from the headers: ranks 0-1 on one node, 2-3 on the other (c10d assigns which).
    nodes = [r["node_rank"] for r in merged["ranks"]]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3] and {r["host"] for r in merged["ranks"]} == {
        socket.gethostname()
    }
    assert [r["local_rank"] for r in merged["ranks"]] == [0, 1, 0, 1]
    # The outlier rank is its own row, the others one range.
    assert "0, 1, 3 " in stdout and "\n  2 " in stdout
    assert f"{socket.gethostname()} (node {nodes[2]})" in stdout
    html = (tmp / "merged.html").read_text()
    assert html.count('<tr class="rank-row">') == 4 and f"<td>{socket.gethostname()} (node {nodes[0]})</td>" in html


@pytest.mark.gloo
def test_slurm_variables_and_a_killed_rank(launches, capsys):
    out, tmp = launches
    codes, logs, d = out["slurm"]
    assert codes[3] == -9, logs  # killed by SIGKILL
    code = merge_main([str(d), "--quiet", "--json", str(tmp / "slurm.json")])
    stderr = capsys.readouterr().err
    assert code == 1, stderr
    data = json.loads((tmp / "slurm.json").read_text())
    ranks = data["ranks"]
    assert [(r["rank"], r["local_rank"], r["node_rank"]) for r in ranks] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    host = socket.gethostname()
    assert ranks[3]["status"] == "died" and ranks[3]["host"] == host
    assert ranks[3]["error"].startswith("rank file cut short after ")
    gate = [line for line in stderr.splitlines() if "rank 3 " in line]
    assert gate == [f"dynamo-ext audit merge: gate: rank 3 (host {host}, node 1): died: {ranks[3]['error']}"]
    # The killed rank's findings were written before it died: the same as the local audit's.
    local = json.loads((tmp / "local.json").read_text())
    assert _findings(data) == _findings(local)


@pytest.mark.gloo
def test_torch_trace_directory_lists_the_audits_breaks(launches, capsys):
    out, tmp = launches
    codes, logs, d = out["trace"]
    assert codes == [0], logs
    code = merge_main([str(d), "--json", str(tmp / "trace.json")])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    data = json.loads((tmp / "trace.json").read_text())
    local = json.loads((tmp / "local.json").read_text())
    where = {(b["file"], b["line"], b["gb_type"]) for b in local["graph_breaks"]}
    assert {(b["file"], b["line"], b["gb_type"]) for b in data["graph_breaks"]} == where
    assert [b["count_by_rank"] for b in data["graph_breaks"]] == [[[0, 2], [1, 2]]]
    # Recompiles and graphs (with their collectives) are in a trace too: those of ranks 0 and 1 of the local run.
    assert {r["id"] for r in data["recompiles"]} == {r["id"] for r in local["recompiles"] if 0 in r["ranks"]}
    graphs = {g["id"]: (g["collectives"], g["op_count"]) for g in local["graphs"] if 0 in g["ranks"]}
    assert {g["id"]: (g["collectives"], g["op_count"]) for g in data["graphs"]} == graphs
    assert [["all_reduce", 1]] in [c for c, _ in graphs.values()]
    assert [r["status"] for r in data["ranks"]] == ["unknown", "unknown"]
    assert any("not in a trace: whether each rank finished" in n for n in data["notes"])
    assert "note: not in a trace" in stdout


def _tlparse() -> str | None:
    import shutil

    here = Path(sys.executable).parent / "tlparse"
    return str(here) if here.exists() else shutil.which("tlparse")


@pytest.mark.gloo
@pytest.mark.skipif(_tlparse() is None, reason="tlparse is not installed (pip install tlparse: the reference reader)")
def test_tlparse_sees_the_same_breaks_in_the_trace(launches, tmp_path):
    """tlparse (PyPI), the reference for what a TORCH_TRACE log holds, finds the breaks our reader finds."""
    out, tmp = launches
    d = out["trace"][2]
    ours = merge_dir(str(d))
    for rank, path in sorted((int(p.name.split("_rank_")[1].split("_")[0]), p) for p in d.iterdir()):
        dest = tmp_path / f"tl{rank}"
        subprocess.run([_tlparse(), str(path), "-o", str(dest), "--no-browser"], check=True, capture_output=True)
        directory = json.loads((dest / "compile_directory.json").read_text())
        theirs = set()
        for entry in directory.values():
            for art in entry["artifacts"]:
                if art["name"].startswith("dynamo_graph_break_reason"):
                    head = (dest / art["url"]).read_text().splitlines()[0]
                    file, _, line = head.removeprefix("Graph break in user code at ").rpartition(":")
                    theirs.add((os.path.relpath(file, REPO), int(line)))
        mine = {(b.file, b.line) for b in ours.graph_breaks for r, n in b.count_by_rank if r == rank}
        assert theirs == mine == {(REL, marker_line("BREAK_PRINT"))}
