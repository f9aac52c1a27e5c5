"""AsyncCollectiveTensor inputs of a compiled region, compiled vs eager on gloo ranks.

NOTE [grad-requiring AsyncCollectiveTensor inputs]: a rowwise-parallel embedding's output is an ACT
that requires grad; stock AOTAutograd (2.13) drops the gradient through it when it enters a compiled
region.  Two checks: the minimal repro (a reduce-scattered partial sum into a compiled function), and
a torchtitan-shaped model (rowwise embedding to ``Shard(1)``, sequence-parallel blocks compiled one by
one, FSDP2 over TP) trained 2 AdamW steps, with and without activation checkpointing of each block.
Both run in one launch of 4 ranks (the ``ranks`` fixture; the model only when its test is selected).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_training import Block, diff, grad_records, max_diff
from helpers import run_parts_on_ranks
from torch import nn

pytestmark = pytest.mark.gloo


@pytest.fixture(scope="module")
def ranks(request):
    """The repro and, when its test is selected, the torchtitan-shaped model, in one launch of 4 ranks."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    parts = {"repro": _repro}
    if test_per_block_compiled_tp_fsdp_model_matches_eager.__name__ in selected:
        parts["titan_shaped"] = _titan_shaped
    return run_parts_on_ranks(parts, nproc=4)


BACKENDS = ("aot_eager", "inductor")
VOCAB, DIM, INNER, BATCH, SEQ = 32, 8, 12, 2, 8
TOL = 1e-5


def _repro_fn(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + x.sin()


def _repro(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for backend in ("eager", *BACKENDS):
        torch._dynamo.reset()
        w = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        x = DTensor.from_local(w * 1.0, mesh, [Partial()], run_check=False)
        x = x.redistribute(mesh, [Shard(0)], async_op=True).to_local()
        assert isinstance(x, AsyncCollectiveTensor) and x.requires_grad
        fn = _repro_fn if backend == "eager" else torch.compile(_repro_fn, backend=backend, fullgraph=True)
        y = fn(x)
        if y.requires_grad:  # stock: it does not, and backward would raise
            y.sum().backward()
        out[backend] = {"y": y.detach(), "requires_grad": y.requires_grad, "w_grad": w.grad}
    return out


def test_act_input_gradient_matches_eager(ranks):
    for rank, res in enumerate(ranks["repro"]):
        eager = res["eager"]
        assert eager["w_grad"] is not None
        for backend in BACKENDS:
            got = res[backend]
            assert got["requires_grad"], f"rank {rank}, {backend}: the output does not require grad"
            assert max_diff(got["y"], eager["y"]) <= TOL, (rank, backend)
            assert max_diff(got["w_grad"], eager["w_grad"]) <= TOL, (rank, backend)


class Net(nn.Module):
    """tokens ``int64[B, S]`` -> logits ``[B, S, VOCAB]``: an embedding, 2 residual blocks, an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(DIM, INNER), Block(DIM, INNER)])
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(h)


def _build(world: int, *, backend: str | None, checkpoint: bool) -> nn.Module:
    """torchtitan's order: TP (sequence parallel between blocks), AC per block, compile per block, FSDP2."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    net = Net()
    plan = {
        # The embedding's output: reduce-scattered to Shard(1) with async_op, to_local -> an ACT into layer 0.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(net, mesh["tp"], plan)
    layers = []
    for block in net.layers:
        parallelize_module(
            block,
            mesh["tp"],
            {"up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))},
        )
        if checkpoint:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if backend is not None:
            block = torch.compile(block, backend=backend, fullgraph=True)
        layers.append(block)
    net.layers = nn.ModuleList(layers)
    fully_shard(net.tok_embeddings, mesh=mesh["dp"])
    for layer in net.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    return net


def _train(net: nn.Module, rank: int) -> list[dict[str, Any]]:
    """2 AdamW steps; per step the loss, each gradient (type, placements, local shard) and the parameters."""

    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    record = []
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * (rank // 2) + step)  # one batch per dp rank
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        logits = net(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grads = grad_records(net)
        opt.step()
        opt.zero_grad()
        record.append(
            {
                "loss": loss.detach().reshape(1),
                "grads": grads,
                "params": [p.to_local().detach().clone() for p in net.parameters()],
            }
        )
    return record


def _titan_shaped(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for checkpoint in (False, True):
        eager = _train(_build(world, backend=None, checkpoint=checkpoint), rank)
        embedding_grad = eager[0]["grads"][0][2]
        assert embedding_grad is not None and embedding_grad.abs().sum() > 0
        for backend in BACKENDS:
            torch._dynamo.reset()
            compiled = _train(_build(world, backend=backend, checkpoint=checkpoint), rank)
            d = diff(eager, compiled)
            d["embedding_grad"] = max(max_diff(e["grads"][0][2], c["grads"][0][2]) for e, c in zip(eager, compiled))
            out[f"{backend}, checkpoint={checkpoint}"] = d
    return out


def test_per_block_compiled_tp_fsdp_model_matches_eager(ranks):
    for rank, res in enumerate(ranks["titan_shaped"]):
        for setting, d in res.items():
            where = f"rank {rank}, {setting}"
            assert d["grad_kinds_match"], f"{where}: gradient types/placements differ: {d['grad_kinds']}"
            assert d["embedding_grad"] <= TOL, f"{where}: tok_embeddings.weight.grad differs by {d['embedding_grad']}"
            assert d["loss"] <= TOL and d["grads"] <= TOL and d["params"] <= TOL, f"{where}: {d}"
