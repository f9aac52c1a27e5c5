"""What the collective check remembers in one process, on 4 gloo ranks: across compiles, and from the first run.

* One process compiles the same FSDP2 model with ``aot_eager``, then with ``inductor``, then with ``inductor``
  again after ``torch._dynamo.reset()`` (a user who evaluates with one backend and trains with another, or
  compiles again after a reset).  On torch 2.13 the ranks' Inductor backward graphs differ (ranks 0–2 wait
  twice on one reduce-scatter's result, rank 3 once; rank 3 holds 1 of each 10-row parameter's rows, the
  others 3), while every rank's ``aot_eager`` graphs are equal: rank 3's Inductor backward has the digest of
  its ``aot_eager`` one.  Keyed by digest alone, rank 3 took the bucket decision of the ``aot_eager`` graphs'
  check ("merged") and ran its buckets merged, unchecked, while ranks 0–2 checked their new digest and ran
  theirs apart: ``CollectiveMismatchError`` ("rank 3 runs a bucket of merged collectives from position 207
  ..."), then gloo's timeout (NOTE [when the stream is checked]).  Each compile: 3 SGD steps, loss, gradients
  (type, placements, local shard) and parameters equal eager's.  On torch 2.15 the Inductor graphs are equal
  on every rank here, so the next case makes the same situation on purpose, on every release:
* two all-reduces compiled with ``aot_eager``, then, after ``torch._dynamo.reset()``, with ``inductor`` where
  rank 0 feeds the first's result into the second: ranks 1–3's Inductor graph (a bucket) has the digest of
  their ``aot_eager`` one, rank 0's another; eager's values at every step.
* With positions tracked (the audit's ranks, NOTE [where each rank waits]), the first run of a checked graph
  in a process group world records where it starts, at position 0: the check of that run, the first in the
  world, started the state afresh after the run had written its record (the audit's hang report knew the
  rank's position only from its second run); in a second world after ``destroy_process_group`` a graph
  whose context the first world had checked was not checked, and kept the first world's positions.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from fsdp_training import diff, train
from helpers import free_port, run_parts_on_ranks

# 4 residual FSDP2 blocks, each reading the block output before the last: its Inductor backward differs on rank 3
# of 4 (see the module docstring)
from test_block_stamp_aliasing_gloo import _build

pytestmark = pytest.mark.gloo

TOL = 1e-5
SEQUENCE = ("aot_eager", "inductor", "inductor")
"""Backends compiled one after the other in each rank process, ``torch._dynamo.reset()`` before each."""


def _digests(since: int) -> list[str]:
    """The digests of the checked graphs this rank ran after call ``since``."""
    from dynamo_ext.collective_check import stream

    runs = stream._state.history.runs.values()
    return sorted({plan.digest for group in runs for _, plan, _, call in group if call > since})


def _backends(rank: int, world: int) -> list[tuple[str, dict[str, Any]]]:
    net = _build(world)
    eager = train(net, net, rank)
    out = []
    for backend in SEQUENCE:
        torch._dynamo.reset()
        net = _build(world)
        out.append((backend, diff(eager, train(net, torch.compile(net, backend=backend, fullgraph=True), rank))))
    return out


def _dependency_after_reset(rank: int, world: int) -> dict[str, Any]:
    """Two all-reduces, 3 steps with ``aot_eager``; then, compiled again with ``inductor``, 3 steps where rank 0's
    second all-reduce reads the first's result: per phase, the values equal eager's and the graph's digest."""
    from dynamo_ext.collective_check import stream

    mode = {"dependent": False}

    def fn(a, b):
        x = funcol.all_reduce(a, "sum", dist.group.WORLD)
        if rank == 0 and mode["dependent"]:
            b = b + x.sum()
        return x, funcol.all_reduce(b, "sum", dist.group.WORLD)

    out: dict[str, Any] = {"equal": [], "digests": []}
    for backend, dependent in (("aot_eager", False), ("inductor", True)):
        torch._dynamo.reset()
        mode["dependent"] = dependent
        compiled, since = torch.compile(fn, backend=backend, fullgraph=True), stream._state.calls
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            a, b = torch.randn(4, generator=g), torch.randn(3, generator=g)
            got = compiled(a.clone(), b.clone())
            out["equal"].append(all(torch.allclose(e, c) for e, c in zip(fn(a, b), got)))
        out["digests"].append(_digests(since))
    return out


def _all_reduce_twice(rank: int, world: int) -> list[list[dict[str, Any]]]:
    """Positions tracked, a graph with one all-reduce run twice: what the audit reads after each run."""
    from dynamo_ext.collective_check import stream

    def step(x):
        dist.all_reduce(x)
        return x * 2

    stream.track_positions(True)
    try:
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        seen = []
        for _ in range(2):
            compiled(torch.ones(4))
            seen.append(stream.in_flight())
        return seen
    finally:
        stream.track_positions(False)


def _second_world(rank: int, world: int) -> list[list[dict[str, Any]]]:
    """``_all_reduce_twice`` in a new process group world, after this world's checked graphs ran."""
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port[0], world, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return _all_reduce_twice(rank, world)


@pytest.fixture(scope="module")
def parts():
    # the first part runs the rank processes' first checked graph; the second starts a new world, where the rest run
    return run_parts_on_ranks(
        {
            "first_world": _all_reduce_twice,
            "second_world": _second_world,
            "dependency": _dependency_after_reset,
            "backends": _backends,
        }
    )


def test_fsdp2_compiled_with_aot_eager_then_inductor_then_again_after_reset_matches_eager(parts):
    for rank, r in enumerate(parts["backends"]):
        assert [b for b, _ in r] == list(SEQUENCE), r
        for backend, d in r:
            where = f"rank {rank}, {backend}: {d}"
            assert d["grad_kinds_match"] and all(kind == "DTensor" for kind, _ in d["grad_kinds"]), where
            assert d["loss"] <= TOL and d["grads"] <= TOL and d["params"] <= TOL, where


def test_a_new_compile_is_checked_where_its_digest_is_an_old_one(parts):
    results = parts["dependency"]
    assert [r["equal"] for r in results] == [[True] * 6] * 4, results
    # the case: ranks 1-3 run their aot_eager graph's digest again, rank 0 another one
    (aot_eager, inductor) = results[1]["digests"]
    assert aot_eager == inductor and results[0]["digests"][1] != inductor, results
    assert all(r["digests"] == results[1]["digests"] for r in results[2:]), results


@pytest.mark.parametrize("world_part", ["first_world", "second_world"])
def test_the_first_run_in_a_world_records_its_position(parts, world_part):
    for rank, (first, second) in enumerate(parts[world_part]):
        where = f"rank {rank}, {world_part}: {first} then {second}"
        assert [(row["position"], row["in_graph"]) for row in first] == [(0, True)], where
        assert [(row["position"], row["in_graph"]) for row in second] == [(1, True)], where
        assert first[0]["collective"].startswith("forward all_reduce(float32[4], sum) on group "), where
        assert first[0]["collective"].endswith("(ranks 0–3)"), where
        assert first[0]["source"].endswith("dist.all_reduce(x)"), where
