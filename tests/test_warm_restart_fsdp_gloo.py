"""FSDP2 (alone, and over TP) trained from AOTAutograd's cache (a warm restart) matches eager, on 4 gloo ranks.

Two launches share one cache directory: the first compiles (cold), the second
is the restarted job (warm; a new process, so the process groups get the same
names as in the first launch, which the graphs and the cache key hold).

The plugin traces FSDP2's all-gather as an ``autograd.Function`` of its own,
which AOTAutograd's cache serves only by NOTE [our autograd functions in
AOTAutograd's cache]; this checks the graphs it serves give eager's losses,
gradients (type, placement, local values) and parameters after several
optimizer steps, with the collective check on.  FSDP2 over TP on a (2, 2) mesh
has sub-meshes among the graph's inputs, whose cache key is stable across
launches only by NOTE [device meshes in the cache key].
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from fsdp_training import build, diff, train
from helpers import run_on_ranks

pytestmark = pytest.mark.gloo  # two 4-process launches (cold, warm), each an eager and a compiled training

# FSDP2 nested on a 1-D mesh; FSDP2 over TP (column- then row-wise in each block) on a (2, 2) mesh.
CONFIGS = {"fsdp": {"steps": 3}, "fsdp+tp": {"steps": 3, "tp": True}}
TOL = 1e-5


def _rank(rank: int, world: int, cache_dir: str, config: dict[str, Any]) -> dict[str, Any]:
    """Eager training, then compiled training (compile included) with the shared cache directory; AOTAutograd's
    cache hits, misses and bypasses, and why it bypassed (its INFO lines)."""
    import logging

    from torch._dynamo.utils import counters

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch._functorch.config.enable_autograd_cache = True
    torch._inductor.config.fx_graph_cache = True
    net = build(world, **config)
    eager = train(net, net, rank, **config)
    counters.clear()
    bypasses: list[str] = []

    class _Bypasses(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "Bypassing autograd cache" in record.getMessage():
                bypasses.append(record.getMessage()[:2000])

    logger = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    handler, level = _Bypasses(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        net = build(world, **config)
        compiled = train(net, torch.compile(net, backend="inductor", fullgraph=True), rank, **config)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    aot = counters["aot_autograd"]
    cache = (aot["autograd_cache_hit"], aot["autograd_cache_miss"], aot["autograd_cache_bypass"])
    return {**diff(eager, compiled), "cache": cache, "bypasses": bypasses}


# Both slow (out of CI).  FSDP over TP alone passes (2.13 and 2.15, fresh venvs too), but in a whole default-suite
# run on 2.13 and 2.15 its cold launch bypasses AOTAutograd's cache three times ("Can't cache HigherOrderOperator:
# autograd_function_apply"): dynamo_ext.aot_cache_policy._ours does not take the FSDP2 all-gather in the body of
# the plugin's gather function (variables/fsdp/reduce.py) for the plugin's own there, so the graphs are compiled
# again on a restart (no wrong number: the losses, gradients and parameters still equal eager's).  Which earlier
# test changes that in the rank processes is not found yet; the assertion prints the bypass reasons.
@pytest.fixture(scope="module", params=[pytest.param(c, marks=pytest.mark.slow) for c in ("fsdp", "fsdp+tp")])
def results(request, tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("inductor_cache"))
    return {launch: run_on_ranks(_rank, cache_dir, CONFIGS[request.param], nproc=4) for launch in ("cold", "warm")}


def test_warm_fsdp2_graph_comes_from_the_aot_cache(results):
    for rank in range(4):
        cold, warm = results["cold"][rank]["cache"], results["warm"][rank]["cache"]
        why = {launch: results[launch][rank]["bypasses"] for launch in ("cold", "warm")}
        assert cold[0] == 0 and cold[1] >= 1 and cold[2] == 0, (rank, cold, why)
        assert warm[0] >= 1 and warm[1] == 0 and warm[2] == 0, (rank, warm, why)


@pytest.mark.parametrize("launch", ["cold", "warm"])
def test_fsdp2_from_the_cache_matches_eager(results, launch):
    for rank, d in enumerate(results[launch]):
        where = f"rank {rank}, {launch}: {d}"
        assert d["grad_kinds_match"] and all(kind == "DTensor" for kind, _ in d["grad_kinds"]), where
        assert d["loss"] <= TOL and d["grads"] <= TOL and d["params"] <= TOL, where
