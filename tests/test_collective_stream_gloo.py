"""The collective check on the stream, on 2 real gloo ranks: graph boundaries may differ per rank.

Correct programs whose ranks compile different graphs (a ``print`` on rank 0
only, also between collectives of two groups; a rank-dependent data dependency
between two collectives) run and give eager's values, with ``aot_eager`` and
with Inductor (whose bucketing pass merges only what every rank agrees on); divergent programs whose graphs look
alike (an agreed graph run on rank 0 only; two different lines issuing
all-reduces of equal shape) raise ``CollectiveMismatchError`` on every rank
within the check's timeout instead of hanging or pairing the wrong collectives.
One launch of 2 ranks runs every case with both backends (the ``launch`` fixture).
"""

from __future__ import annotations

import functools
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import run_parts_on_ranks

pytestmark = pytest.mark.gloo

WORLD = 2
TIMEOUT_S = 10.0


def _print_case(rank: int):
    def fn(a, b):
        dist.all_reduce(a)
        if rank == 0:
            print("rank 0 only: a graph break")
        dist.all_reduce(b)
        return a * 2, b + 1

    def args(step):
        g = torch.Generator().manual_seed(10 * step + rank)
        return torch.randn(4, generator=g), torch.randn(3, generator=g)

    return fn, args


def _dependency_case(rank: int):
    def fn(a, b):
        x = funcol.all_reduce(a, "sum", dist.group.WORLD)
        if rank == 0:
            b = b + x.sum()  # rank 0's second all-reduce reads the first's result; rank 1's does not
        y = funcol.all_reduce(b, "sum", dist.group.WORLD)
        return x, y

    def args(step):
        g = torch.Generator().manual_seed(20 * step + rank)
        return torch.randn(4, generator=g), torch.randn(3, generator=g)

    return fn, args


def _two_groups_print_case(rank: int):
    """A graph break on rank 0 between an all-reduce on group A and two on group B (over the same ranks): rank
    1's one graph covers both groups, rank 0 reaches B's only after A's all-reduce completes (NOTE [collective
    stream check]); with Inductor, B's two all-reduces are a bucket on both ranks, decided where it runs."""
    group_a, group_b = dist.new_group([0, 1]), dist.new_group([0, 1])

    def fn(a, b, c):
        x = funcol.all_reduce(a, "sum", group_a)
        if rank == 0:
            print("rank 0 only: a graph break between groups A and B")
        y = funcol.all_reduce(b, "sum", group_b)
        z = funcol.all_reduce(c, "sum", group_b)
        return x * 2, y + 1, z - 1

    def args(step):
        g = torch.Generator().manual_seed(40 * step + rank)
        return torch.randn(4, generator=g), torch.randn(3, generator=g), torch.randn(5, generator=g)

    return fn, args


def _late_print_on_rank_0(rank: int, backend: str) -> list[bool | str]:
    """Rank 0 prints at step 3 only, long after every rank agreed on the step's graph: its new graphs are
    checked against peers that run the agreed graph unchecked (NOTE [answering a peer's check])."""
    from dynamo_ext import config

    state = {"print": False}

    def fn(a, b):
        x = funcol.all_reduce(a, "sum", dist.group.WORLD)
        b = b + x.sum()  # a data dependency: Inductor keeps the two all-reduces apart on every rank
        if rank == 0 and state["print"]:
            print("rank 0, step 3 only: a graph break")
        return x, funcol.all_reduce(b, "sum", dist.group.WORLD)

    compiled = torch.compile(fn, backend=backend)
    ok: list[bool | str] = []
    for step in range(6):
        if step == 3:
            config.collective_check_timeout_s = TIMEOUT_S  # compiled and agreed: an answer comes at once
        state["print"] = step == 3
        g = torch.Generator().manual_seed(30 * step + rank)
        a, b = torch.randn(4, generator=g), torch.randn(3, generator=g)
        try:
            got = compiled(a.clone(), b.clone())
        except Exception as e:  # noqa: BLE001  (reported to the test)
            ok.append(f"{type(e).__name__}: {e}")
            break
        ok.append(all(torch.allclose(e, c) for e, c in zip(fn(a, b), got)))
    return ok


def _agreed_graph_on_rank_0_only(rank: int, backend: str) -> tuple[str, float]:
    def h(x):
        dist.all_reduce(x)  # stream: h's all-reduce
        return x + 1

    def g(x):
        dist.all_reduce(x)  # stream: g's all-reduce
        return x * 2

    ch, cg = torch.compile(h, backend=backend), torch.compile(g, backend=backend)
    cg(torch.ones(4))  # every rank: both compiled (compile time stays out of the timed part) and agreed
    ch(torch.ones(4))
    start = time.monotonic()
    try:
        if rank == 0:
            ch(torch.ones(4))  # rank 0 only: the others go on to g
        cg(torch.ones(4))
    except Exception as e:  # noqa: BLE001  (reported to the test)
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "no error", time.monotonic() - start


