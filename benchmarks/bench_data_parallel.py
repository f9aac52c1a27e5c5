"""data_parallel vs DistributedDataParallel under stock torch.compile: training steps/s on gloo ranks.

    python benchmarks/bench_data_parallel.py [--nproc 4] [--steps 10] [--hidden 512] [--depth 6]
                                             [--batch 32] [--bucket-mb 1] [--backend inductor]

On ``--nproc`` gloo ranks (torch's elastic launcher), the same MLP
(``--depth`` Linear+GELU layers of width ``--hidden``, MSE loss, SGD with
momentum) trains on the same per-rank batches three ways, one after the other
in the same processes:

- ``DDP + torch.compile``: ``torch.compile(DistributedDataParallel(model,
  bucket_cap_mb=--bucket-mb), backend=--backend)`` without the plugin (stock:
  Dynamo's DDPOptimizer splits the graph at the same bucket sizes; DDP's
  hooks all-reduce during the eager backward), ``optimizer.step()`` eager;
- ``data_parallel``: ``dynamo_ext.spmd.data_parallel(step, mesh,
  bucket_cap_mb=--bucket-mb, backend=--backend)``: forward, backward and SGD
  update traced as one graph, buckets split for overlap;
- ``data_parallel, no split``: the same with ``split=False`` (one graph; the
  all-reduces still issued as the gradients are ready, but the backend sees it whole).

Per way it prints steps/s (median of 3 timed rounds of ``--steps`` steps after 2
warm-up steps, slowest rank), the all-reduces issued per step, and the largest
parameter difference from DDP after all steps; then the ratio data_parallel / DDP.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import compare_ways, launch_on_ranks, steps_per_second

WAYS = ("DDP + torch.compile", "data_parallel", "data_parallel, no split")


def _model(hidden: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(hidden, 16))


def _batch(rank: int, i: int, batch: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(batch, hidden, generator=g), torch.randn(batch, 16, generator=g)


def _count_all_reduces(run: Any) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    # DDP calls c10d::allreduce_; a functional all_reduce shows as _c10d_functional::all_reduce (and may call
    # c10d::allreduce_ inside): count the outermost kind present.
    counts = {e.key: e.count for e in prof.key_averages()}
    return counts.get("_c10d_functional::all_reduce") or counts.get("c10d::allreduce_", 0)


def _one_way(rank: int, world: int, way: str, args: argparse.Namespace) -> dict[str, Any]:
    import dynamo_ext

    torch._dynamo.reset()
    model = _model(args.hidden, args.depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    plugin = way.startswith("data_parallel")
    if plugin:
        dynamo_ext.install()
    try:
        if plugin:
            from torch.distributed.device_mesh import init_device_mesh

            from dynamo_ext.spmd import data_parallel

            def train_step(m: nn.Module, o: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                loss = F.mse_loss(m(x), y)
                loss.backward()
                o.step()
                o.zero_grad()
                return loss.detach()

            dp = data_parallel(
                train_step,
                init_device_mesh("cpu", (world,)),
                backend=args.backend,
                bucket_cap_mb=args.bucket_mb,
                split=way == "data_parallel",
            )

            def step(i: int) -> None:
                dp(model, opt, *_batch(rank, i, args.batch, args.hidden))

        else:
            from torch.nn.parallel import DistributedDataParallel

            compiled = torch.compile(DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb), backend=args.backend)

            def step(i: int) -> None:
                x, y = _batch(rank, i, args.batch, args.hidden)
                F.mse_loss(compiled(x), y).backward()
                opt.step()
                opt.zero_grad()

        step(0)
        step(1)
        rate = steps_per_second(step, args.steps, first=2)
        calls = _count_all_reduces(lambda: step(10_000))
        return {
            "steps/s": rate,
            "all-reduces": calls,
            "params": [p.detach().clone() for p in model.parameters()],
        }
    finally:
        if plugin:
            dynamo_ext.uninstall()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round (3 rounds)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket cap, both ways (MiB)")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    results = launch_on_ranks(compare_ways, _one_way, WAYS, args, nproc=args.nproc)
    r0 = results[0]
    params = sum(p.numel() for p in _model(args.hidden, args.depth).parameters())
    table = Table(
        title=(
            f"data parallel training, {args.nproc} gloo ranks, torch {torch.__version__}, {args.backend}, "
            f"MLP {args.depth}x{args.hidden} ({params / 1e6:.2f} M params), batch {args.batch}/rank, "
            f"buckets {args.bucket_mb} MiB"
        )
    )
    for col in ("way", "steps/s (slowest rank)", "all-reduces/step (rank 0)", "max |param - DDP|"):
        table.add_column(col)
    for way in WAYS:
        diff = max(results[k][way]["param_diff"] for k in results)
        table.add_row(way, f"{r0[way]['steps/s']:.2f}", str(r0[way]["all-reduces"]), f"{diff:.2e}")
    console = Console()
    console.print(table)
    base = r0[WAYS[0]]["steps/s"]
    for way in WAYS[1:]:
        console.print(f"{way}: steps/s vs DDP + torch.compile {r0[way]['steps/s'] / base:.2f}x")


if __name__ == "__main__":
    main()
