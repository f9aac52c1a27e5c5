"""Run a target on N local ranks with torch's own launcher and merge what they saw.

The local audit is launch + collect + merge, the same path as a multi-node
job: the ranks are started by ``python -m torch.distributed.run --standalone``
(torchrun: the elastic agent, c10d rendezvous on a free port), in its own
session so a timeout can end the whole tree.  Each rank runs
:mod:`.rank.collect`; its stdout/stderr go to per-rank log files (torchrun's
``--log-dir --redirects 3``) and its events to ``rank<R>.jsonl``, which this
module tails while the ranks run (progress) and then merges with
:func:`.rank_files.merge_dir`, adding what only the launcher knows (timeouts,
exit codes, ranks it stopped).

NOTE [no stray processes]
On a timeout the launcher's process group gets SIGTERM (torchrun forwards it
to the ranks), then SIGKILL after a grace period; every rank wrote its pid in
its first event, and any rank still alive after that is killed by pid (only
if its command line is still ours).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import hang
from .merge.merger import Merger
from .merge.rank_files import merge_dir
from .model.kinds import RankStatus
from .model.records import AuditReport
from .schema.events import EventKind

GRACE_S = 10.0
_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


@dataclasses.dataclass
class RankProgress:
    """What the progress line shows for one rank."""

    started: bool = False
    graphs: int = 0
    breaks: int = 0
    recompiles: int = 0
    done: bool = False
    failed: bool = False
    pid: int = 0
    last: str = "nothing"
    error: dict[str, Any] | None = None
    stack: dict[str, Any] | None = None


class _Tail:
    """Reads the complete lines appended to a file since the last call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pos = 0
        self.buf = ""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.pos)
                chunk = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return []
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out


