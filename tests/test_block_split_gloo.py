"""Identical blocks compiled once (NOTE [blocks compiled once]) against eager FSDP2, on 4 gloo ranks.

Four identical FSDP2 blocks (uneven shards), FSDP2 alone with ``inductor`` and FSDP over TP with
``aot_eager``: loss, gradients (type, placements, local shard) and parameters after 3 SGD steps equal eager
FSDP2's, with the blocks' compile shared.  One configuration makes one rank's reuse decisions differ from the
others' (rank 1 compiles every block): the ranks still run the same collectives and the same numbers.  The
other FSDP2 settings (mixed precision, module groups, activation checkpointing, compiled autograd, ...) run
split by default in ``test_fsdp_training_gloo.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from fsdp_training import build, diff, train
from helpers import run_parts_on_ranks

pytestmark = pytest.mark.gloo

# Two identical blocks are split in every FSDP2 configuration of test_fsdp_training_gloo.py (the default);
# here four, so that three blocks run the first one's compile.
CONFIGS = {
    "fsdp_over_tp": {"tp": True},
    "fsdp_inductor": {"backend": "inductor"},
    # rank 1 never reuses a compile: its reuse decisions differ from every other rank's
    "rank1_compiles_every_block": {"backend": "inductor", "no_reuse_on_rank": 1},
}
TOL = 1e-5


def _run(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import logging

    import dynamo_ext._compat as compat
    from dynamo_ext import block_split

    build_kwargs = {k: v for k, v in cfg.items() if k == "tp"}
    inners = (6, 6, 6, 6)
    net = build(world, inners=inners, **build_kwargs)
    eager = train(net, net, rank, **build_kwargs)

    torch._dynamo.reset()
    compat.dynamo_counters().clear()
    net = build(world, inners=inners, **build_kwargs)
    backend = cfg.get("backend", "aot_eager")
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger(block_split.__name__)
    handler, level = _Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    original_key = block_split.structural_key
    if cfg.get("no_reuse_on_rank") == rank:
        block_split.structural_key = lambda gm, inputs: object()  # type: ignore[assignment]
    try:
        model = torch.compile(net, backend=backend, fullgraph=True)
        compiled = train(net, model, rank, **build_kwargs)
    finally:
        block_split.structural_key = original_key  # type: ignore[assignment]
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {
        **diff(eager, compiled),
        "breaks": sum(compat.dynamo_counters()["graph_break"].values()),
        "split": [m for m in records if "submodules" in m],
    }


@pytest.fixture(scope="module")
def ranks():
    parts = {name: functools.partial(_run, cfg=cfg) for name, cfg in CONFIGS.items()}
    return run_parts_on_ranks(parts, nproc=4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_blocks_compiled_once_match_eager_fsdp2(ranks, name):
    for rank, r in enumerate(ranks[name]):
        where = f"rank {rank}, {name}: {r}"
        assert r["grad_kinds_match"] and all(kind == "DTensor" for kind, _ in r["grad_kinds"]), where
        assert r["loss"] <= TOL and r["grads"] <= TOL and r["params"] <= TOL, where
        assert r["breaks"] == 0, where
        # four blocks and the parts before and after them; the blocks after the first reuse its compile
        no_reuse = CONFIGS[name].get("no_reuse_on_rank") == rank
        expected = "6 submodules, 6 compiled, 0 running" if no_reuse else "6 submodules, 3 compiled, 3 running"
        assert any(expected in m for m in r["split"]), where
