"""The collective check across process groups on 4 real gloo ranks (NOTE [order across groups]).

Two groups over the same ranks, all-reduced in an order that depends on the
rank inside one compiled step, agree group by group (one helper line issues
every all-reduce) and hang in the first collective without the check; it must
end in ``CollectiveMismatchError`` on every rank, naming both groups and the
line.  Correct programs must run and give eager's values: the same interleaving
on every rank (trained 3 steps against eager), a 2-D mesh whose tensor-parallel
groups interleave dp and tp collectives in different orders (no two ranks share
two groups there but the world group, used last), and graph boundaries that
differ per rank (a ``print`` on one rank between collectives of two groups, at
the first step or after the ranks agreed).  One launch runs every part.
"""

from __future__ import annotations

import datetime
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from helpers import run_parts_on_ranks

pytestmark = pytest.mark.gloo

WORLD = 4
CHECK_TIMEOUT_S = 60.0
GLOO_TIMEOUT_S = 30.0
"""The divergent part's groups: without the check, its ranks wait in gloo until this timeout, then fail."""


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, group=group)  # cross-group: every all-reduce of these programs is issued here
    return t


def _cross_group_order(rank: int, world: int) -> dict:
    """Rank 0 all-reduces on group A then B, the others on B then A: one compiled step."""
    from dynamo_ext import collective_check, config

    timeout = datetime.timedelta(seconds=GLOO_TIMEOUT_S)
    a, b = dist.new_group(list(range(world)), timeout=timeout), dist.new_group(list(range(world)), timeout=timeout)
    first, second = (a, b) if rank == 0 else (b, a)

    def step(x, y):
        _all_reduce(x, first)
        _all_reduce(y, second)
        return x + y

    config.collective_check_timeout_s = CHECK_TIMEOUT_S
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    start = time.monotonic()
    try:
        compiled(torch.ones(4), torch.ones(4))
        message = "no error"
    except Exception as e:  # noqa: BLE001  (reported to the test: gloo's timeout without the check)
        message = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    collective_check.reset()  # the ranks stopped at different positions
    dist.barrier()
    return {"message": message, "seconds": seconds, "a": a.group_name, "b": b.group_name}


def _swapped_graphs(rank: int, world: int) -> dict:
    """The same order difference, each all-reduce in a graph of its own (both graphs new on every rank)."""
    from dynamo_ext import collective_check, config

    timeout = datetime.timedelta(seconds=GLOO_TIMEOUT_S)
    a, b = dist.new_group(list(range(world)), timeout=timeout), dist.new_group(list(range(world)), timeout=timeout)
    on_a = torch.compile(lambda t: _all_reduce(t, a) * 2, backend="aot_eager", fullgraph=True)
    on_b = torch.compile(lambda t: _all_reduce(t, b) * 3, backend="aot_eager", fullgraph=True)
    config.collective_check_timeout_s = CHECK_TIMEOUT_S
    start = time.monotonic()
    try:
        for f in (on_a, on_b) if rank == 0 else (on_b, on_a):
            f(torch.ones(4))
        message = "no error"
    except Exception as e:  # noqa: BLE001
        message = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    collective_check.reset()
    dist.barrier()
    return {"message": message, "seconds": seconds, "a": a.group_name, "b": b.group_name}


def _train(loss_fn, params: list[torch.Tensor], inputs: list[torch.Tensor]) -> dict:
    """Loss, gradients and parameters of 3 SGD steps, eager against ``aot_eager``: the largest difference."""

    def run(fn):
        ps = [p.clone().requires_grad_() for p in params]
        opt = torch.optim.SGD(ps, lr=0.1)
        out = []
        for x in inputs:
            opt.zero_grad()
            loss = fn(ps, x)
            loss.backward()
            out += [loss.detach().clone(), *(p.grad.clone() for p in ps)]
            opt.step()
        return out + [p.detach().clone() for p in ps]

    eager = run(loss_fn)
    compiled = run(torch.compile(loss_fn, backend="aot_eager"))
    return {"max_diff": max(float((e - c).abs().max()) for e, c in zip(eager, compiled)), "n": len(eager)}


def _seeded(rank: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(*s, generator=g) for s in shapes]


def _same_interleaving(rank: int, world: int) -> dict:
    """Groups A and B over the same ranks, interleaved A, B, A in the forward (and so B... in the backward) on
    every rank."""
    from dynamo_ext import config

    config.collective_check_timeout_s = 300.0  # a correct program: the peers' compile time counts
    a, b = dist.new_group(list(range(world))), dist.new_group(list(range(world)))

    def loss_fn(ps, x):
        h = dist_nn.all_reduce(x @ ps[0], group=a)
        h = dist_nn.all_reduce(torch.tanh(h) @ ps[1], group=b)
        h = dist_nn.all_reduce(h * h, group=a)
        return h.mean()

    torch.manual_seed(0)
    params = [torch.randn(8, 8) * 0.3, torch.randn(8, 8) * 0.3]
    return _train(loss_fn, params, _seeded(rank, (4, 8), (4, 8), (4, 8)))


