"""Block reuse (NOTE [block reuse]) against eager FSDP2 on 4 gloo ranks.

A model of 3 identical FSDP2 blocks (plain FSDP2, and FSDP over TP on a (2, 2)
mesh) trains 3 SGD steps (momentum) from the same seed eagerly and compiled
with ``dynamo_ext.config.block_reuse`` on; the losses, the gradients (type,
placements, local shard) and the parameters after each step must match eager,
and the plain FSDP2 forward graph must call one subgraph for the blocks (FSDP over TP shares none:
its blocks' compute is DTensor code).  Under compiled
autograd the backward of a graph with a shared region is refused with a message
(NOTE [block reuse under compiled autograd]); FSDP over TP, sharing none, trains.

Marked ``slow`` (not run by default): block reuse is off by default; the
default run covers it in one process (``test_block_reuse.py``: the subgraph,
the refusals, Inductor gradients against eager).  One launch of 4 ranks
serves both tests (the ``ranks`` fixture).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
from fsdp_training import build, diff, train
from helpers import CountingBackend, run_parts_on_ranks

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

THREE = (6, 6, 6)
CONFIGS = {
    "fsdp": {"inners": THREE},
    "fsdp_over_tp": {"inners": THREE, "tp": True},
    "inductor": {"inners": THREE, "backend": "inductor"},
}
TOL = 1e-5


def _backward(backend: CountingBackend | None, loss: torch.Tensor) -> None:
    import dynamo_ext._compat as compat

    if backend is None:
        loss.backward()
        return
    with compat.compiled_autograd(torch.compile(backend=backend, fullgraph=True)):
        loss.backward()


def _reuse(rank: int, world: int, compiled_autograd: bool) -> dict[str, Any]:
    import dynamo_ext
    import dynamo_ext._compat as compat
    from dynamo_ext.fx.nodes import is_invoke_subgraph

    out = {}
    for name, cfg in CONFIGS.items():
        if compiled_autograd and name == "inductor":
            continue
        net = build(world, **cfg)
        eager = train(net, net, rank, **cfg)
        torch._dynamo.reset()
        compat.dynamo_counters().clear()
        fwd, bwd = CountingBackend(cfg.get("backend", "aot_eager")), CountingBackend("aot_eager")
        net = build(world, **cfg)
        model = torch.compile(net, backend=fwd, fullgraph=True)

        backward = functools.partial(_backward, bwd if compiled_autograd else None)
        with dynamo_ext.config.patch(block_reuse=True):
            try:
                run = train(net, model, rank, backward=backward, **cfg)
            except RuntimeError as e:  # NOTE [block reuse under compiled autograd]
                out[name] = {"refused": str(e)}
                continue
        calls = Counter(str(n.args[0].target) for g in fwd.graphs for n in g.graph.nodes if is_invoke_subgraph(n))
        out[name] = {**diff(eager, run), "graphs": len(fwd.graphs), "calls": calls}
    return out


@pytest.fixture(scope="module")
def ranks():
    """Both backward modes, in one launch of 4 ranks."""
    parts = {
        "eager_backward": functools.partial(_reuse, compiled_autograd=False),
        "compiled_autograd": functools.partial(_reuse, compiled_autograd=True),
    }
    return run_parts_on_ranks(parts, nproc=4)


@pytest.mark.parametrize("compiled_autograd", [False, True], ids=["eager_backward", "compiled_autograd"])
def test_three_identical_fsdp2_blocks_reused_match_eager(ranks, compiled_autograd):
    for rank, per_config in enumerate(ranks["compiled_autograd" if compiled_autograd else "eager_backward"]):
        for name, r in per_config.items():
            where = f"rank {rank}, {name}: {r}"
            if compiled_autograd and name != "fsdp_over_tp":  # refused in words, never run with a wrong backward
                assert "compiled autograd cannot trace" in r.get("refused", ""), where
                continue
            assert "refused" not in r, where
            assert r["grad_kinds_match"] and all(kind == "DTensor" for kind, _ in r["grad_kinds"]), where
            assert r["loss"] <= TOL and r["grads"] <= TOL and r["params"] <= TOL, where
            assert r["graphs"] == 1, where
            if name == "fsdp_over_tp":
                # The blocks' compute is DTensor code, which stays outside regions; the only repeated
                # plain-tensor stretches are FSDP2's unshard views, which alias their input, and Dynamo's
                # deduplication leaves such a region inline ("input-output aliasing"): no subgraph, so nothing
                # for compiled autograd to refuse either.
                assert not r["calls"], where
                continue
            # Plain FSDP2: each block's compute is one region, one subgraph called once per block.
            assert r["calls"] and max(r["calls"].values()) == 3, where
