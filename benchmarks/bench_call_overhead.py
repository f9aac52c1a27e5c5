#!/usr/bin/env python3
"""CPU time per forward call outside the compiled graphs, as the model grows: plugin vs stock per-block.

What a training step pays on the host besides the graphs' own work: for the plugin's one graph,
Dynamo's guard check of the frame and the bytecode around the graph (FSDP2's traced parameter
swaps replayed, outputs rebuilt); for stock per-block compile, each block's guard check and
FSDP2's hooks, which run eagerly between the block graphs.  On a GPU this is time the host is
not launching kernels.

One process per (way, layers), a fake 4-rank process group (collectives return at once), the
bundled Llama (``benchmarks/_common.bundled_llama``: TP + FSDP2 on a (2, 2) mesh, or FSDP2 alone
with ``--fsdp-only``), the forward under ``torch.no_grad()``.  Every graph is compiled by a
backend that runs it once and then returns those outputs, so a later call costs only what is
outside the graphs.  Printed: the median of ``--calls`` calls after 3 warm-up calls, per
way and layer count, and the plugin / per-block ratio.

    python benchmarks/bench_call_overhead.py [--layers 2 8 32] [--calls 30] [--fsdp-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WAYS = ("plugin", "per-block")


def _caching_backend(gm, example_inputs):
    """Run the graph once, then hand back the same outputs: later calls cost only what is outside it."""
    outputs = []

    def run(*args):
        if not outputs:
            outputs.append(gm(*args))
        return outputs[0]

    return run


def _child(way: str, layers: int, calls: int, fsdp_only: bool) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from _common import bundled_llama
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dynamo_ext

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    if way == "plugin":
        dynamo_ext.install()
    model, _cfg, tokens = bundled_llama(layers, fsdp_only=fsdp_only)
    if way == "plugin":
        run = torch.compile(model, backend=_caching_backend)
    else:  # as bench_compile_time.py's per-block way: FSDP2's hooks stay outside the block graphs
        for block in model.layers:
            block.forward = torch.compile(block.forward, backend=_caching_backend)
        run = model
    times = []
    with torch.no_grad():
        for _ in range(3):
            run(tokens)
        for _ in range(calls):
            start = time.perf_counter()
            run(tokens)
            times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return {"ms": 1000 * statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--fsdp-only", action="store_true", help="FSDP2 alone (no TP)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        print(json.dumps(_child(ns.child[0], int(ns.child[1]), ns.calls, ns.fsdp_only)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    here = Path(__file__).resolve()
    print(f"{'layers':>6} {'plugin (ms)':>12} {'per-block (ms)':>15} {'plugin / per-block':>19}")
    for layers in ns.layers:
        row = {}
        for way in WAYS:
            cmd = [sys.executable, str(here), "--child", way, str(layers), "--calls", str(ns.calls)]
            cmd += ["--fsdp-only"] if ns.fsdp_only else []
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=here.parent, check=False)
            if proc.returncode != 0:
                sys.exit(f"{way} at {layers} layers failed:\n{proc.stderr[-3000:]}")
            row[way] = json.loads(proc.stdout.strip().splitlines()[-1])["ms"]
        print(
            f"{layers:>6} {row['plugin']:>12.2f} {row['per-block']:>15.2f} {row['plugin'] / row['per-block']:>18.2f}x"
        )


if __name__ == "__main__":
    main()
