"""The one prepared command for a lent GPU (issue 40); run it through ``scripts/gpu_check.sh``.

    bash scripts/gpu_check.sh [OUTDIR]                      # on the GPU: every phase, about 8 minutes at most
    bash scripts/gpu_check.sh --dry-run [OUTDIR]            # on a CPU: collect, import, plan, tiny CPU variants
    bash scripts/gpu_check.sh --skip llama,bench [OUTDIR]   # leave phases out (--only race,tests: just those)

Phases, in order, each a subprocess with a hard time limit (its budget plus what earlier
phases left unused, never eating the budgets of the phases after it), killed with its
process group when over:

- ``env``: device, driver, CUDA, torch, Triton, NCCL, Python, the date;
- ``compile``: the fused kernels' Triton variants compiled ahead in parallel processes
  (NOTE [fused kernels compiled ahead] in ``gpu_check_compile.py``);
- ``tests``: the GPU-gated tests (``gpu`` marker) natively, with a per-test watchdog that
  ends a stuck kernel and prints each simulated rank's barrier state (``gpu_check_pytest.py``);
  a hung test is deselected and the rest rerun while time is left;
- ``race``: back-to-back fused calls with random sizes on W = 2, 4, 8 stream-ranks against
  the fp32 reference (``gpu_check_race.py``);
- ``bench``: ``benchmarks/bench_fused_allreduce_gpu.py --sweep-only``: fused one-shot and
  two-shot against the unfused sequence, the crossovers;
- ``llama``: ``benchmarks/bench_llama_step_gpu.py``: the bundled Llama's training step,
  stock per-block against the plugin's whole model, against eager.

Every phase writes its figures to a JSON part file as it goes; the part is merged into
``OUTDIR/gpu_check.json`` every two seconds and when the phase ends, so a phase that fails,
hangs or runs out of time keeps what it measured and the others still run.  Also in
OUTDIR: ``summary.txt`` (what this prints at the end) and one ``<phase>.log`` each (at most
8 files, the device tool's limit).  OUTDIR: the argument, else ``$OUT``, else a new
directory under /tmp.  ``--dry-run`` runs each phase's CPU variant (Triton's interpreter,
pytest's collection, the plan) and exits 0 when all of them worked.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path[:0] = [os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks")]

from gpu_check_watchdog import DEADLINE_ENV, DEADLINE_EXIT_CODE, HANG_EXIT_CODE  # noqa: E402

TOTAL_BUDGET_S = 470
DRY_RUN_SCALE = 5
"""--dry-run's budgets are this many times the GPU's: a shared CPU machine, and limits there only stop a hang."""
GRACE_S = 12
"""A phase's own deadline is this much before its hard limit, so it can stop and write its results."""


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    budget_s: float
    what: str


PHASES = (
    Phase("env", 25, "device, driver, CUDA, torch, Triton, NCCL versions"),
    Phase("compile", 50, "fused kernels' Triton variants compiled ahead, in parallel"),
    Phase("tests", 100, "GPU-gated tests (gpu marker), per-test watchdog"),
    Phase("race", 50, "random-size back-to-back fused calls on W = 2, 4, 8 stream-ranks"),
    Phase("bench", 135, "fused one-/two-shot vs unfused sweep, crossovers"),
    Phase("llama", 100, "bundled Llama step: stock per-block vs plugin whole model, vs eager"),
)


def gpu_test_files() -> list[str]:
    """Test files with a ``gpu`` mark (``@pytest.mark.gpu``), relative to the repository."""
    tests = os.path.join(ROOT, "tests")
    found = []
    for name in sorted(os.listdir(tests)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(tests, name)) as f:
                if "mark.gpu" in f.read():
                    found.append(f"tests/{name}")
    return found