def _mesh_2d_orders(rank: int, world: int) -> dict:
    """A (dp, tp) = (2, 2) mesh: tp group {0, 1} all-reduces on tp then dp, tp group {2, 3} on dp then tp, then
    every rank on the world group.  Ranks 0 and 2 share dp only (and the world group, used last by all): their
    different tp/dp orders are no mismatch; neither are the tp groups' different orders in the backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from dynamo_ext import config

    config.collective_check_timeout_s = 300.0
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    tp_first = rank in (0, 1)

    def loss_fn(ps, x):
        h = x @ ps[0]
        for g in (tp, dp) if tp_first else (dp, tp):
            h = dist_nn.all_reduce(torch.tanh(h), group=g)
        h = dist_nn.all_reduce(h @ ps[1], group=dist.group.WORLD)
        return h.square().mean()

    torch.manual_seed(0)
    params = [torch.randn(8, 8) * 0.3, torch.randn(8, 8) * 0.3]
    return _train(loss_fn, params, _seeded(rank, (4, 8), (4, 8), (4, 8)))


def _boundaries(rank: int, world: int) -> dict:
    """Graph boundaries that differ per rank between collectives of two groups: rank 0 prints between A and B
    at every step, rank 1 between B and A, rank 2 only at step 3 (after every rank agreed on its graph), rank 3
    never."""
    from dynamo_ext import config

    config.collective_check_timeout_s = 300.0
    a, b = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    state = {"step": 0}

    def fn(x, y, z):
        _all_reduce(x, a)
        if rank == 0 or (rank == 2 and state["step"] == 3):
            print(f"rank {rank}: a graph break between groups A and B")
        _all_reduce(y, b)
        if rank == 1:
            print("rank 1: a graph break between groups B and A")
        _all_reduce(z, a)
        return x * 2, y + 1, z - 1

    compiled = torch.compile(fn, backend="aot_eager")
    ok = []
    for step in range(5):
        state["step"] = step
        args = _seeded(10 * step + rank, (4,), (3,), (4,))
        eager = fn(*[t.clone() for t in args])
        got = compiled(*[t.clone() for t in args])
        ok.append(all(torch.equal(e, c) for e, c in zip(eager, got)))
    return {"ok": ok}


@pytest.fixture(scope="module")
def parts():
    return run_parts_on_ranks(
        {
            "cross_group_order": _cross_group_order,
            "swapped_graphs": _swapped_graphs,
            "same_interleaving": _same_interleaving,
            "mesh_2d_orders": _mesh_2d_orders,
            "boundaries": _boundaries,
        },
        nproc=WORLD,
    )


@pytest.mark.parametrize("part", ["cross_group_order", "swapped_graphs"])
def test_rank_dependent_order_across_groups_raises_on_every_rank(parts, part):
    for rank, res in enumerate(parts[part]):
        assert res["message"].startswith("CollectiveMismatchError"), (rank, res["message"])
        assert res["seconds"] < CHECK_TIMEOUT_S, (rank, res["seconds"])


def test_the_order_message_names_both_groups_and_the_line(parts):
    for rank, res in enumerate(parts["cross_group_order"]):
        a, b = res["a"], res["b"]
        message = res["message"]
        assert re.search(
            rf"the order of groups '({a}|{b})' \(ranks 0\u20133\) and '({a}|{b})' \(ranks 0\u20133\) differs "
            r"between rank \d and rank \d: before position 0 of group '\w+', rank \d issued [01] collective\(s\) on "
            r"group '\w+' and rank \d [01]",
            message,
        ), (rank, message)
        assert f"'{a}'" in message and f"'{b}'" in message, (rank, message)
        assert "# cross-group: every all-reduce of these programs is issued here" in message, (rank, message)
        assert "all_reduce(float32[4], sum)" in message, (rank, message)


def test_swapped_graphs_message_names_both_groups(parts):
    for rank, res in enumerate(parts["swapped_graphs"]):
        message = res["message"]
        assert f"group '{res['a']}'" in message and f"group '{res['b']}'" in message, (rank, message)
        assert "in different orders or on different groups" in message, (rank, message)


@pytest.mark.parametrize("part", ["same_interleaving", "mesh_2d_orders"])
def test_the_same_order_on_every_rank_trains_as_eager(parts, part):
    for rank, res in enumerate(parts[part]):
        assert res["n"] == 3 * 3 + 2, (rank, res)  # 3 losses, 3 x 2 gradients, 2 parameters
        assert res["max_diff"] <= 1e-5, (rank, res)


def test_rank_dependent_graph_boundaries_between_groups_run_with_eager_values(parts):
    assert [res["ok"] for res in parts["boundaries"]] == [[True] * 5] * WORLD
