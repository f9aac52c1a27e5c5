"""The audit's hang report: each rank still running at the timeout placed at the compiled collective it waits in
(op, group, stream position, the user's line, inside the collective check's wait or not) with the ranks it waits
for (NOTE [the collective a rank waits in], NOTE [hung rank])."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dynamo_ext.audit import hang
from dynamo_ext.audit.model.records import RankWait

REPO = Path(__file__).resolve().parent.parent
WAITS_IN_CHECK = Path(__file__).resolve().parent / "audit_targets" / "waits_in_check.py"
# Long enough for two ranks to start on a loaded 2-core machine (over 20 s) and reach the sleep.
HANG_TIMEOUT = 45

ALL_REDUCE = "forward all_reduce(float32[4], sum) on group '0' (ranks 0, 1)"
SOURCE = "train.py:15: dist.all_reduce(x)"


def _stack(*, frames=None, in_distributed=True, collectives=(), waiting=()):
    frames = frames or [["train.py", 30, "main", "compiled(x)"], ["torch/distributed/c10d.py", 1, "wait", ""]]
    return {
        "ev": "stack",
        "stack": frames,
        "user_index": 0,
        "in_distributed": in_distributed,
        "collectives": list(collectives),
        "in_compiled_collective": False,
        "waiting": list(waiting),
    }


def _entered(group, position):
    return {"group": group, "position": position, "collective": "", "source": "", "in_graph": False}


def _waiting(group, position, *, in_check, ranks=(0, 1)):
    return {
        "group": group,
        "ranks": list(ranks),
        "position": position,
        "collective": ALL_REDUCE,
        "source": SOURCE,
        "in_check": in_check,
    }


SLEEPING = _stack(
    frames=[["train.py", 28, "main", "time.sleep(3600)"]], in_distributed=False, collectives=[_entered("0", 0)]
)


def test_a_rank_in_the_checks_wait_is_placed_at_the_collective_it_waits_to_enter():
    stacks = {0: _stack(collectives=[_entered("0", 0)], waiting=[_waiting("0", 1, in_check=True)]), 1: SLEEPING}
    assert hang.rank_waits(0, stacks) == (RankWait(ALL_REDUCE, "0", (0, 1), 1, SOURCE, in_check=True, waits_for=(1,)),)
    assert hang.where(0, stacks) == (
        f"waiting in the collective check before a compiled collective: {ALL_REDUCE}, position 1, at {SOURCE}, "
        "waiting for rank 1"
    )
    assert hang.timeout_line(stacks, [0, 1], 30) == (
        "timeout: after 30 s: rank 1 hung at train.py:28 in main (time.sleep(3600)); "
        f"rank 0 waiting in the collective check before a compiled collective: {ALL_REDUCE}, position 1, at {SOURCE}, "
        "waiting for rank 1; rank(s) 1 behind on group '0' (last entered position 0; rank(s) 0 at 1); killed"
    )


def test_a_rank_in_a_compiled_collective_names_the_ranks_behind_it():
    stacks = {0: _stack(collectives=[_entered("0", 1)], waiting=[_waiting("0", 1, in_check=False)]), 1: SLEEPING}
    (wait,) = hang.rank_waits(0, stacks)
    assert not wait.in_check and wait.position == 1 and wait.waits_for == (1,)
    assert hang.where(0, stacks).startswith(f"waiting in a compiled collective: {ALL_REDUCE}, position 1, at {SOURCE}")


def test_a_peer_that_reached_the_position_is_not_waited_for():
    # Both ranks in the same collective (collectives that do not match further on): no rank is behind.
    stacks = {r: _stack(collectives=[_entered("0", 3)], waiting=[_waiting("0", 3, in_check=False)]) for r in (0, 1)}
    assert [w.waits_for for w in hang.rank_waits(0, stacks)] == [()]
    assert hang.where(0, stacks).endswith(f"at {SOURCE}")
    # A peer in the check's wait at the same position wrote its entry there: it reached it too.
    stacks[1] = _stack(collectives=[_entered("0", 2)], waiting=[_waiting("0", 3, in_check=True)])
    assert [w.waits_for for w in hang.rank_waits(0, stacks)] == [()]


def test_a_peer_that_did_not_answer_or_ended_is_waited_for():
    stacks = {0: _stack(waiting=[_waiting("0", 2, in_check=True, ranks=(0, 1, 2))]), 1: None}
    assert [w.waits_for for w in hang.rank_waits(0, stacks)] == [(1, 2)]
    assert hang.where(1, stacks, last="compile") == "position unknown (last event: compile)"


def test_a_rank_in_torch_distributed_outside_a_compiled_collective_keeps_its_innermost_frame():
    stacks = {0: _stack(), 1: SLEEPING}
    assert hang.rank_waits(0, stacks) == ()
    assert hang.where(0, stacks) == "waiting in torch.distributed (wait) at train.py:30 in main (compiled(x))"
    assert "rank(s) 0 waiting in torch.distributed" in hang.timeout_line(stacks, [0, 1], 30)


def _marker_line(marker: str) -> int:
    return next(n for n, line in enumerate(WAITS_IN_CHECK.read_text().splitlines(), 1) if marker in line)


@pytest.fixture(scope="module")
def waits_in_check_run():
    """``dynamo-ext audit`` of waits_in_check.py on 2 gloo ranks, timed out: its stderr line and JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        proc = subprocess.run(
            [sys.executable, "-m", "dynamo_ext", "audit", "--nproc", "2", "--quiet", "--timeout", str(HANG_TIMEOUT)]
            + ["--json", out, str(WAITS_IN_CHECK.relative_to(REPO))],
            cwd=REPO,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=HANG_TIMEOUT + 240,
        )
        yield proc, json.loads(Path(out).read_text())


