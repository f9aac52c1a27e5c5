"""Real collectives on 4 gloo ranks: FSDP2 forward state after compiled calls, DTensor creation inside.

One launch of 4 ranks serves both tests (the ``ranks`` fixture).
"""

from __future__ import annotations

import pytest
import torch
from helpers import all_gathers, run_parts_on_ranks

pytestmark = pytest.mark.gloo


@pytest.fixture(scope="module")
def ranks():
    """Every rank function of this file, in one launch of 4 ranks."""
    parts = {"fsdp_state": _fsdp_state_after_compiled_forward, "dtensor_inside": _dtensor_inside}
    return run_parts_on_ranks(parts, nproc=4)


def _fsdp_state_after_compiled_forward(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    ref = net(x)
    frames = []

    def backend(gm, inputs):
        frames.append(gm)
        return gm.forward

    compiled = torch.compile(net, backend=backend, fullgraph=True)
    outs = [compiled(x), compiled(x * 2), net(x), compiled(x)]
    return {
        "match": [bool(torch.allclose(o, r, atol=1e-6)) for o, r in zip(outs, [ref, net(x * 2), ref, ref])],
        "params_sharded": all(isinstance(p, DTensor) for p in net.parameters()),
        "param_shapes": [tuple(p.to_local().shape) for p in net.parameters()],
        "frames": len(frames),
        # the gathers sit in subgraphs (activation checkpoint, autograd.Function forward)
        "all_gathers": all_gathers(frames),
    }


def test_fsdp2_forward_compiled_is_one_graph_and_leaves_fsdp_state_intact(ranks):
    results = ranks["fsdp_state"]
    for r in results:
        assert r["match"] == [True] * 4
        assert r["params_sharded"]  # sharded parameters are back on the modules
        assert r["frames"] == 1  # one graph, no recompile for a same-shaped input
        assert r["all_gathers"] == 2  # one per layer: its weight and bias in one (NOTE [FSDP2 gathers per group])
    # 10 rows over 4 ranks: 3, 3, 3, 1 (FSDP's uneven sharding survives compiled calls)
    assert [r["param_shapes"][0] for r in results] == [(3, 6), (3, 6), (3, 6), (1, 6)]


def _dtensor_inside(rank: int, world: int) -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(rank))  # differs per rank: src rank wins

    def fn(t):
        a = distribute_tensor(t, mesh, [Shard(0), Shard(1)])
        b = distribute_tensor(t, mesh, [Replicate(), Partial()])
        c = distribute_tensor(t, mesh["tp"], [Shard(0)], src_data_rank=None)
        return a.to_local(), a.full_tensor(), b.full_tensor(), c.to_local()

    eager = fn(x)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    return [bool(torch.equal(e, c)) for e, c in zip(eager, compiled)]


def test_distribute_tensor_inside_matches_eager(ranks):
    for r in ranks["dtensor_inside"]:
        assert r == [True] * 4
