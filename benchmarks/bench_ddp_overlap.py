"""DDP compiled with the plugin's split for overlap vs DDP under stock torch.compile: training steps/s on gloo ranks.

    python benchmarks/bench_ddp_overlap.py [--nproc 4] [--steps 10] [--hidden 512] [--depth 6]
                                           [--batch 32] [--bucket-mb 1] [--backend inductor]

On ``--nproc`` gloo ranks (torch's elastic launcher), the same MLP
(``--depth`` Linear+GELU layers of width ``--hidden``, MSE loss, SGD with
momentum, ``optimizer.step()`` eager in every way) wrapped in
``DistributedDataParallel(model, bucket_cap_mb=--bucket-mb)`` trains on the
same per-rank batches four ways, one after the other in the same processes:

- ``DDPOptimizer``: stock ``torch.compile(ddp, backend=--backend)``, no plugin:
  Dynamo's DDPOptimizer splits the forward at the buckets, DDP's C++ reducer
  all-reduces from hooks during the backward;
- ``python reducer``: stock, no plugin, ``optimize_ddp="python_reducer"``:
  forward and ``loss.backward()`` in one ``torch.compile``'d function under
  compiled autograd, DDP's all-reduces traced into the one backward graph
  (Inductor's ``ddp_fusion`` buckets them);
- ``python reducer + plugin, no split``: the same with ``dynamo_ext.install()``
  and ``dynamo_ext.config.ddp_split_for_overlap = False``;
- ``python reducer + plugin split``: the same with the split for overlap
  (NOTE [split for overlap under DDP], opt-in: ``ddp_split_for_overlap = True``):
  the backward cut at DDP's buckets.

Per way it prints steps/s (median of 3 timed rounds of ``--steps`` steps after
2 warm-up steps, slowest rank), the all-reduces issued per step, and the largest parameter difference from
the first way after all steps; then each way's ratio to ``DDPOptimizer`` and
the split's ratio to the plugin without it, and the load average.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn.functional as F
from _common import compare_ways, launch_on_ranks, steps_per_second
from bench_data_parallel import _batch, _count_all_reduces, _model  # the same MLP, batches and count

WAYS = ("DDPOptimizer", "python reducer", "python reducer + plugin, no split", "python reducer + plugin split")


def _one_way(rank: int, world: int, way: str, args: argparse.Namespace) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    import dynamo_ext
    from dynamo_ext import config as ext_config

    torch._dynamo.reset()
    model = _model(args.hidden, args.depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    plugin = "plugin" in way
    if plugin:
        dynamo_ext.install()
    try:
        if way == "DDPOptimizer":
            compiled = torch.compile(DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb), backend=args.backend)

            def fwd_bwd(x: torch.Tensor, y: torch.Tensor) -> None:
                F.mse_loss(compiled(x), y).backward()

        else:
            with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
                ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
            with torch._dynamo.config.patch(compiled_autograd=True):

                @torch.compile(backend=args.backend)
                def fwd_bwd(x: torch.Tensor, y: torch.Tensor) -> None:
                    F.mse_loss(ddp(x), y).backward()

        def step(i: int) -> None:
            with ext_config.patch(ddp_split_for_overlap="no split" not in way):
                fwd_bwd(*_batch(rank, i, args.batch, args.hidden))
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
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="DDP's bucket_cap_mb, every way (MiB)")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    load_before = os.getloadavg()[0]
    results = launch_on_ranks(compare_ways, _one_way, WAYS, args, nproc=args.nproc)
    load_after = os.getloadavg()[0]
    r0 = results[0]
    params = sum(p.numel() for p in _model(args.hidden, args.depth).parameters())
    table = Table(
        title=(
            f"DDP training, {args.nproc} gloo ranks, torch {torch.__version__}, {args.backend}, "
            f"MLP {args.depth}x{args.hidden} ({params / 1e6:.2f} M params), batch {args.batch}/rank, "
            f"bucket_cap_mb {args.bucket_mb}"
        )
    )
    for col in ("way", "steps/s (slowest rank)", "all-reduces/step (rank 0)", "max |param - 1st|"):
        table.add_column(col)
    for way in WAYS:
        diff = max(results[k][way]["param_diff"] for k in results)
        row = r0[way]
        table.add_row(way, f"{row['steps/s']:.2f}", str(row["all-reduces"]), f"{diff:.2e}")
    console = Console()
    console.print(table)
    base = r0[WAYS[0]]["steps/s"]
    for way in WAYS[1:]:
        console.print(f"{way}: steps/s vs DDPOptimizer {r0[way]['steps/s'] / base:.2f}x")
    split, no_split = r0[WAYS[3]]["steps/s"], r0[WAYS[2]]["steps/s"]
    console.print(f"split / no split (both with the plugin): {split / no_split:.2f}x")
    console.print(f"load average (1 min) before / after: {load_before:.1f} / {load_after:.1f}")


if __name__ == "__main__":
    main()