def command(phase: str, *, dry: bool, part: str, deadline_s: float, extra: list[str]) -> list[str]:
    """The subprocess of ``phase`` (``extra``: pytest's ``--deselect`` arguments for a rerun)."""
    py = sys.executable
    soft = ["--deadline-s", f"{max(deadline_s, 5):.0f}"]
    if phase == "env":
        return [py, os.path.join(ROOT, "scripts", "gpu_check.py"), "--probe-env", part]
    if phase == "compile":
        return [py, "scripts/gpu_check_compile.py", "--json", part] + (["--dry-run"] if dry else [])
    if phase == "tests":
        run = ["--collect-only"] if dry else ["-rA"]
        return [py, "-m", "pytest", "-p", "gpu_check_pytest", "-m", "gpu", "-q", *run, *extra, *gpu_test_files()]
    if phase == "race":
        return [py, "scripts/gpu_check_race.py", "--json", part, *soft] + (["--dry-run"] if dry else ["--hang-s", "20"])
    if phase == "bench":
        cmd = [py, "benchmarks/bench_fused_allreduce_gpu.py", "--sweep-only", "--json", part, *soft]
        return cmd + (["--interpret-smoke", "--world", "2"] if dry else ["--watchdog-s", "60"])
    if phase == "llama":
        return [py, "benchmarks/bench_llama_step_gpu.py", "--json", part, *soft] + (["--dry-run"] if dry else [])
    raise ValueError(f"unknown phase {phase!r}: expected one of {[p.name for p in PHASES]}")


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def run_phase(
    cmd: list[str], *, timeout_s: float, log_path: str, part_path: str, env: dict[str, str], on_poll: Any = None
) -> dict[str, Any]:
    """Run ``cmd`` in its own process group, output to ``log_path``; kill the group after ``timeout_s``.

    Returns ``{"status", "rc", "seconds", **the part file}``; status ``ok`` (exit 0),
    ``failed``, ``hang`` (the watchdog ended it: exit 3) or ``timed_out`` (killed here, or its
    watchdog ended it at the deadline: exit 4).  ``on_poll(part)``
    runs every two seconds with what the phase has written so far.
    """
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        rc: int | None = None
        while True:
            try:
                rc = proc.wait(timeout=2)
                break
            except subprocess.TimeoutExpired:
                if on_poll is not None:
                    on_poll(_read(part_path))
                if time.monotonic() - t0 > timeout_s:
                    _kill_group(proc)
                    break
    seconds = round(time.monotonic() - t0, 1)
    if rc is None:
        status = "timed_out"
    elif rc == 0:
        status = "ok"
    elif rc == HANG_EXIT_CODE:
        status = "hang"
    elif rc == DEADLINE_EXIT_CODE:
        status = "timed_out"
    else:
        status = "failed"
    return {**_read(part_path), "status": status, "rc": rc, "seconds": seconds, "limit_s": round(timeout_s)}


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def probe_env(path: str) -> int:
    """The ``env`` phase: what ran where, written to ``path``."""
    import platform

    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    info["date_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info["cpus"] = os.cpu_count()
    import torch

    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:  # reported: the kernels' phases will fail on their own
        info["triton"] = f"not importable: {e!r}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            devices=torch.cuda.device_count(),
        )
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # not every build has NCCL
            info["nccl"] = f"unknown: {e!r}"
    try:
        query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=15)  # fmt: skip
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        info["driver"] = smi.stdout.split(",")[1].strip() if smi.returncode == 0 and "," in smi.stdout else None
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"], info["driver"] = f"not available: {e}", None
    try:
        from dynamo_ext import _compat

        info["symm_mem_route"] = _compat.symm_mem_route()
    except Exception as e:  # reported: the phases that import the package will say more
        info["symm_mem_route"] = f"dynamo_ext not importable: {e!r}"
    info["commit"] = os.environ.get("GPU_CHECK_COMMIT", "unknown")  # the lent machine gets files, not .git
    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=15)
        if git.returncode == 0:
            info["commit"] = git.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info, indent=1))
    return 0


def plan(args: argparse.Namespace, scale: float = 1) -> list[dict[str, Any]]:
    """Which phases run, with which budget (times ``scale``), and why the others do not."""
    only = set(filter(None, args.only.split(","))) if args.only else None
    skip = set(filter(None, args.skip.split(",")))
    names = {p.name for p in PHASES}
    unknown = ((only or set()) | skip) - names
    if unknown:
        raise SystemExit(f"gpu_check: unknown phase(s) {sorted(unknown)}: the phases are {[p.name for p in PHASES]}")
    out = []
    for p in PHASES:
        why = None
        if p.name in skip or (only is not None and p.name not in only):
            why = "skipped (--skip / --only)"
        budget = p.budget_s * scale
        out.append({"phase": p.name, "what": p.what, "budget_s": budget, "run": why is None, "why_not": why})
    return out


