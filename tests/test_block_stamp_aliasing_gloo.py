"""A stamped FSDP2 block keeps the aliasing of its recorded call's arguments (NOTE [a stamp keeps its arguments'
aliasing]), against eager FSDP2 on 4 gloo ranks.

``for block in self.blocks: h, res = block(h, res), h`` with ``res = h`` before the loop: the first call passes one
tensor as both arguments, the later ones two (issue 37, item 1).  Compiled with blocks traced once (the default)
on ``aot_eager`` and ``inductor``: loss, gradients (type, placements, local shard) and parameters after 3 SGD
steps equal eager's, and blocks 2 and 3 are stamped from block 1 (block 0 is recorded apart).  Every way an
argument can alias, in one process: ``test_block_stamp_aliasing.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from fsdp_training import HIDDEN, INNER, diff, train
from helpers import run_parts_on_ranks, stamp_logs
from torch import nn

pytestmark = pytest.mark.gloo

BACKENDS = ["aot_eager", "inductor"]
TOL = 1e-5


class PairBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, INNER)
        self.down = nn.Linear(INNER, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x))) + self.mix(res)


class PairNet(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.blocks = nn.ModuleList([PairBlock() for _ in range(blocks)])
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        res = h  # the first block's call is block(h, h)
        for block in self.blocks:
            h, res = block(h, res), h
        return self.out(h)


def _build(world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = PairNet()
    mesh = init_device_mesh("cpu", (world,))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _run(rank: int, world: int, backend: str) -> dict[str, Any]:
    net = _build(world)
    eager = train(net, net, rank)
    torch._dynamo.reset()
    net = _build(world)
    with stamp_logs() as stamps:
        compiled = train(net, torch.compile(net, backend=backend, fullgraph=True), rank)
    return {**diff(eager, compiled), "stamped": [m.split(" (")[0] for m in stamps]}


@pytest.fixture(scope="module", params=BACKENDS)
def ranks(request):
    # one launch per backend: an ``inductor`` part after an ``aot_eager`` part of this model in the same rank
    # processes fails the collective check on a25f398 with blocks traced once or not (rank 3's bucket at a stream
    # position the others' graphs do not have), which is not what this file tests
    return request.param, run_parts_on_ranks({request.param: functools.partial(_run, backend=request.param)})


def test_fsdp2_blocks_called_with_one_tensor_twice_first_match_eager(ranks):
    backend, parts = ranks
    for rank, r in enumerate(parts[backend]):
        where = f"rank {rank}, {backend}: {r}"
        assert r["grad_kinds_match"] and all(kind == "DTensor" for kind, _ in r["grad_kinds"]), where
        assert r["loss"] <= TOL and r["grads"] <= TOL and r["params"] <= TOL, where
        assert r["stamped"] == [f"L['fn'].blocks.{i} stamped from L['fn'].blocks.1" for i in (2, 3)], where
