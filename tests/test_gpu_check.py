"""``scripts/gpu_check.sh``, the one prepared command for a lent GPU (issue 40), checked on the CPU.

- The dry run end to end (``--dry-run``: versions, the compile plan, pytest's collection of the
  GPU tests with the watchdog plugin, the race test and the sweep on 2 thread-ranks under Triton's
  interpreter, the Llama step eagerly), and the JSON it writes.
- The orchestrator's phase runner: a phase over its limit is killed and keeps what it wrote; a
  failed phase does not stop the next one; unknown phase names are refused.
- The watchdog: a hung pytest test is ended with the ranks' barrier states and rerun without it;
  the barrier state in words; a hang detected by polling events.
- The race test finds a wrong number; the sweep's crossovers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS, BENCHMARKS = ROOT / "scripts", ROOT / "benchmarks"
sys.path[:0] = [str(SCRIPTS), str(BENCHMARKS)]

import _fused_allreduce_sweep as sweep  # noqa: E402
import gpu_check  # noqa: E402
import gpu_check_watchdog as wd  # noqa: E402


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh"), "--dry-run", str(out)],
        env=_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    logs = {p.name: p.read_text()[-3000:] for p in out.glob("*.log")}
    return proc, out, logs


def test_dry_run_exits_0_and_every_phase_ran_its_cpu_variant(dry_run):
    proc, out, logs = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:] + json.dumps(logs)[-6000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["mode"] == "dry-run" and data["finished_utc"]
    assert [p["phase"] for p in data["plan"]] == ["env", "compile", "tests", "race", "bench", "llama"]
    assert {name: r["status"] for name, r in data["phases"].items()} == dict.fromkeys(
        ["env", "compile", "tests", "race", "bench", "llama"], "ok"
    )
    assert data["env"]["torch"] == torch.__version__ and data["env"]["date_utc"].startswith("20")
    assert data["env"]["triton"] and data["env"]["cuda_available"] is False
    files = sorted(p.name for p in out.iterdir())
    assert "summary.txt" in files and len(files) <= 8, files  # the device tool brings back 8 files
    summary = (out / "summary.txt").read_text()
    assert all(f"\n{name} " in summary for name in ("env", "compile", "tests", "race", "bench", "llama")), summary
    assert summary.strip().splitlines()[-1] in proc.stdout


def test_dry_run_collects_exactly_the_gpu_tests_and_plans_the_compiles(dry_run):
    _, out, _ = dry_run
    phases = json.loads((out / "gpu_check.json").read_text())["phases"]
    collected = phases["tests"]["collected"]
    assert "tests/test_kernel_harness.py::test_ranks_as_streams_on_one_gpu_1000_calls[2]" in collected
    assert "tests/test_kernel_one_shot.py::test_compiled_tp_block_uses_the_one_shot_kernel" in collected
    assert not any("test_unknown_algorithm_is_refused" in n for n in collected)  # not gpu-marked
    assert phases["compile"]["dry_run"] and phases["compile"]["planned_tasks"] == len(gpu_check_compile_tasks())


def gpu_check_compile_tasks():
    import gpu_check_compile

    return gpu_check_compile.tasks([2, 4, 8])


def test_dry_run_race_and_sweep_ran_both_kernels_and_dtypes_correctly(dry_run):
    _, out, _ = dry_run
    phases = json.loads((out / "gpu_check.json").read_text())["phases"]
    (race,) = phases["race"]["rows"]
    assert race["world"] == 2 and race["calls"] == 4 and race["ok"] and race["slots_raised"] == 0
    assert race["bfloat16"]["calls"] and race["float32"]["calls"]
    assert race["float32"]["sum_max_ulp"] == 0  # the residual sum is bit-exact in fp32
    bench = phases["bench"]
    rows = bench["rows"]
    assert {(r["dtype"], r["tokens"]) for r in rows} == {(d, t) for d in ("bfloat16", "float32") for t in (1, 4)}
    for r in rows:
        assert all(r[f"{v}_ok"] and r[f"{v}_us"] > 0 for v in sweep.VARIANTS), r
    assert bench["copy_gbs"] > 0 and bench["wrong_rows"] == 0
    assert {(c["dtype"], c["world"], c["hidden"]) for c in bench["crossovers"]} == {
        ("bfloat16", 2, 64),
        ("float32", 2, 64),
    }
    eager = phases["llama"]["ways"]["eager"]
    assert eager["status"] == "ok" and eager["loss_max_abs_diff"] == 0 and len(eager["losses"]) == 2


def test_a_phase_over_its_limit_is_killed_and_keeps_what_it_wrote(tmp_path):
    part, log = tmp_path / "part.json", tmp_path / "log"
    code = f"import json, time; json.dump({{'rows': [1, 2]}}, open({str(part)!r}, 'w')); time.sleep(120)"
    result = gpu_check.run_phase(
        [sys.executable, "-c", code], timeout_s=20, log_path=str(log), part_path=str(part), env=_env()
    )
    assert result["status"] == "timed_out" and result["rows"] == [1, 2] and result["rc"] is None
    assert result["seconds"] < 100  # killed, not waited for


@pytest.mark.parametrize(("exit_code", "status"), [(0, "ok"), (1, "failed"), (wd.HANG_EXIT_CODE, "hang")])
def test_phase_status_follows_the_exit_code(tmp_path, exit_code, status):
    cmd = [sys.executable, "-c", f"raise SystemExit({exit_code})"]
    result = gpu_check.run_phase(
        cmd, timeout_s=60, log_path=str(tmp_path / "log"), part_path="/nonexistent", env=_env()
    )
    assert (result["status"], result["rc"]) == (status, exit_code)


def test_a_failed_phase_does_not_stop_the_next_and_both_are_in_the_json(tmp_path, monkeypatch, capsys):
    def command(phase, *, dry, part, deadline_s, extra):
        if phase == "compile":
            return [sys.executable, "-c", "import sys; print('boom'); sys.exit(1)"]
        return [sys.executable, "-c", f"import json; json.dump({{'rows': ['{phase}']}}, open({part!r}, 'w'))"]

    monkeypatch.setattr(gpu_check, "command", command)
    rc = gpu_check.main(["--dry-run", "--only", "compile,race", str(tmp_path)])
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 1
    assert data["phases"]["compile"]["status"] == "failed" and "boom" in (tmp_path / "compile.log").read_text()
    assert data["phases"]["race"] == {**data["phases"]["race"], "status": "ok", "rows": ["race"]}
    assert [p["phase"] for p in data["plan"] if not p["run"]] == ["env", "tests", "bench", "llama"]
    assert "race     ok" in capsys.readouterr().out


def test_unknown_phase_names_are_refused_with_the_valid_ones(tmp_path):
    with pytest.raises(SystemExit, match=r"unknown phase\(s\) \['benchmark'\]: the phases are \['env', 'compile'"):
        gpu_check.main(["--dry-run", "--skip", "benchmark", str(tmp_path)])


def _ranks_with_a_raised_slot():
    from dynamo_ext.inductor_lowerings.kernels import harness

    ranks = harness.InProcessRanks(3, 64, torch.device("cpu"), max_blocks=2)
    ranks.peers[0].keepalive[1][2][1 * 3 + 0] = 1  # rank 2's pad: program 1 of rank 0 signalled, not taken
    return ranks


def test_barrier_state_names_the_rank_the_program_and_the_waiting_peer():
    ranks = _ranks_with_a_raised_slot()
    state = wd.barrier_state(ranks.peers[0])
    assert [r["waiting"] for r in state["ranks"]] == [[], [], [[1, 0]]]
    text = wd.format_barrier_state(state, "race W=3")
    assert text.splitlines()[0] == "race W=3: 3 ranks, 2 programs each"
    assert "rank 0: pad clear" in text and "rank 2: signals not yet taken: program 1 <- rank 0" in text


def test_polling_a_call_that_never_ends_fires_the_watchdog_with_the_ranks_state():
    class NeverDone:
        def query(self):
            return False

    ranks = _ranks_with_a_raised_slot()
    watchdog = wd.Watchdog(3600, name="race", exit=False)
    watchdog.watch(ranks, "race W=3")
    watchdog.describe_with(lambda: "rank 2: in call 7")
    with pytest.raises(TimeoutError, match="1 of 2 events not done"):
        wd.wait_events([NeverDone(), type("Done", (), {"query": lambda self: True})()], timeout_s=0.05,
                       watchdog=watchdog, what="race W=3 calls 0..7")  # fmt: skip
    assert watchdog.fired.startswith("WATCHDOG [race]: race W=3 calls 0..7: 1 of 2 events not done")
    assert "rank 2: in call 7" in watchdog.fired and "program 1 <- rank 0" in watchdog.fired


def test_a_hung_gpu_test_is_ended_reported_and_the_rest_rerun(tmp_path, monkeypatch):
    (tmp_path / "test_fake_gpu.py").write_text(
        textwrap.dedent(
            """
            import time, pytest, torch
            from dynamo_ext.inductor_lowerings.kernels import harness

            def test_passes():
                pass

            def test_hangs():
                ranks = harness.InProcessRanks(2, 64, torch.device("cpu"), max_blocks=1)
                ranks.peers[0].keepalive[1][1][0] = 1
                time.sleep(120)

            def test_fails():
                assert 1 == 2
            """
        )
    )

    def command(phase, *, dry, part, deadline_s, extra):
        return [sys.executable, "-m", "pytest", "-p", "gpu_check_pytest", "-q", "-p", "no:cacheprovider",
                "--rootdir", str(tmp_path), *extra, str(tmp_path / "test_fake_gpu.py")]  # fmt: skip

    monkeypatch.setattr(gpu_check, "command", command)
    env = _env(GPU_CHECK_TEST_TIMEOUT_S="5")
    report = gpu_check.Report(str(tmp_path), {"phases": {}})
    log = tmp_path / "tests.log"
    result = gpu_check._run_with_reruns("tests", False, str(tmp_path / "part.json"), str(log), 300, env, report)
    hung = "test_fake_gpu.py::test_hangs"
    assert result["status"] == "hang" and [h.split("/")[-1] for h in result["hung"]] == [hung]
    outcomes = {k.split("/")[-1]: v for k, v in result["tests"].items()}
    assert outcomes == {
        "test_fake_gpu.py::test_passes": "passed",
        hung: "hang",
        "test_fake_gpu.py::test_fails": "failed",
    }
    assert "no progress for" in result["watchdog"] and "program 0 <- rank 0" in result["watchdog"]


def test_the_race_test_reports_a_wrong_number(tmp_path):
    out = tmp_path / "race.json"
    code = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(SCRIPTS)!r}, {str(BENCHMARKS)!r}]
        import _fused_ranks, gpu_check_race
        real = _fused_ranks.launch_rank

        def off_by_a_bit(ranks, algorithm, rank, *args, **kwargs):
            s, y, rstd = real(ranks, algorithm, rank, *args, **kwargs)
            if rank == 1:
                y[0, 0] = y[0, 0] * 1.5 + 1
            return s, y, rstd

        _fused_ranks.launch_rank = off_by_a_bit
        sys.exit(gpu_check_race.main(["--dry-run", "--json", {str(out)!r}]))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert not row["ok"] and row["bad_calls"] == row["calls"] == 4 and row["first_bad"]["call"] == 0


def test_crossovers_are_where_fused_stops_being_faster_and_two_shot_overtakes():
    def row(tokens, one, two, unfused):
        return {"dtype": "bfloat16", "world": 4, "hidden": 4096, "tokens": tokens, "input_bytes": tokens * 8192,
                "one_shot_us": one, "two_shot_us": two, "unfused_us": unfused}  # fmt: skip

    rows = [row(1, 5, 9, 10), row(2, 6, 9, 10), row(4, 12, 11, 10), row(8, 15, 9, 16), row(16, 40, 30, 25)]
    (c,) = sweep.crossovers(rows)
    assert (c["one_shot_faster_up_to_tokens"], c["one_shot_stops_being_faster_at_tokens"]) == (2, 4)
    assert c["one_shot_faster_up_to_bytes"] == 2 * 8192 and c["one_shot_faster_at_tokens"] == [1, 2, 8]
    assert (c["two_shot_faster_up_to_tokens"], c["two_shot_stops_being_faster_at_tokens"]) == (2, 4)
    assert (c["fused_faster_up_to_tokens"], c["fused_stops_being_faster_at_tokens"]) == (2, 4)
    assert c["two_shot_beats_one_shot_from_tokens"] == 4 and c["two_shot_beats_one_shot_from_bytes"] == 4 * 8192
    (never,) = sweep.crossovers([row(1, 11, 12, 10), row(2, 5, 4, 10)])
    assert never["one_shot_faster_up_to_tokens"] is None and never["one_shot_stops_being_faster_at_tokens"] == 1
    wrong = {**row(1, 5, 9, 10), "one_shot_ok": False, "unfused_ok": False}  # a wrong kernel is never "faster"
    (c,) = sweep.crossovers([wrong, {**row(2, 6, 9, 10), "two_shot_us": None}])
    assert c["one_shot_faster_at_tokens"] == [2] and c["two_shot_faster_at_tokens"] == [1]