@pytest.mark.gloo
def test_a_rank_waiting_in_the_check_is_placed_at_its_collective_and_names_the_rank_it_waits_for(waits_in_check_run):
    """Issue 37, item 8: rank 0 was reported "waiting in torch.distributed (_wait_for_first_positions) at line 14
    in torch_dynamo_resume_in_step_at_14", the check's own wait at the resumed function's line."""
    proc, data = waits_in_check_run
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[0].split("; rank logs")[0]
    sleep, all_reduce = _marker_line("SLEEP_LINE"), _marker_line("ALL_REDUCE_LINE")
    assert f"rank 1 hung at tests/audit_targets/waits_in_check.py:{sleep} in main (time.sleep(3600)" in line, line
    found = re.search(
        r"rank 0 waiting in the collective check before a compiled collective: forward all_reduce\(float32\[4\], "
        rf"sum\) on group '0' \(ranks 0, 1\), position (\d+), at \S*waits_in_check\.py:{all_reduce}: "
        r"dist\.all_reduce\(x\)  # ALL_REDUCE_LINE, waiting for rank 1;",
        line,
    )
    assert found, line
    position = int(found.group(1))
    assert "resume_in" not in line and "_wait_for_first_positions" not in line, line
    # rank 1's position is known from its first run of the all-reduce's graph (the check's first in the world)
    behind = f"rank(s) 1 behind on group '0' (last entered position {position - 1}; rank(s) 0 at {position})"
    assert line.endswith(f"; {behind}; killed"), line

    ranks = {r["rank"]: r for r in data["ranks"]}
    assert ranks[0]["status"] == ranks[1]["status"] == "timeout"
    (wait,) = ranks[0]["waiting"]
    assert wait["collective"] == "forward all_reduce(float32[4], sum) on group '0' (ranks 0, 1)"
    assert (wait["group"], wait["ranks"], wait["position"], wait["in_check"], wait["waits_for"]) == (
        "0",
        [0, 1],
        position,
        True,
        [1],
    )
    assert re.fullmatch(
        rf"\S*waits_in_check\.py:{all_reduce}: dist\.all_reduce\(x\)  # ALL_REDUCE_LINE", wait["source"]
    )
    assert ranks[0]["error"].startswith(
        f"still running after {HANG_TIMEOUT} s, waiting in the collective check before a compiled collective: "
    )
    assert ranks[1]["waiting"] == []