def _different_lines_same_shape(rank: int, backend: str) -> tuple[str, float]:
    def f(x):
        if rank == 0:
            dist.all_reduce(x)  # stream: f's all-reduce, rank 0 only
        return x + 100

    def g(x):
        dist.all_reduce(x)  # stream: g's all-reduce
        return x + 200

    cf, cg = torch.compile(f, backend=backend), torch.compile(g, backend=backend)
    cg(torch.ones(4))  # every rank: compiled and agreed
    start = time.monotonic()
    try:
        a = cf(torch.ones(4) * (rank + 1))
        b = cg(torch.ones(4) * (rank + 1))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return f"no error: {a.tolist()} {b.tolist()}", time.monotonic() - start


def _rank(rank: int, world: int, backend: str) -> dict:
    from dynamo_ext import collective_check, config

    # Correct programs: the default timeout (a rank may wait at a check while its peer compiles, which takes
    # well over 10 s for Inductor on a loaded machine); divergent ones: a small one, which they must not reach.
    config.collective_check_timeout_s = 300.0
    out: dict = {}
    for name, case in (("print", _print_case), ("dependency", _dependency_case), ("groups", _two_groups_print_case)):
        torch._dynamo.reset()
        fn, make_args = case(rank)
        compiled = torch.compile(fn, backend=backend)
        ok = []
        for step in range(3):
            eager = fn(*make_args(step))
            got = compiled(*make_args(step))
            ok.append(all(torch.allclose(e, c) for e, c in zip(eager, got)))
        out[name] = ok
        dist.barrier()
    torch._dynamo.reset()
    out["late_print"] = _late_print_on_rank_0(rank, backend)
    dist.barrier()
    config.collective_check_timeout_s = TIMEOUT_S
    for name, case in (("rank_0_only", _agreed_graph_on_rank_0_only), ("same_shape", _different_lines_same_shape)):
        torch._dynamo.reset()
        out[name] = case(rank, backend)
        collective_check.reset()  # the ranks stopped at different positions
        dist.barrier()
    return out


BACKENDS = ("aot_eager", "inductor")


@pytest.fixture(scope="module")
def launch():
    """Every case with each backend, in one launch of 2 ranks (each backend's part ends on agreed streams)."""
    return run_parts_on_ranks({b: functools.partial(_rank, backend=b) for b in BACKENDS}, nproc=WORLD)


@pytest.fixture(scope="module", params=BACKENDS)
def results(request, launch):
    return request.param, launch[request.param]


def test_rank_dependent_graph_break_runs_with_eager_values(results):
    backend, res = results
    assert [res[r]["print"] for r in range(WORLD)] == [[True] * 3] * WORLD, backend


def test_rank_dependent_data_dependency_runs_with_eager_values(results):
    backend, res = results
    assert [res[r]["dependency"] for r in range(WORLD)] == [[True] * 3] * WORLD, backend


def test_rank_dependent_graph_break_between_two_groups_runs_with_eager_values(results):
    backend, res = results
    assert [res[r]["groups"] for r in range(WORLD)] == [[True] * 3] * WORLD, backend


def test_rank_dependent_graph_break_after_agreement_runs_with_eager_values(results):
    backend, res = results
    assert [res[r]["late_print"] for r in range(WORLD)] == [[True] * 6] * WORLD, backend


@pytest.mark.parametrize("case", ["rank_0_only", "same_shape"])
def test_divergent_streams_raise_on_every_rank_within_the_timeout(results, case):
    backend, res = results
    for rank in range(WORLD):
        message, seconds = res[rank][case]
        assert message.startswith("CollectiveMismatchError"), (backend, rank, message)
        assert seconds < TIMEOUT_S + 15, (backend, rank, seconds)


def test_divergent_messages_name_group_position_and_lines(results):
    backend, res = results
    messages = "\n".join(res[r][case][0] for r in range(WORLD) for case in ("rank_0_only", "same_shape"))
    assert re.search(r"position \d+ of group '\d+' \(ranks 0, 1\) differs between rank", messages), messages
    assert "# stream: h's all-reduce" in messages, messages
    assert "# stream: g's all-reduce" in messages and "# stream: f's all-reduce, rank 0 only" in messages, messages
    assert "all_reduce(float32[4], sum)" in messages, messages
