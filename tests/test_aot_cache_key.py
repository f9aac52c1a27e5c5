"""AOTAutograd's cache key of a graph with ``DeviceMesh`` inputs: the same in every launch, another for another mesh.

NOTE [device meshes in the cache key] (``dynamo_ext/aot_cache_key.py``): the
cache picklers store a mesh without the ``hash()`` it caches, which string-hash
randomization makes differ between processes.  A restart is two processes here
(different ``PYTHONHASHSEED``s, one cache directory, a fake 4-rank group each);
the gloo restart of TP + FSDP2 is in test_warm_restart_fsdp_gloo.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from dynamo_ext import _compat


def _key_bytes(mesh) -> bytes:
    """What the cache pickler writes for ``mesh`` (not in fast mode: torch leaves it for opaque inputs)."""
    pickler = _compat.cache_key_pickler_class()(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
    pickler.fast = False
    return pickler.dumps(mesh)


def test_mesh_key_leaves_out_the_hash_a_process_cached(world):
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    hash(tp)  # DTensor hashes the sub-meshes it propagates shardings over
    seen = set()
    for per_process in (hash(tp), 12345, -6789, None):  # what another PYTHONHASHSEED would have cached
        tp._hash = per_process
        seen.add(_key_bytes(tp))
    assert len(seen) == 1


def test_mesh_key_differs_for_another_mesh(world):
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    meshes = {
        "(2, 2) dp, tp": dp_tp,
        "(2, 2) dp, tp, its own groups": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
        "(2, 2) tp, dp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp")),
        "(4, 1) dp, tp": init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp")),
        "(2, 2) x, y": init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y")),
        "(4,)": init_device_mesh("cpu", (4,)),
    }
    subs = {f"{name}['tp']": m["tp"] for name, m in meshes.items() if m.mesh_dim_names and "tp" in m.mesh_dim_names}
    subs["(2, 2) dp, tp['dp']"] = dp_tp["dp"]
    keys = {name: _key_bytes(m) for name, m in {**meshes, **subs}.items()}
    same = [(a, b) for a in keys for b in keys if a < b and keys[a] == keys[b]]
    assert not same, f"meshes with the same cache key: {same}"


def test_uninstall_gives_torch_its_reducer_back(plugin):
    cls = _compat.cache_key_pickler_class()
    torchs = cls.__dict__["reducer_override"].__wrapped__  # functools.wraps of torch's, by the plugin
    plugin.uninstall()
    assert cls.__dict__["reducer_override"] is torchs


def _launch(cache_dir: str, seed: int) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, PYTHONHASHSEED=str(seed), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # not run by default: test_warm_restart_fsdp_gloo.py asserts the same hit (CONTRIBUTING.md)
def test_tp_graph_hits_the_aot_cache_in_a_new_process(tmp_path):
    cold = _launch(str(tmp_path), seed=1)
    warm = _launch(str(tmp_path), seed=2)
    # One AOTAutograd compile per submodule the block split makes (NOTE [blocks compiled once]: the two Linears
    # have the same ops, so the Sequential's items are cut apart), each a miss cold and a hit warm.
    hits, misses, bypasses = cold["aot"]
    assert hits == 0 and misses >= 1 and bypasses == 0, cold
    assert warm["aot"] == [misses, 0, 0], warm  # every graph a hit, no miss, no bypass
    torch.testing.assert_close(torch.tensor(warm["out"]), torch.tensor(cold["out"]))  # fake collectives: identity


def _tp_first_step() -> dict:
    """One process of a launch: a column- then row-wise parallel MLP on the ``tp`` axis of a (2, 2) mesh, compiled
    with Inductor, forward and backward; AOTAutograd's cache hits / misses / bypasses and the output."""
    from helpers import fake_world
    from torch._dynamo.utils import counters
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import dynamo_ext

    torch.set_num_threads(1)
    with fake_world(4):
        dynamo_ext.install()
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        with (
            torch._functorch.config.patch(enable_autograd_cache=True),
            torch._inductor.config.patch(fx_graph_cache=True),
        ):
            out = torch.compile(model, backend="inductor", fullgraph=True)(torch.ones(4, 8))
            out.sum().backward()
        aot = counters["aot_autograd"]
        dynamo_ext.uninstall()
    return {
        "aot": [aot["autograd_cache_hit"], aot["autograd_cache_miss"], aot["autograd_cache_bypass"]],
        "out": out.tolist(),
    }


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(_tp_first_step()))
