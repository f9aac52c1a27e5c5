"""torchtitan 0.3.0's own Llama 3 training step on 4 gloo ranks: eager, stock ``torch.compile`` and the plugin.

``tests/titan030.py`` builds the step from torchtitan's code (its model, ``parallelize_llama``,
``ParallelDims`` for dp_shard=2 x tp=2, chunked loss, AdamW and LR scheduler, three CPU departures) and runs
it.  Each configuration trains 5 steps of 2 micro-batches with an eval pass (eager, ``no_grad``) before steps
2 and 4, eagerly, with stock ``torch.compile`` and with the plugin, from the same parameters; it compares the
losses, every gradient before clipping (type, placements, local values) and every parameter after the
optimizer step with eager's (NOTE [torchtitan 0.3.0 against eager: tolerances]), and counts graph breaks,
graphs and recompiles on every rank.

The default: the whole model compiled (``torch.compile(model)``) on torchtitan's default backend,
``spmd_types`` (TP on plain local tensors, FSDP2 over the whole dp x tp mesh): one graph for the model, no
break, no recompile over the 5 steps, where stock breaks at FSDP2's hooks.  Slow: the whole model on
``partial_dtensor`` (FSDP2 over DTensor TP; the same traced hooks, their FSDP over TP path is tested by default
in ``test_fsdp_training_gloo.py``) and torchtitan's own per-block compile on both backends (the blocks' graphs
hold no FSDP2 hook; the plugin compiles what stock compiles).

Needs torchtitan 0.3.0 and spmd_types 0.2.3 (skipped without them): ``pip install --no-deps torchtitan==0.3.0
spmd_types==0.2.3 tyro torchdata tensorboard "datasets<4.8"`` beside torch 2.15.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

pytest.importorskip("spmd_types")
pytest.importorskip("torchtitan")

import titan030  # noqa: E402  (after the skips: it is only meaningful with torchtitan)
from helpers import run_parts_on_ranks  # noqa: E402

pytestmark = pytest.mark.gloo

RUN = {"steps": 5, "accumulate": 2, "eval_every": 2}


def _compare(rank: int, world: int, *, spmd_backend: str, mode: str) -> dict[str, Any]:
    """Eager, stock and the plugin from the same parameters; what the tests read of each."""
    setup = titan030.Setup(spmd_backend=spmd_backend, mode=mode, **RUN)
    eager = titan030.run(
        rank, world, titan030.Setup(spmd_backend=spmd_backend, mode="eager", **RUN), plugin=False, start=None
    )
    out: dict[str, Any] = {"torch": torch.__version__}
    for name in ("stock", "plugin"):
        r = titan030.run(rank, world, setup, plugin=name == "plugin", start=eager["initial"])
        out[name] = {
            "breaks": r["breaks"],
            "graphs": r["graphs"],
            "recompiles": r["recompiles"],
            "mismatches": titan030.mismatches(r, eager),
            "beyond_tolerance": titan030.beyond_tolerance(titan030.errors(r, eager)),
            "same_as_stock": None,
        }
        if name == "stock":
            stock = r
        else:
            out[name]["same_as_stock"] = titan030.mismatches(r, stock) == [] and not any(
                titan030.errors(r, stock).values()
            )
    return out


PARTS = {"spmd_types_whole": functools.partial(_compare, spmd_backend="spmd_types", mode="whole")}
SLOW_PARTS = {
    "partial_dtensor_whole": functools.partial(_compare, spmd_backend="partial_dtensor", mode="whole"),
    "spmd_types_per_block": functools.partial(_compare, spmd_backend="spmd_types", mode="per_block"),
    "partial_dtensor_per_block": functools.partial(_compare, spmd_backend="partial_dtensor", mode="per_block"),
}


@pytest.fixture(scope="module")
def ranks():
    return run_parts_on_ranks(PARTS, plugin=False)


@pytest.fixture(scope="module")
def slow_ranks():
    return run_parts_on_ranks(SLOW_PARTS, plugin=False)


def _check_whole_model(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["torch"].startswith("2.15"), r["torch"]
        plugin, stock = r["plugin"], r["stock"]
        where = f"rank {rank}: plugin {plugin}, stock {stock}"
        # one graph for the model over 5 steps: the group's pass the chunked loss leaves open, the eval
        # passes and the reshard policy the loss flips after the first step neither break nor recompile
        assert plugin["breaks"] == {} and plugin["graphs"] == 1 and plugin["recompiles"] == 0, where
        assert plugin["mismatches"] == [] and plugin["beyond_tolerance"] == [], where
        # stock: FSDP2's hooks are torch._dynamo.disable'd, so the model is cut at each FSDP2 module
        assert any("skipping FSDP hooks" in k for k in stock["breaks"]) and stock["graphs"] > 1, where
        # the tolerances are stock's own distance from eager
        assert stock["mismatches"] == [] and stock["beyond_tolerance"] == [], where


def test_whole_model_spmd_types_is_one_graph_with_eager_numbers(ranks):
    _check_whole_model(ranks["spmd_types_whole"])


@pytest.mark.slow
def test_whole_model_partial_dtensor_is_one_graph_with_eager_numbers(slow_ranks):
    _check_whole_model(slow_ranks["partial_dtensor_whole"])


@pytest.mark.slow
@pytest.mark.parametrize("spmd_backend", ["spmd_types", "partial_dtensor"])
def test_per_block_compile_is_stock_to_the_bit(slow_ranks, spmd_backend):
    for rank, r in enumerate(slow_ranks[f"{spmd_backend}_per_block"]):
        plugin, stock = r["plugin"], r["stock"]
        where = f"rank {rank}: plugin {plugin}, stock {stock}"
        # torchtitan's default: each block compiled (fullgraph=True), FSDP2's hooks outside the graphs; the
        # eval passes run the compiled blocks under no_grad, a second graph of the block frame for both
        for result in (plugin, stock):
            assert result["breaks"] == {} and result["graphs"] == 2 and result["recompiles"] == 1, where
            assert result["mismatches"] == [] and result["beyond_tolerance"] == [], where
        assert plugin["same_as_stock"], where
