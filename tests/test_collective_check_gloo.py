"""The collective-sequence check on 4 real gloo ranks (one launch for every case).

Divergent programs (another op, shape, dtype, group, order; in the forward and
only in the backward) must end with ``CollectiveMismatchError`` on every rank,
naming the first differing collective and its source line; rank-dependent
programs with the same collectives must run and match eager.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import run_on_ranks

pytestmark = pytest.mark.gloo

WORLD = 4


def _divergent(rank: int, sub) -> dict:
    """name -> fn(x) whose collectives differ on some rank."""

    def op(x):
        y = x.clone()
        if rank == 2:
            return funcol.all_gather_tensor(y, 0, dist.group.WORLD)
        dist.all_reduce(y)  # divergent: op
        return y

    def shape(x):
        y = x[:2].clone() if rank == 1 else x.clone()
        dist.all_reduce(y)  # divergent: shape
        return y

    def dtype(x):
        y = x.double() if rank == 0 else x.clone()
        dist.all_reduce(y)  # divergent: dtype
        return y

    def group(x):
        y = x.clone()
        dist.all_reduce(y, group=sub if rank == 2 else None)  # divergent: group
        return y

    def order(x):
        x = x.detach()
        if rank == 1:
            b = funcol.all_reduce(x, "max", dist.group.WORLD)
            a = funcol.all_reduce(x, "sum", dist.group.WORLD)  # divergent: order
        else:
            a = funcol.all_reduce(x, "sum", dist.group.WORLD)  # divergent: order
            b = funcol.all_reduce(x, "max", dist.group.WORLD)
        return a + b

    def backward_only(x):
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        d = DTensor.from_local(x, mesh, [Shard(0)], run_check=False).redistribute(mesh, [Replicate()])
        grad = [Partial()] if rank == 0 else [Replicate()]  # backward: reduce-scatter on rank 0 only
        return d.to_local(grad_placements=grad) * 2

    return {"op": op, "shape": shape, "dtype": dtype, "group": group, "order": order, "backward_only": backward_only}


def _consistent(rank: int, mesh) -> dict:
    """name -> (fn, args) that compute differently per rank but issue the same collectives."""

    def rank_compute(x):
        y = x * (rank + 1)
        if rank == 0:
            y = y.sin()
        dist.all_reduce(y)
        return y + rank

    def local_shape(x, local):
        y = x + local.sum(0)  # local: (rank + 2, 4)
        dist.all_reduce(y)
        return y

    def mesh_2d(x):
        # 2x2 mesh: rank 0's groups span ranks {0, 1, 2}, rank 1's {0, 1, 3}; the same collectives
        y = funcol.all_reduce(x * (rank + 1), "sum", mesh.get_group("tp"))
        if rank % 2:
            y = y.cos()
        return funcol.all_reduce(y, "max", mesh.get_group("dp")) + rank

    x = torch.randn(4, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    local = torch.randn(rank + 2, 4, generator=torch.Generator().manual_seed(10 + rank))
    return {
        "rank_compute": (rank_compute, (x,)),
        "local_shape": (local_shape, (x, local)),
        "mesh_2d": (mesh_2d, (x.detach(),)),
    }


def _bucketing_agrees(rank: int) -> tuple[bool, int, int]:
    """Inductor with our bucketing pass, rank 0 reading the first result before the next all-reduce.

    NOTE [rank-invariant first use]: every rank must still merge the three all-reduces into one
    (else rank 0 issues two and the others one: a hang).  Returns (matches eager, all-reduce calls in the
    code, all-reduces merged away at run time).
    """
    import re

    from torch._inductor.utils import run_and_get_code

    def fn(a, b, c, local):
        x = funcol.all_reduce(a * 0.5, "sum", dist.group.WORLD)
        extra = x * 2 + x.sum() if rank == 0 else a + local.sum(0)  # local: (rank + 2, 16)
        y = funcol.all_reduce(b * 0.5, "sum", dist.group.WORLD)
        z = funcol.all_reduce(c * 0.5, "sum", dist.group.WORLD)
        return x, y, z, extra

    from dynamo_ext.collective_check import stream

    g = torch.Generator().manual_seed(rank)
    args = [torch.randn(16, generator=g) for _ in range(3)] + [torch.randn(rank + 2, 16, generator=g)]
    torch._dynamo.reset()
    eager = [t.clone() for t in fn(*args)]
    before = stream._state.merged_away.get(dist.group.WORLD.group_name, 0)
    out, code = run_and_get_code(torch.compile(fn, backend="inductor"), *args)
    merged_away = stream._state.merged_away.get(dist.group.WORLD.group_name, 0) - before
    code = "\n".join(code)
    call = code[code.index("def call") :]
    calls = len(re.findall(r"_c10d_functional\.all_reduce_?\.default\(|bucketed_collective\.default\(", call))
    # the ranks' graphs have the same collectives and data flow: the bucket runs merged (2 all-reduces fewer)
    return all(torch.allclose(e, o) for e, o in zip(eager, out)), calls, merged_away


def _rank(rank: int, world: int) -> dict:
    from dynamo_ext import CollectiveMismatchError, collective_check, config

    config.collective_check_timeout_s = 90.0  # the divergent cases must end well before it (fast paths)
    sub = dist.new_group([1, 2])
    out: dict = {}
    for name, fn in _divergent(rank, sub).items():
        torch._dynamo.reset()
        x = torch.arange(6.0).requires_grad_() + rank
        # Every rank issues this next: where a rank's graph issues a collective the others do not (backward_only),
        # the others' check of this all-reduce meets it at the same stream position.
        sync = torch.compile(lambda t: funcol.all_reduce(t, "sum", dist.group.WORLD), backend="aot_eager")
        start = time.monotonic()
        try:
            y = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
            y.sum().backward()
            sync(torch.ones(3))
            out[name] = ("no error", 0.0)
        except CollectiveMismatchError as e:
            out[name] = (str(e), time.monotonic() - start)
        collective_check.reset()  # the ranks stopped at different meetings
        dist.barrier()
    # A graph only rank 0 reaches (the others run an eager all-reduce there): bounded wait, then the error.
    config.collective_check_timeout_s = 3.0
    y = torch.ones(4)
    if rank == 0:
        start = time.monotonic()
        try:
            torch.compile(lambda t: funcol.all_reduce(t, "sum", dist.group.WORLD), backend="aot_eager")(y)
            out["only_rank_0"] = ("no error", 0.0)
        except CollectiveMismatchError as e:
            out["only_rank_0"] = (str(e), time.monotonic() - start)
    dist.all_reduce(y)  # rank 0 then meets the others' eager all-reduce: nobody hangs
    config.collective_check_timeout_s = 90.0
    collective_check.reset()
    dist.barrier()

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for name, (fn, args) in _consistent(rank, mesh).items():
        torch._dynamo.reset()
        eager = fn(*args)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        got = compiled(*args)
        ok = bool(torch.allclose(eager, got))
        if name == "local_shape":  # again, rank 0 with another local shape: a recompile there only, same collectives
            args2 = (args[0], torch.ones(7, 4)) if rank == 0 else args
            ok = ok and bool(torch.allclose(compiled(*args2), fn(*args2)))
        out[name] = ok
        dist.barrier()
    out["bucketing"] = _bucketing_agrees(rank)
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_rank, nproc=WORLD)


@pytest.mark.parametrize("case", ["op", "shape", "dtype", "group", "order", "backward_only"])
def test_divergent_collectives_raise_on_every_rank(results, case):
    for rank in range(WORLD):
        message, seconds = results[rank][case]
        assert message != "no error", f"rank {rank}: {case} ran without CollectiveMismatchError"
        assert seconds < 60, f"rank {rank}: {case} took {seconds:.0f} s (the 90 s timeout path?)"
    names = [results[r][case][0] for r in range(WORLD)]
    # At least the ranks that compared directly name the first differing collective and the user's line.
    assert any("differs between rank" in m and "test_collective_check_gloo.py:" in m for m in names), names


def test_divergent_messages_name_the_collective(results):
    shape = results[0]["shape"][0]
    assert re.search(r"position \d+ of group '0' \(ranks 0\u20133\) differs between rank 0 and rank 1", shape), shape
    assert "float32[6]" in shape and "float32[2]" in shape
    assert "# divergent: shape" in shape
    assert "bfloat" not in results[0]["dtype"][0] and "float64[6]" in results[0]["dtype"][0]
    order = results[1]["order"][0]
    assert "differs between rank 1" in order and "max" in order and "sum" in order and "# divergent: order" in order
    # Whichever of ranks 1 and 2 sees the difference first, its message names both groups with their ranks.
    assert all("group '1' (ranks 1, 2)" in results[r]["group"][0] for r in (1, 2))
    assert "backward reduce_scatter_tensor" in results[1]["backward_only"][0] or (
        "backward reduce_scatter_tensor" in results[0]["backward_only"][0]
    )


@pytest.mark.parametrize("case", ["rank_compute", "local_shape", "mesh_2d"])
def test_rank_dependent_compute_with_the_same_collectives_runs(results, case):
    assert all(results[r][case] is True for r in range(WORLD))


def test_bucketing_agrees_when_one_rank_reads_a_result_early(results):
    """A rank-local read does not change the buckets; results equal eager, no hang."""
    assert [results[r]["bucketing"] for r in range(WORLD)] == [(True, 1, 2)] * WORLD


def test_a_graph_only_one_rank_reaches_ends_after_the_timeout(results):
    message, seconds = results[0]["only_rank_0"]
    assert re.search(
        r"rank\(s\) 1\u20133 did not reach position \d+ of group '0' \(ranks 0\u20133\) in a checked compiled graph "
        r"within 3 s",
        message,
    ), message
    assert seconds < 60
