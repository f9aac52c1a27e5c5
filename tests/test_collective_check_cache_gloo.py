"""The collective check after a warm restart, on 2 gloo ranks sharing one cache directory.

Each rank first compiles every graph of the cases (a cold launch, all ranks
alike), then restarts its compiler state (``torch._dynamo.reset()``; AOTAutograd's
cache is read from disk, as a relaunched job reads it) and runs the cases: every
graph now comes from AOTAutograd's cache, and ranks whose collectives differ
must still end with ``CollectiveMismatchError``, in the forward and in a backward
that came from the cache too.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import run_on_ranks

pytestmark = pytest.mark.gloo  # one 2-process launch, about 30 CPU-seconds

WORLD = 2


def _gather(x):
    return funcol.all_gather_tensor_autograd(x, 0, dist.group.WORLD)  # warm: rank 0's line


def _gather_elsewhere(x):
    return funcol.all_gather_tensor_autograd(x, 0, dist.group.WORLD)  # warm: rank 1's line


def _replicate(x, mesh, partial_grad):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    d = DTensor.from_local(x, mesh, [Shard(0)], run_check=False).redistribute(mesh, [Replicate()])
    return d.to_local(grad_placements=[Partial()] if partial_grad else [Replicate()])  # Partial: a reduce-scatter


def _sync(t):
    return funcol.all_gather_tensor(t, 0, dist.group.WORLD)


def _step(fn, *args) -> None:
    x = torch.ones(4, requires_grad=True)
    torch.compile(fn, backend="inductor", fullgraph=True)(x, *args).sum().backward()
    torch.compile(_sync, backend="inductor", fullgraph=True)(torch.ones(2))


def _rank(rank: int, world: int, cache_dir: str) -> dict:
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from dynamo_ext import CollectiveMismatchError, collective_check, config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch._functorch.config.enable_autograd_cache = True
    torch._inductor.config.fx_graph_cache = True
    config.collective_check_timeout_s = 60.0
    mesh = init_device_mesh("cpu", (world,))
    cases = {
        "same": ((_gather,), (_gather,)),
        "line": ((_gather,), (_gather_elsewhere,)),
        "backward": ((_replicate, mesh, True), (_replicate, mesh, False)),
    }
    for step in [(_gather,), (_gather_elsewhere,), (_replicate, mesh, True), (_replicate, mesh, False)]:
        _step(*step)  # the cold launch: every rank compiles every graph
    out = {}
    for name, per_rank in cases.items():
        torch._dynamo.reset()  # the restart: a new compiler state, the same cache directory
        collective_check.reset()
        counters.clear()
        dist.barrier()
        try:
            _step(*per_rank[rank])
            message = "no error"
        except CollectiveMismatchError as e:
            message = str(e)
        aot = counters["aot_autograd"]
        out[name] = (message, aot["autograd_cache_hit"], aot["autograd_cache_miss"])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(_rank, str(tmp_path_factory.mktemp("inductor_cache")), nproc=WORLD)


def test_warm_graphs_come_from_the_aot_cache(results):
    for rank in range(WORLD):
        for name, (message, hits, misses) in results[rank].items():
            # both graphs of the step, or the first where the check raised before the second compiled
            expected = 2 if message == "no error" else (1, 2)
            assert misses == 0 and hits in (expected if isinstance(expected, tuple) else (expected,)), (
                f"rank {rank}, {name}: {hits} hits, {misses} misses"
            )


def test_warm_ranks_with_the_same_collectives_run(results):
    assert [results[r]["same"][0] for r in range(WORLD)] == ["no error"] * WORLD


def test_warm_ranks_whose_forward_collectives_differ_raise(results):
    messages = [results[r]["line"][0] for r in range(WORLD)]
    assert all(m != "no error" for m in messages), messages
    assert any("test_collective_check_cache_gloo.py:" in m and "differs between rank" in m for m in messages)


def test_warm_ranks_whose_cached_backward_collectives_differ_raise(results):
    messages = [results[r]["backward"][0] for r in range(WORLD)]
    assert all(m != "no error" for m in messages), messages
    assert any("backward reduce_scatter_tensor" in m for m in messages), messages
