"""Warm restarts: the first training step of the bundled Llama (TP + FSDP2) with cold and with warm caches.

    python benchmarks/bench_warm_restart.py [--ways stock plugin plugin-nocheck] [--layers 2] [--nproc 4] [--fsdp-only]

For each way, two launches on 4 gloo ranks (torch's elastic launcher, a fresh
process per rank each time): "cold" with a fresh ``TORCHINDUCTOR_CACHE_DIR``
(Inductor's FX graph cache, AOTAutograd's cache, the collective check's records),
then "warm" with the same directory, as a restarted job.  In each launch the
model (``dynamo_ext.audit.targets.example_llama``, small dims, ``--layers`` blocks, a
(2, 2) mesh) takes its first training step (forward, eager backward, AdamW
step; compilation included), timed on the slowest rank (``--fsdp-only``: FSDP2
alone on a 1-D mesh of the 4 ranks, no TP).  Ways:

- ``stock``: ``torch.compile(model)`` without the plugin;
- ``plugin``: ``dynamo_ext.install()``, then ``torch.compile(model)`` (the collective check on);
- ``plugin-nocheck``: the same with ``dynamo_ext.config.collective_check`` off (what the check costs).

Prints one table: first step cold and warm, the ratios to ``stock`` (the
target: plugin warm <= 1.1x stock warm), rank 0's AOTAutograd cache hits /
misses / bypasses in the warm launch, the loss of the step (ways must agree),
and the load average.  The figures swing with the machine's load: compare rows
of one run.  To measure another checkout of dynamo-ext, put it first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from typing import Any

from _common import bundled_llama, cold_and_warm, launch_on_ranks, llama_loss, max_over_ranks

WAYS = ("stock", "plugin", "plugin-nocheck")


def _rank_main(layers: int, way: str, backend: str, fsdp_only: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import dynamo_ext
    import dynamo_ext.config

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if way != "stock":
            dynamo_ext.install()
        dynamo_ext.config.collective_check = way != "plugin-nocheck"
        model, cfg, tokens = bundled_llama(layers, fsdp_only=fsdp_only)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        compiled = torch.compile(model, backend=backend)
        counters.clear()
        dist.barrier()
        t0 = time.perf_counter()
        loss = llama_loss(compiled, cfg, tokens)
        loss.backward()
        optim.step()
        seconds = max_over_ranks(time.perf_counter() - t0)
        aot = counters["aot_autograd"]
        return {
            "first_s": seconds,
            "loss": float(loss.detach()),
            "aot": (aot["autograd_cache_hit"], aot["autograd_cache_miss"], aot["autograd_cache_bypass"]),
        }
    finally:
        dynamo_ext.config.collective_check = True
        dynamo_ext.uninstall()
        dist.destroy_process_group()


def _launch(args: argparse.Namespace, way: str) -> dict[str, Any]:
    return launch_on_ranks(_rank_main, args.layers, way, args.backend, args.fsdp_only, nproc=args.nproc)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--ways", nargs="+", default=["stock", "plugin"], choices=WAYS)
    parser.add_argument("--fsdp-only", action="store_true", help="FSDP2 on a 1-D mesh, no TP")
    args = parser.parse_args()
    import torch

    import dynamo_ext

    rows: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    loads = [os.getloadavg()[0]]
    for way in args.ways:
        cold, warm = cold_and_warm(functools.partial(_launch, args, way), prefix="bench-warm-")
        loads.append(os.getloadavg()[0])
        rows[way] = (cold, warm)
        print(f"{way}: cold {cold}, warm {warm}", flush=True)
    print(
        f"\nBundled Llama, {args.layers} layers, {'FSDP2 on a 1-D mesh' if args.fsdp_only else 'TP + FSDP2 on a (2, 2) mesh'}, "
        f"{args.nproc} gloo ranks, "
        f"torch {torch.__version__}, {args.backend}, dynamo_ext from {os.path.dirname(dynamo_ext.__file__)}; "
        f"1-min load average {min(loads):.1f} to {max(loads):.1f}\n"
    )
    print(
        "| way | first step cold (s) | first step warm (s) | warm / cold | cold vs stock | warm vs stock "
        "| warm AOTAutograd cache hit / miss / bypass (rank 0) | loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    stock = rows.get("stock")
    for way, (cold, warm) in rows.items():
        vs = [
            f"{run['first_s'] / ref['first_s']:.2f}x" if stock else "-" for run, ref in zip((cold, warm), stock or ())
        ]
        print(
            f"| {way} | {cold['first_s']:.1f} | {warm['first_s']:.1f} | {warm['first_s'] / cold['first_s']:.2f} "
            f"| {' | '.join(vs or ['-', '-'])} | {' / '.join(map(str, warm['aot']))} | {warm['loss']:.6f} |"
        )


if __name__ == "__main__":
    main()