class Report:
    """``gpu_check.json`` and ``summary.txt`` in the output directory, rewritten at every change."""

    def __init__(self, out_dir: str, data: dict[str, Any]) -> None:
        self.out_dir, self.data = out_dir, data

    def phase(self, name: str, result: dict[str, Any]) -> None:
        self.data["phases"][name] = result
        self.write()

    def write(self) -> None:
        path = os.path.join(self.out_dir, "gpu_check.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(f"{path}.tmp", path)


def summary(data: dict[str, Any]) -> list[str]:
    """The figures in a few lines per phase (also the end of ``summary.txt``)."""
    import _fused_allreduce_sweep as sweep
    import bench_llama_step_gpu as llama

    env = data.get("env", {})
    lines = [
        f"gpu_check {data['mode']} {data['started_utc']}; {env.get('device', 'no CUDA device')}; driver "
        f"{env.get('driver')}; torch {env.get('torch')} (CUDA {env.get('torch_cuda')}); triton {env.get('triton')}; "
        f"nccl {env.get('nccl')}; python {env.get('python')}; commit {env.get('commit')}",
        f"{'phase':8s} {'status':10s} {'seconds':>8s} {'limit':>6s}  notes",
    ]
    for p in data["plan"]:
        r = data["phases"].get(p["phase"], {})
        status = r.get("status", p["why_not"] or "not run")
        lines.append(
            f"{p['phase']:8s} {status:10s} {r.get('seconds', 0):8.1f} {r.get('limit_s', 0):6}  {_notes(p['phase'], r)}"
        )
    for name in ("tests", "race", "bench"):
        report = data["phases"].get(name, {}).get("watchdog")
        if report:
            lines += [f"-- {name} watchdog report:", *report.splitlines()]
    bench = data["phases"].get("bench", {})
    ways = data["phases"].get("llama", {}).get("ways")
    try:
        if bench.get("crossovers"):
            lines += ["-- crossovers (tokens; fused faster than unfused up to, at every size measured)"]
            lines += sweep.format_crossovers(bench["crossovers"])
        if ways:
            lines += ["-- bundled Llama, one GPU", llama.format_table(ways)]
    except Exception as e:  # the lines so far are still written
        lines.append(f"(tables cut short: {type(e).__name__}: {e})")
    return lines


def _notes(name: str, r: dict[str, Any]) -> str:
    """A phase's figures in one line; never raises (a part cut short by a kill may lack any field)."""
    try:
        return _notes_of(name, r)
    except Exception as e:  # the summary must be written whatever a phase left behind
        return f"(no notes: {type(e).__name__}: {e})"


def _notes_of(name: str, r: dict[str, Any]) -> str:
    if name == "env":
        return f"sms {r.get('sms')}, {r.get('memory_gib')} GiB, symmetric memory: {r.get('symm_mem_route')}"
    if name == "compile":
        done = r.get("done", [])
        failed = sum("error" in d for d in done)
        return f"{sum(d.get('variants', 0) for d in done)} variants in {len(done)}/{r.get('planned_tasks')} tasks, {failed} failed"
    if name == "tests":
        outcomes = list(r.get("tests", {}).values())
        counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
        hung = r.get("hung", [])
        collected = len(r.get("collected", []))
        return f"{collected} collected; {counts or 'no outcomes'}" + (f"; hung: {hung}" if hung else "")
    if name == "race":
        rows = r.get("rows", [])
        cells = [f"W={x['world']}: {x['error']}" if "error" in x else
                 f"W={x['world']}: {x['calls']} calls {'ok' if x['ok'] else 'WRONG'} ({x['bad_calls']} bad, "
                 f"slots {x['slots_raised']})" for x in rows]  # fmt: skip
        return "; ".join(cells) or "no rows"
    if name == "bench":
        rows = r.get("rows", [])
        return f"{len(rows)} sizes; copy {r.get('copy_gbs')} GB/s; wrong rows {r.get('wrong_rows')}" + (
            f"; {r['stopped_early']}" if r.get("stopped_early") else ""
        )
    if name == "llama":
        return ", ".join(f"{w}: {v.get('status')}" for w, v in r.get("ways", {}).items())
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", help="where the JSON, summary and logs go (default: $OUT, else /tmp)")
    parser.add_argument("--dry-run", action="store_true", help="CPU: collect, import, plan, run the tiny variants")
    parser.add_argument("--skip", default="", help="comma-separated phases to leave out")
    parser.add_argument("--only", default="", help="comma-separated phases to run (the others are skipped)")
    parser.add_argument("--budget-s", type=float, help=f"wall-clock budget of all phases (default {TOTAL_BUDGET_S})")
    parser.add_argument("--probe-env", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_env:
        return probe_env(args.probe_env)
    t_start = time.monotonic()
    scale = DRY_RUN_SCALE if args.dry_run else 1
    if args.budget_s is None:
        args.budget_s = TOTAL_BUDGET_S * scale
    out_dir = args.out_dir or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check-")
    os.makedirs(out_dir, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    data: dict[str, Any] = {
        "tool": "scripts/gpu_check.sh",
        "schema": 1,
        "mode": "dry-run" if args.dry_run else "gpu",
        "started_utc": started,
        "finished_utc": None,
        "argv": sys.argv[1:] if argv is None else argv,
        "out_dir": out_dir,
        "budget_s": args.budget_s,
        "plan": plan(args, scale),
        "env": {},
        "phases": {},
    }
    report = Report(out_dir, data)
    report.write()
    print(f"gpu_check: {data['mode']}, output in {out_dir}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    env.setdefault("GPU_CHECK_TEST_TIMEOUT_S", "90")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "scripts"), env.get("PYTHONPATH", "")])
    parts = tempfile.mkdtemp(prefix="gpu_check-parts-")
    runs = [p for p in data["plan"] if p["run"]]
    for i, p in enumerate(runs):
        name = p["phase"]
        left = args.budget_s - (time.monotonic() - t_start)
        reserved = sum(q["budget_s"] for q in runs[i + 1 :])
        limit = min(left, max(p["budget_s"], left - reserved))
        if limit < 5:
            report.phase(name, {"status": "not run: no time left", "seconds": 0})
            continue
        if name != "env" and not args.dry_run and data["env"].get("cuda_available") is False:
            p["run"], p["why_not"] = False, "skipped: no CUDA device (use --dry-run on a CPU)"
            report.phase(name, {"status": "skipped", "seconds": 0})
            continue
        part = os.path.join(parts, f"{name}.json")
        log = os.path.join(out_dir, f"{name}.log")
        open(log, "w").close()
        result = _run_with_reruns(name, args.dry_run, part, log, limit, env, report)
        if name == "env":
            data["env"] = {k: v for k, v in result.items() if k not in ("status", "rc", "seconds", "limit_s")}
        report.phase(name, result)
        print(f"gpu_check: {name}: {result['status']} in {result['seconds']} s (limit {limit:.0f} s); log {log}",
              flush=True)  # fmt: skip
    data["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    data["wall_s"] = round(time.monotonic() - t_start, 1)
    data["summary"] = summary(data)
    report.write()
    text = "\n".join(data["summary"])
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    statuses = [data["phases"].get(p["phase"], {}).get("status") for p in runs]
    return 0 if all(s == "ok" for s in statuses) else 1


def _run_with_reruns(
    name: str, dry: bool, part: str, log: str, limit: float, env: dict[str, str], report: Report
) -> dict[str, Any]:
    """One phase; for ``tests``, a test the watchdog ended is deselected and the rest rerun while time is left."""
    t0 = time.monotonic()
    hung: list[str] = []
    merged: dict[str, Any] = {}
    while True:
        left = limit - (time.monotonic() - t0)
        extra = [arg for nodeid in hung for arg in ("--deselect", nodeid)]
        cmd = command(name, dry=dry, part=part, deadline_s=left - GRACE_S, extra=extra)
        if os.path.exists(part):
            os.remove(part)

        def poll(partial: dict[str, Any], before: dict[str, Any] = merged) -> None:
            report.phase(name, {**before, **partial, "status": "running"})

        # GPU_CHECK_PART: where gpu_check_pytest writes the outcomes; the deadline: a few seconds before the kill
        phase_env = {**env, "GPU_CHECK_PART": part, DEADLINE_ENV: f"{time.time() + left - 5:.1f}"}
        result = run_phase(cmd, timeout_s=left, log_path=log, part_path=part, env=phase_env, on_poll=poll)
        if name != "tests":
            return result
        tests = {**merged.get("tests", {}), **result.get("tests", {})}
        reports = [r for r in (merged.get("watchdog"), result.get("watchdog")) if r]
        merged = {**merged, **result, "tests": tests, "hung": hung}
        if reports:  # every hang's report, the first run's included
            merged["watchdog"] = "\n".join(reports)
        nodeid = result.get("hung_test")
        rerun = result["status"] == "hang" and nodeid and nodeid not in hung
        if rerun:
            hung.append(nodeid)
            tests[nodeid] = "hang"
        if not rerun or limit - (time.monotonic() - t0) < 30:
            merged["seconds"] = round(time.monotonic() - t0, 1)
            if hung:  # the reruns' own status hides that a test hung
                merged["status"] = "hang"
            return merged


if __name__ == "__main__":
    raise SystemExit(main())
