"""data_parallel on 4 gloo ranks against DistributedDataParallel: loss, gradients, parameters after 3 SGD steps.

One launch runs the three models (MLP, small transformer, conv net).  Each
rank gets its own part of one global batch; DDP gets the same parts, the same
initial weights and the same optimizer (SGD, momentum, weight decay; the
transformer's step also clips the gradients' norm in place, which must read the
averaged gradients, as after DDP's all-reduce).  Steps 2
and 3 use another batch size than step 1 and each other: with the momentum
buffers created by step 1 (a new argument structure, so a second trace),
steps 2 and 3 must run one traced graph.  The MLP runs compiled (aot_eager
per submodule, and then no Dynamo recompile for step 3's batch size); the
transformer and the conv net run the split FX graph as is, to keep the launch
short (the compiled path for them is checked on the fake process group in
tests/test_spmd_data_parallel.py).

The same launch then compiles DDP models with the plugin, with stock
DDPOptimizer and with the plugin's split for overlap of DDP's python reducer
under compiled autograd (tests/ddp_compiled.py), against eager DDP.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import CountingBackend, run_on_ranks

pytestmark = pytest.mark.gloo

KINDS = ("mlp", "transformer", "conv")
CLIP = {"transformer": 0.5}
GLOBAL_BATCHES = (16, 12, 8)  # 4, 3 and 2 samples per rank


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _compare(rank: int, world: int, kind: str) -> dict[str, object]:
    import torch.distributed as dist
    from dp_models import build, local_part, loss_fn, make_step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from dynamo_ext.spmd import data_parallel

    mesh = init_device_mesh("cpu", (world,))
    model, data = build(kind)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    counting = CountingBackend("aot_eager")
    step = data_parallel(make_step(kind, CLIP.get(kind)), mesh, backend=counting if kind == "mlp" else None)
    out: dict[str, object] = {"loss": [], "grad": [], "param": [], "grad_type": set()}
    graphs_after = []
    for i, n in enumerate(GLOBAL_BATCHES):
        x, y = (local_part(t, rank, world) for t in data(n, 100 + i))
        loss = step(model, opt, x, y)
        grads = [p.grad for p in model.parameters()]
        out["grad_type"] |= {type(g).__name__ for g in grads}
        opt.zero_grad()
        ref_loss = loss_fn(kind, ddp(x), y)
        ref_loss.backward()
        if kind in CLIP:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP[kind])
        ref_grads = [p.grad.clone() for p in ref.parameters()]
        ref_opt.step()
        ref_opt.zero_grad()
        global_ref_loss = ref_loss.detach().clone()
        dist.all_reduce(global_ref_loss)  # DDP returns the local loss; data_parallel the full-batch mean
        out["loss"].append(abs(float(loss) - float(global_ref_loss) / world))
        out["grad"].append(_max_diff(grads, ref_grads))
        out["param"].append(_max_diff(list(model.parameters()), list(ref.parameters())))
        graphs_after.append(counting.frame_count)
    out["traces"] = len(step.compiled)
    out["graphs_after_each_step"] = graphs_after
    out["buckets"] = len(step.compiled[-1].buckets)
    return out


def _all_models(rank: int, world: int) -> dict[str, dict[str, object]]:
    import ddp_compiled

    out = {kind: _compare(rank, world, kind) for kind in KINDS}
    torch._dynamo.reset()
    out["ddp_compiled"] = ddp_compiled.run(rank, world)  # last: DDP's python reducer changes process-wide config
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_all_models)


@pytest.mark.parametrize("kind", KINDS)
def test_matches_ddp_after_three_steps(results, kind):
    for rank, by_kind in enumerate(results):
        r = by_kind[kind]
        assert max(r["loss"]) < 1e-5, (rank, r["loss"])
        assert max(r["grad"]) < 1e-5, (rank, r["grad"])
        assert max(r["param"]) < 1e-5, (rank, r["param"])
        assert r["grad_type"] == {"Tensor"}


@pytest.mark.parametrize("kind", KINDS)
def test_second_batch_size_does_not_recompile(results, kind):
    for by_kind in results:
        r = by_kind[kind]
        # step 1 creates the momentum buffers (a second trace for step 2); step 3's batch size reuses step 2's graphs
        assert r["traces"] == 2
        graphs = r["graphs_after_each_step"]
        if kind == "mlp":
            assert graphs[0] > 0 and graphs[1] > graphs[0] and graphs[2] == graphs[1], graphs


@pytest.mark.parametrize("way", ["stock", "split"])
def test_compiled_ddp_matches_eager_ddp_after_three_steps(results, way):
    for rank, by_kind in enumerate(results):
        r = by_kind["ddp_compiled"][way]
        assert max(r["loss"]) < 1e-5, (rank, r["loss"])
        assert max(r["grad"]) < 1e-5, (rank, r["grad"])
        assert max(r["param"]) < 1e-5, (rank, r["param"])
        assert r["grad_type"] == [["Tensor"]] * 3


def test_ddp_optimizer_still_splits_the_forward_with_the_plugin(results):
    assert all(by_kind["ddp_compiled"]["stock"]["aot_graphs"] == 2 for by_kind in results)  # 1.5 MiB / 1 MiB


def test_ddp_split_backward_buckets_are_the_same_on_every_rank(results):
    plans = [by_kind["ddp_compiled"]["split"]["all_reduces"] for by_kind in results]
    # two buckets, each one merged all-reduce issued at the end of its submodule, the waits in the last one;
    # the same sizes in the same order on every rank, compiled once
    assert plans[0] == [([4 + 128 + 32 + 1024], 0), ([32 + 512], 0), ([], 2)], plans[0]
    assert all(p == plans[0] for p in plans)
    assert all(by_kind["ddp_compiled"]["split"]["graphs"] == 4 for by_kind in results)
