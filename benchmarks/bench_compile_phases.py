#!/usr/bin/env python3
"""Where the first step's compile time goes, per phase, as the model grows: plugin vs stock.

One process per (way, layers), a fake 4-rank process group (collectives return
garbage fast: only compilation is measured, no communication), the bundled Llama
(``benchmarks/_common.bundled_llama``: TP + FSDP2 on a (2, 2) mesh, or FSDP2 alone
with ``--fsdp-only``), a fresh ``TORCHINDUCTOR_CACHE_DIR`` (cold caches).  The first
training step (forward, loss, backward with the eager autograd engine) is timed, and
torch's own compile-time counters (``torch._dynamo.utils.compile_times``, summed
over every graph of the step) split it into:

- Dynamo: bytecode tracing (``bytecode_tracing``) and guard building (``build_guards``);
- AOTAutograd: metadata, joint-graph trace and partition (``aot_collect_metadata``,
  ``aot_trace_joint_graph``, ``min_cut_rematerialization_partition``);
- Inductor: ``compile_fx_inner`` of every forward and backward graph (0 with ``aot_eager``), and of
  that the C++ compiles of its kernels (``compile_file``; on the CPU, one per stretch of kernels between
  two extern calls).

``--backward CA`` runs the backward under compiled autograd (its capture is in ``backward`` only; its
Dynamo, AOTAutograd and Inductor time in those columns).

The last column is the growth per added layer (seconds, from the smallest to the largest
layer count): what the one-graph design pays per block, where stock per-block compile pays
about nothing after the first block.

    python benchmarks/bench_compile_phases.py [--layers 2 8] [--backend aot_eager|inductor]
        [--ways plugin plugin-whole stock per-block] [--fsdp-only] [--backward eager|CA]

Ways: ``plugin`` (the default: one Dynamo graph, each distinct block compiled once), ``plugin-whole``
(``dynamo_ext.config.compile_blocks_once`` off: the graph compiled whole), ``stock`` (``torch.compile(model)``),
``per-block`` (stock ``torch.compile`` on each block).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAYS = ("plugin", "plugin-whole", "stock", "per-block")
PHASES = {
    "dynamo": ("bytecode_tracing", "build_guards"),
    "aot": ("aot_collect_metadata", "aot_trace_joint_graph", "min_cut_rematerialization_partition"),
    "inductor": ("compile_fx_inner",),
    "cpp": ("compile_file",),
}


def _child(way: str, layers: int, backend: str, fsdp_only: bool, backward: str) -> dict[str, float]:
    """Run one first step in this process; return its wall times and phase seconds."""
    import torch
    import torch.distributed as dist
    from _common import bundled_llama, llama_loss
    from torch._dynamo.utils import compile_times
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dynamo_ext
    from dynamo_ext.audit.targets import example_llama as ex

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    if way.startswith("plugin"):
        dynamo_ext.install()
        dynamo_ext.config.compile_blocks_once = way == "plugin"
    model, cfg, tokens = bundled_llama(layers, fsdp_only=fsdp_only)
    if way == "per-block":
        for block in model.layers:
            block.compile(backend=backend)
        run = model
    else:
        run = torch.compile(model, backend=backend)
    t0 = time.perf_counter()
    loss = llama_loss(run, cfg, tokens)
    t1 = time.perf_counter()
    with ex.compiled_backward(backend, enabled=backward == "CA"):
        loss.backward()
    wall = time.perf_counter() - t0
    headers, values = compile_times(repr="csv", aggregate=True)
    metrics = {h: float(v) for h, v in zip(headers, values)}
    out = {"first_step": wall, "forward": t1 - t0, "backward": wall - (t1 - t0)}
    out.update({phase: sum(metrics.get(k, 0.0) for k in keys) for phase, keys in PHASES.items()})
    dist.destroy_process_group()
    return out


def _run_child(way: str, layers: int, backend: str, fsdp_only: bool, backward: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-phases-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
        argv = [sys.executable, __file__, "--child", way, str(layers), backend, "--backward", backward]
        argv += ["--fsdp-only"] if fsdp_only else []
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{way} at {layers} layers failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"))
    p.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    p.add_argument("--fsdp-only", action="store_true", help="FSDP2 alone on 4 ranks instead of TP + FSDP2")
    p.add_argument(
        "--backward", default="eager", choices=("eager", "CA"), help="the autograd engine, or compiled autograd"
    )
    p.add_argument("--child", nargs=3, metavar=("WAY", "LAYERS", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        way, layers, backend = args.child
        print(json.dumps(_child(way, int(layers), backend, args.fsdp_only, args.backward)))
        return 0

    if args.backward == "CA" and not all(w.startswith("plugin") for w in args.ways):
        p.error(
            "--backward CA runs the plugin's ways only: stock under compiled autograd leaves FSDP2's gradients unreduced"
        )
    layers = sorted(set(args.layers))
    print(
        f"torch compile phases, backend={args.backend}, {'FSDP2' if args.fsdp_only else 'TP + FSDP2'}, "
        f"{args.backward} backward, fake 4-rank group, cold caches, load {os.getloadavg()[0]:.1f}"
    )
    cols = ("first_step", "forward", "backward", *PHASES)
    print(f"{'way':<12} {'layers':>6} " + " ".join(f"{c + ' (s)':>15}" for c in cols))
    for way in args.ways:
        rows = {n: _run_child(way, n, args.backend, args.fsdp_only, args.backward) for n in layers}
        for n, r in rows.items():
            print(f"{way:<12} {n:>6} " + " ".join(f"{r[c]:>15.2f}" for c in cols))
        if len(layers) > 1:
            lo, hi = layers[0], layers[-1]
            per = {c: (rows[hi][c] - rows[lo][c]) / (hi - lo) for c in cols}
            print(f"{way:<12} {'+1':>6} " + " ".join(f"{per[c]:>15.2f}" for c in cols) + "   (per added layer)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
