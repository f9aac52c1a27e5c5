"""DDP compiled with the plugin, two ways, against eager DDP on the calling rank (run in a gloo launch).

* stock DDPOptimizer (``optimize_ddp`` left at its default): ``torch.compile(ddp)``
  with the plugin installed; the model holds more than DDPOptimizer's 1 MiB
  first bucket, so the forward is split;
* DDP's python reducer under compiled autograd, with the plugin's split for
  overlap of the backward (NOTE [split for overlap under DDP]); the compiled
  backward submodules' all-reduce sizes and wait counts are returned, to check
  that every rank issues the same buckets in the same order.

Each against an eager ``DistributedDataParallel`` with the same initial weights,
data and optimizer (SGD with momentum and weight decay), 3 steps; both compile
with ``aot_eager`` to keep the launch short.  Run last in a launch: DDP's python
reducer changes Inductor's config and Dynamo's inline list for the process.
"""

from __future__ import annotations

import copy

import torch
from helpers import CountingBackend

GLOBAL_BATCH = 16
CAP_BYTES = 4000  # the small MLP's gradients make two buckets under this cap (tests/test_ddp_overlap.py)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _train(rank: int, world: int, model, step, ref_ddp, data) -> dict[str, list[float]]:
    """3 SGD steps of ``step`` (compiled DDP over ``model``) and of eager ``ref_ddp``; the differences per step."""
    from dp_models import local_part, loss_fn

    ref = ref_ddp.module
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    out: dict[str, list[float]] = {"loss": [], "grad": [], "param": [], "grad_type": []}
    for i in range(3):
        x, y = (local_part(t, rank, world) for t in data(GLOBAL_BATCH, 100 + i))
        loss = step(x, y)
        grads = [p.grad.clone() for p in model.parameters()]
        out["grad_type"].append(sorted({type(p.grad).__name__ for p in model.parameters()}))
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn("mlp", ref_ddp(x), y)
        ref_loss.backward()
        ref_grads = [p.grad.clone() for p in ref.parameters()]
        ref_opt.step()
        ref_opt.zero_grad()
        out["loss"].append(abs(float(loss) - float(ref_loss)))
        out["grad"].append(_max_diff(grads, ref_grads))
        out["param"].append(_max_diff(list(model.parameters()), list(ref.parameters())))
    return out


def run(rank: int, world: int) -> dict[str, object]:
    """Both ways on this rank: ``{"stock": ..., "split": ...}``, each the per-step differences from eager DDP."""
    from dp_models import build, compiled_autograd_step, loss_fn
    from torch.nn.parallel import DistributedDataParallel

    from dynamo_ext import _compat, config

    c10d = torch.ops._c10d_functional
    # 1. stock DDPOptimizer, plugin installed: 1.5 MiB of parameters over 1 MiB buckets
    model, data = build("mlp", scale=16)
    ref_ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1)
    compiled = torch.compile(DistributedDataParallel(model, bucket_cap_mb=1), backend="aot_eager")
    aot_graphs = _compat.dynamo_counters()["aot_autograd"]["total"]

    def stock_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn("mlp", compiled(x), y)
        loss.backward()
        return loss

    stock = _train(rank, world, model, stock_step, ref_ddp, data)
    # DDPOptimizer hands each piece of the forward to the backend (a copy of it): count AOTAutograd's compiles
    stock["aot_graphs"] = _compat.dynamo_counters()["aot_autograd"]["total"] - aot_graphs
    # 2. the python reducer under compiled autograd, the plugin's split of the backward
    torch._dynamo.reset()
    model, data = build("mlp")
    ref_ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=CAP_BYTES / 2**20)  # C++ reducer
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"), config.patch(ddp_split_for_overlap=True):
        ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_BYTES / 2**20)
        counting = CountingBackend("aot_eager")
        split = _train(rank, world, model, compiled_autograd_step(ddp, "mlp", counting), ref_ddp, data)
    split["graphs"] = counting.frame_count
    split["all_reduces"] = [  # per compiled backward submodule: (numel of each all-reduce, waits)
        (
            [n.args[0].meta["example_value"].numel() for n in gm.graph.nodes if n.target is c10d.all_reduce.default],
            sum(n.target in (c10d.wait_tensor, c10d.wait_tensor.default) for n in gm.graph.nodes),
        )
        for gm in counting.graphs[1:]
    ]
    return {"stock": stock, "split": split}
