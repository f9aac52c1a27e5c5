"""Faults on real gloo ranks: a rank killed, or hung, inside a compiled step.

The surviving rank must end with an error of its own, within the collective
timeout (a small one here), and the test itself must not hang.  Each scenario
runs two spawned ranks; both scenarios run at the same time.  Rank 1 dies
(``os._exit``) or stalls (a sleep far past the timeout) in the middle of the
compiled step, between the step's two collectives; rank 0 goes on into the
second collective.  The processes are ours (spawned here) and are killed by
their own handles at the end.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

TIMEOUT_S = 4  # the process group's collective timeout
SCENARIOS = ("killed", "hung")


@torch._dynamo.disable
def _fault(rank: int, scenario: str) -> None:
    """Runs eagerly in the middle of the compiled step (a graph break): rank 1 dies or stalls there."""
    if rank != 1:
        return
    if scenario == "killed":
        os._exit(17)
    time.sleep(20 * TIMEOUT_S)


def _rank_main(rank: int, port: int, scenario: str, queue: Any) -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    import dynamo_ext

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    dynamo_ext.install()
    mesh = init_device_mesh("cpu", (2,))

    @torch.compile(backend="eager")
    def step(x: torch.Tensor, fault: bool) -> torch.Tensor:
        y = funcol.all_reduce(x * 2, "sum", (mesh, 0))
        if fault:
            _fault(dist.get_rank(), scenario)
        return funcol.all_reduce(y + 1, "sum", (mesh, 0))

    x = torch.ones(4)
    assert step(x, False).tolist() == [10.0] * 4  # ((1*2)*2 + 1)*2: a healthy step on both ranks
    start = time.monotonic()
    try:
        step(x, True)
        queue.put((scenario, rank, "no error", "", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001  (reported to the test)
        queue.put((scenario, rank, type(e).__name__, str(e), time.monotonic() - start))
    queue.close()
    queue.join_thread()  # flushed before os._exit
    os._exit(0)  # no teardown collective with a dead or stalled peer


def test_killed_or_hung_rank_ends_the_others_with_an_error_within_the_timeout():
    from helpers import free_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for scenario in SCENARIOS:
        port = free_port()
        procs += [ctx.Process(target=_rank_main, args=(r, port, scenario, queue), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    reports: dict[str, tuple[Any, ...]] = {}
    try:
        deadline = time.monotonic() + 180  # spawning and compiling on a loaded 2-core machine
        while len(reports) < len(SCENARIOS) and time.monotonic() < deadline:
            try:
                scenario, rank, kind, message, elapsed = queue.get(timeout=1)
            except Exception:  # noqa: BLE001  (queue.Empty: keep waiting)
                if all(not p.is_alive() for p in procs):
                    break
                continue
            assert rank == 0, (scenario, rank, kind, message)
            reports[scenario] = (kind, message, elapsed)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    print("fault reports:", reports)
    assert set(reports) == set(SCENARIOS), f"rank 0 did not report: {reports}, exit codes {[p.exitcode for p in procs]}"
    for scenario, (kind, message, elapsed) in reports.items():
        assert kind in ("DistBackendError", "RuntimeError"), (scenario, kind, message)
        assert elapsed < TIMEOUT_S + 15, (scenario, elapsed)  # the collective timeout, not a hang
        if scenario == "hung":
            assert "Timed out" in message and f"{TIMEOUT_S * 1000}ms" in message, message
        else:
            assert any(w in message for w in ("Connection closed by peer", "Connection reset", "Timed out")), message


pytestmark = pytest.mark.gloo