def _alive_and_ours(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dynamo_ext.audit.collect" in f.read()
    except OSError:
        return False


def _kill_tree(proc: subprocess.Popen[bytes], pids: list[int]) -> None:
    """SIGTERM the launcher's group, then SIGKILL it and any rank still alive (NOTE [no stray processes])."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5.0)):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        break
    _reap(pids)


def _reap(pids: list[int]) -> None:
    deadline = time.monotonic() + 5.0
    for pid in pids:
        if _alive_and_ours(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
    while any(_alive_and_ours(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


# NOTE [hung rank]
# On a timeout, before the ranks are stopped, each unfinished rank gets
# SIGUSR1: its collect watcher thread records where the main thread is (a
# ``stack`` event, taken with ``sys._current_frames`` so it works while the
# rank is blocked inside a collective).  A rank whose stack is not inside
# torch.distributed is the hung one (user code that never reaches the next
# collective); ranks inside torch.distributed wait for it.  When every rank
# waits in torch.distributed, they wait on collectives that do not match.
# :mod:`.hang` puts it in words and records: a rank in a compiled collective,
# or in the collective check's wait before one, is placed at that collective
# with the ranks it waits for (NOTE [the collective a rank waits in]).
ASK_WHERE_S = 5.0


def _ask_where(progress: dict[int, RankProgress], poll: Callable[[], None]) -> None:
    """SIGUSR1 to every started, unfinished rank; wait until each recorded its stack (NOTE [hung rank])."""
    asked = [p for p in progress.values() if p.pid and not p.done and _alive_and_ours(p.pid)]
    for p in asked:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + ASK_WHERE_S
    while any(p.stack is None for p in asked) and time.monotonic() < deadline:
        time.sleep(0.1)
        poll()


def _rank_logs(log_dir: str, rank: int) -> str:
    hits = sorted(glob.glob(os.path.join(log_dir, "*", "attempt_0", str(rank), "stderr.log")))
    return hits[-1] if hits else ""


def run_ranks(
    target: str,
    target_args: list[str] | tuple[str, ...] = (),
    *,
    nproc: int = 2,
    backend: str | None = None,
    plugin: bool = True,
    timeout: float = 300.0,
    on_progress: Callable[[dict[int, RankProgress]], None] | None = None,
    keep_logs: bool = False,
    check_numerics: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    steps: int | None = None,
) -> AuditReport:
    """Run ``target`` on ``nproc`` ranks and return the merged report (partial when something failed).

    Never raises for a failure of the target: the report's ``errors`` and rank
    statuses say what happened.  ``check_numerics``: each rank then runs the
    target's ``make_step()`` compiled and eagerly and compares (``rtol``/``atol``,
    see :mod:`.rank.numerics`); the result is ``report.numerics``.  ``steps``: the
    training steps of a target function that returns a step (NOTE [the audit
    drives the step] in :mod:`.rank.steps`; default 3).
    """
    work = tempfile.mkdtemp(prefix="dynamo-ext-audit-")
    logs = os.path.join(work, "logs")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "--max-restarts=0", "--monitor-interval=0.1", f"--log-dir={logs}", "--redirects=3",
        "-m", "dynamo_ext.audit.collect", "--out", work, "--plugin" if plugin else "--no-plugin",
        *(["--check-numerics"] if check_numerics else []),
        *([f"--rtol={rtol}", f"--atol={atol}"] if rtol is not None and atol is not None else []),
        *([f"--steps={steps}"] if steps is not None else []),
        target, "--", *target_args,
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    if backend:
        # Dynamo's own per-graph backend override (torch/_dynamo/config.py: debug_backend_override).
        env["TORCH_COMPILE_OVERRIDE_BACKENDS"] = f">=0:{backend}"
    launcher_log = os.path.join(work, "launcher.log")
    tails = {r: _Tail(os.path.join(work, f"rank{r}.jsonl")) for r in range(nproc)}
    progress = {r: RankProgress() for r in range(nproc)}
    pids: list[int] = []

    def poll() -> None:
        # Progress only: the report is merged from the files afterwards.
        for r, tail in tails.items():
            for e in tail.read():
                p = progress[r]
                ev = e.get("ev")
                p.last = str(ev)
                if ev == EventKind.START:
                    p.started = True
                    p.pid = int(e["pid"])
                    pids.append(p.pid)
                elif ev == EventKind.BREAK:
                    p.breaks += 1
                elif ev == EventKind.COMPILE:
                    p.graphs += bool(e.get("has_graph"))
                    p.recompiles += bool(e.get("recompile_reason"))
                elif ev == EventKind.ERROR:
                    p.failed = True
                    p.error = p.error or e
                elif ev == EventKind.END:
                    p.done = True
                elif ev == EventKind.STACK:
                    p.stack = e
        if on_progress is not None:
            on_progress(progress)

    timed_out = False
    interrupted = False
    with open(launcher_log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                poll()
                if time.monotonic() > deadline:
                    timed_out = True
                    _ask_where(progress, poll)
                    _kill_tree(proc, pids)
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:
            interrupted = True
            _kill_tree(proc, pids)
        poll()
        _reap(pids)

    with open(launcher_log, encoding="utf-8", errors="replace") as f:
        launcher_text = f.read()
    exit_codes = {int(r): int(c) for r, c in _FAILURE.findall(launcher_text)}
    root = _FAILURE.findall(launcher_text.partition("Root Cause")[2])
    statuses: dict[int, dict[str, Any]] = {}
    stacks = {r: p.stack for r, p in progress.items()}  # NOTE [hung rank]
    for r in range(nproc):
        p = progress[r]
        err = p.error
        # SIGTERM (the launcher stopping the job) unwinds a rank into an "error" and an end line; it did not finish.
        terminated = err is not None and err.get("type") == "Terminated"
        log = _rank_logs(logs, r)
        code = exit_codes.get(r)
        if err is not None and not terminated:
            statuses[r] = {
                "status": RankStatus.ERROR,
                "error": err["message"],
                "log": log,
                "time": err.get("time", 0.0),
            }
        elif p.done and not terminated:
            statuses[r] = {"status": RankStatus.OK, "log": log}
        elif timed_out:
            statuses[r] = {
                "status": RankStatus.TIMEOUT,
                "error": f"still running after {timeout:g} s, {hang.where(r, stacks, last=p.last)}",
                "log": log,
                "waiting": hang.rank_waits(r, stacks),
            }
        elif (terminated or code == -int(signal.SIGTERM)) and (exit_codes.keys() - {r}):
            # SIGKILL without the Terminated record is not the launcher's doing (it sends SIGTERM first): died.
            statuses[r] = {
                "status": RankStatus.STOPPED,
                "error": "stopped by the launcher after another rank failed",
                "log": log,
            }
        else:
            why = "no exit status" if code is None else f"exit code {code}" + (f" (signal {-code})" if code < 0 else "")
            statuses[r] = {"status": RankStatus.DIED, "error": f"rank {r} ended without finishing ({why})", "log": log}
    # The root cause first: a rank that died (killed, or exited without a word: its peers' collectives then fail,
    # so their errors are consequences), then torchrun's "first observed failure", else the earliest error.
    failed = sorted(
        (r for r, s in statuses.items() if s["status"] in (RankStatus.ERROR, RankStatus.DIED)),
        key=lambda r: statuses[r].get("time", 0.0),
    )
    if root and int(root[0][0]) in failed:
        failed.remove(int(root[0][0]))
        failed.insert(0, int(root[0][0]))
    failed.sort(key=lambda r: statuses[r]["status"] != RankStatus.DIED)
    errors: list[str] = []
    if timed_out:
        still = [r for r, s in statuses.items() if s["status"] == RankStatus.TIMEOUT]
        errors.append(hang.timeout_line(stacks, still, timeout, last={r: p.last for r, p in progress.items()}))
    if interrupted:
        errors.append("interrupted; ranks killed")
    for r in failed:
        s = statuses[r]
        errors.append(f"rank {r} raised {s['error']}" if s["status"] == RankStatus.ERROR else s["error"])
    for s in statuses.values():
        s.pop("time", None)
    if not any(p.started for p in progress.values()):
        tail = [ln for ln in launcher_text.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        errors.append(f"no rank started; launcher said: {tail[0]}")
    plugin_errors = {
        p.error["message"] for p in progress.values() if p.error and "dynamo_ext.install() failed" in p.error["message"]
    }
    errors = [e for e in errors if not any(pe in e for pe in plugin_errors)] + sorted(plugin_errors)

    if errors and not keep_logs:
        keep_logs = True  # the rank logs are what a person reads next
    if any(os.path.exists(os.path.join(work, f"rank{r}.jsonl")) for r in range(nproc)):
        report = merge_dir(work, world_size=nproc, statuses=statuses, errors=tuple(errors), backend=backend or "")
        report = dataclasses.replace(report, target=target)
    else:
        report = Merger().report(
            target=target, world_size=nproc, backend=backend or "", statuses=statuses, errors=tuple(errors)
        )
    if not keep_logs:
        shutil.rmtree(work, ignore_errors=True)
        report = dataclasses.replace(report, ranks=tuple(dataclasses.replace(r, log="") for r in report.ranks))
    return report
