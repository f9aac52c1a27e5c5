"""data_parallel with the common classification losses on 4 gloo ranks against DistributedDataParallel.

``F.cross_entropy`` and ``F.nll_loss`` (mean and sum, ``ignore_index``, label
smoothing, class weights, all three together, per-position labels through
``nll_loss2d``) and an MSE against ``F.one_hot`` labels: loss, gradients and
parameters after 3 SGD-momentum steps (4, 3 and 2 samples per rank, every
other label the ignored class) within 1e-5 of DDP's.  DTensor's rules for
these ops communicate on some releases (2.15's mean ``nll_loss_forward``
gathers the batch; ``one_hot``'s label check), where DDP computes each rank's
value from its own samples: NOTE [local rules] in ``dynamo_ext/spmd/local_rules.py``.

One launch, one part per loss.  The plain cross-entropy step is compiled with
Inductor (data_parallel's default) and the combined options with
``aot_eager``; the others run the split FX graph as is (the analysis and the
all-reduces are the same whatever the backend).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from dp_models import CLASSIFICATION_LOSSES
from helpers import run_parts_on_ranks

pytestmark = pytest.mark.gloo

GLOBAL_BATCHES = (16, 12, 8)  # 4, 3 and 2 samples per rank
BACKENDS = {
    "cross_entropy": "inductor",
    "cross_entropy_weights_ignore_smoothing": "aot_eager",
    "mse_one_hot": "aot_eager",
}


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _compare(rank: int, world: int, loss_name: str) -> dict[str, object]:
    import torch.distributed as dist
    from dp_models import CLASSES, MLP, classification_data, classification_loss, local_part
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from dynamo_ext.spmd import data_parallel

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = MLP(16, 32, CLASSES)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def step(model, opt, x, y):
        loss = classification_loss(loss_name, model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    dp_step = data_parallel(step, mesh, backend=BACKENDS.get(loss_name))
    out: dict[str, list[float]] = {"loss": [], "grad": [], "param": []}
    for i, n in enumerate(GLOBAL_BATCHES):
        x, y = (local_part(t, rank, world) for t in classification_data(n, 200 + i))
        loss = dp_step(model, opt, x, y)
        grads = [p.grad for p in model.parameters()]
        opt.zero_grad()
        ref_loss = classification_loss(loss_name, ddp(x), y)
        ref_loss.backward()
        ref_grads = [p.grad.clone() for p in ref.parameters()]
        ref_opt.step()
        ref_opt.zero_grad()
        want = ref_loss.detach().clone()
        # DDP returns the local loss; data_parallel the full-batch value: the ranks' mean loss, or summed loss
        dist.all_reduce(want)
        out["loss"].append(abs(float(loss) - float(want) / (1 if loss_name.endswith("_sum") else world)))
        out["grad"].append(_max_diff(grads, ref_grads))
        out["param"].append(_max_diff(list(model.parameters()), list(ref.parameters())))
    return {**out, "traces": len(dp_step.compiled)}


@pytest.fixture(scope="module")
def ranks():
    return run_parts_on_ranks({name: functools.partial(_compare, loss_name=name) for name in CLASSIFICATION_LOSSES})


@pytest.mark.parametrize("loss_name", CLASSIFICATION_LOSSES)
def test_classification_loss_step_equals_ddp(ranks, loss_name):
    for rank, r in enumerate(ranks[loss_name]):
        for what in ("loss", "grad", "param"):
            assert len(r[what]) == 3 and max(r[what]) < 1e-5, (rank, what, r[what])
        assert r["traces"] == 2, r["traces"]  # the momentum buffers exist from step 2 on; steps 2 and 3 share one
