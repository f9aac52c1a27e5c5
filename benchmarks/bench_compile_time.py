"""Compile cost of the bundled Llama on gloo ranks: time to the first training step and the steady step time.

    python benchmarks/bench_compile_time.py [--layers 2 8] [--ways ...] [--backwards eager CA] [--cold-only]
        [--fsdp-only] [--steps 3] [--nproc 4] [--backend inductor]
    python benchmarks/bench_compile_time.py --quick      # 2 layers, eager backward, cold, per-block vs plugin

The model is ``dynamo_ext.audit.targets.example_llama`` (dim 64, 4 heads, seq 16,
batch 2) with ``--layers`` blocks, TP + FSDP2 on a (2, nproc/2) mesh (``--fsdp-only``:
FSDP2 alone on a 1-D mesh).  For each number of layers, way and backward, two
launches on ``--nproc`` gloo ranks (torch's elastic launcher, fresh processes):
"cold" with a fresh ``TORCHINDUCTOR_CACHE_DIR`` (Inductor's FX graph cache,
AOTAutograd's cache, the collective check's records), then "warm" with the same
directory, as a restarted job.  In each launch the model takes a first training
step (forward, backward, AdamW step: compilation included), then ``--steps``
timed steps; each figure is the slowest rank's.

Ways:

- ``stock``: ``torch.compile(model)`` without the plugin (Dynamo breaks at each FSDP2 block);
- ``per-block``: stock ``torch.compile`` on each block (torchtitan's way; FSDP2's hooks
  stay eager around the compiled blocks): the reference of the ratios;
- ``plugin``: ``dynamo_ext.install()``, ``torch.compile(model)``: one Dynamo graph, the first of identical
  blocks traced and the others stamped from it (``dynamo_ext.config.trace_blocks_once``), each distinct block
  compiled once (``dynamo_ext.config.compile_blocks_once``); the defaults, docs/compile_time.md;
- ``plugin-traced``: the same with ``trace_blocks_once`` off: Dynamo traces every block;
- ``plugin-whole``: the same with ``compile_blocks_once`` off: the one graph compiled whole;
- ``plugin+reuse``: ``plugin-whole`` with ``dynamo_ext.config.block_reuse`` on (docs/compile_time.md);
- ``plugin-per-block``: ``dynamo_ext.install()``, then ``torch.compile`` on each block as ``per-block``:
  a graph per block (the plugin's lowerings and collective check on TP's collectives), FSDP2's
  hooks eager between them (docs/compile_time.md, "Deep models today").

Backwards: ``eager`` (the autograd engine) and ``CA`` (compiled autograd).  ``CA``
runs for ``plugin`` and ``plugin-traced`` only: stock torch under compiled autograd leaves FSDP2's gradients
unreduced (wrong numbers, not worth timing), and block reuse refuses compiled autograd
with an error.

Prints one table: first step cold and warm, the median step, each as a ratio to
``per-block`` with the eager backward at the same number of layers (``plugin`` /
``per-block``), the loss after the steps (the ways should agree to a few digits) and
the load average.  32 layers: ``--layers 32`` (long on a CPU: the plugin traces every
layer).  To measure another checkout of dynamo-ext, put it first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

from _common import bundled_llama, cold_and_warm, launch_on_ranks, llama_loss, max_over_ranks

WAYS = ("stock", "per-block", "plugin", "plugin-traced", "plugin-whole", "plugin+reuse", "plugin-per-block")
BACKWARDS = ("eager", "CA")
REFERENCE = "per-block"


def _rank_main(layers: int, way: str, backward: str, steps: int, backend: str, fsdp_only: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import dynamo_ext
    import dynamo_ext.config
    from dynamo_ext.audit.targets import example_llama as ex

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if way.startswith("plugin"):
            dynamo_ext.install()
        dynamo_ext.config.block_reuse = way == "plugin+reuse"
        dynamo_ext.config.compile_blocks_once = way in ("plugin", "plugin-traced")
        dynamo_ext.config.trace_blocks_once = way == "plugin"
        model, cfg, tokens = bundled_llama(layers, fsdp_only=fsdp_only)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if way.endswith("per-block"):
            for block in model.layers:  # FSDP2's hooks stay outside, as torchtitan's compile-then-shard order gives
                block.forward = torch.compile(block.forward, backend=backend)
            compiled = model
        else:
            compiled = torch.compile(model, backend=backend)

        def step() -> float:
            loss = llama_loss(compiled, cfg, tokens)
            with ex.compiled_backward(backend, enabled=backward == "CA"):
                loss.backward()
            optim.step()
            optim.zero_grad()
            return float(loss.detach())

        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        first = max_over_ranks(time.perf_counter() - t0)
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            loss = step()
            times.append(max_over_ranks(time.perf_counter() - t0))
        return {"first_s": first, "step_s": statistics.median(times) if times else float("nan"), "loss": loss}
    finally:
        dynamo_ext.config.block_reuse = False
        dynamo_ext.config.compile_blocks_once = True
        dynamo_ext.config.trace_blocks_once = True
        dynamo_ext.uninstall()
        dist.destroy_process_group()


def _launch(args: argparse.Namespace, layers: int, way: str, backward: str) -> dict[str, Any]:
    args_ = (layers, way, backward, args.steps, args.backend, args.fsdp_only)
    return launch_on_ranks(_rank_main, *args_, nproc=args.nproc)[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); ``--quick`` overrides layers, ways, backwards and caches."""
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Time to the first training step (compile included) and steady step time of the bundled "
        "Llama on gloo ranks, cold and warm caches: stock torch.compile, stock per-block compile, the plugin "
        "(blocks compiled once, or the graph whole), the plugin with block reuse, the plugin with per-block compile.",
        epilog="Ratios are to per-block with the eager backward at the same number of layers. CA (compiled "
        "autograd) runs for the plugin only: stock leaves FSDP2's gradients unreduced under it and block reuse "
        "refuses it.",
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8], help="blocks of the model (32: long)")
    parser.add_argument(
        "--ways",
        nargs="+",
        default=list(WAYS),
        choices=WAYS,
        help="stock: torch.compile(model); per-block: torch.compile on each block's forward; plugin: "
        "dynamo_ext.install() then torch.compile(model), each distinct block compiled once; plugin-whole: the "
        "one graph compiled whole (config.compile_blocks_once off); plugin+reuse: plugin-whole with "
        "config.block_reuse on",
    )
    parser.add_argument(
        "--backwards",
        nargs="+",
        default=list(BACKWARDS),
        choices=BACKWARDS,
        help="eager: the autograd engine; CA: compiled autograd (plugin only)",
    )
    parser.add_argument("--cold-only", action="store_true", help="skip the warm launch (a restart on the cache)")
    parser.add_argument("--fsdp-only", action="store_true", help="FSDP2 on a 1-D mesh, no TP")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first (median reported)")
    parser.add_argument("--nproc", type=int, default=4, help="gloo ranks (even: the TP mesh is (2, nproc/2))")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of every way")
    parser.add_argument(
        "--quick", action="store_true", help="2 layers, eager backward, cold only, 1 step, per-block and plugin"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.ways, args.backwards = [2], [REFERENCE, "plugin"], ["eager"]
        args.cold_only, args.steps = True, 1
    if args.nproc % 2 and not args.fsdp_only:
        parser.error(f"--nproc {args.nproc}: TP + FSDP2 needs an even number of ranks (or pass --fsdp-only)")
    return args


def _ratio(value: float | None, ref: float | None) -> str:
    return f"{value / ref:.2f}x" if value is not None and ref else "-"


def main() -> None:
    args = parse_args()
    import torch

    import dynamo_ext

    rows = []
    loads = [os.getloadavg()[0]]
    for layers in args.layers:
        for way in args.ways:
            for backward in args.backwards:
                if backward == "CA" and way not in (
                    "plugin",
                    "plugin-traced",
                ):  # stock: unreduced gradients; reuse: refused
                    continue
                launch = functools.partial(_launch, args, layers, way, backward)
                cold, warm = cold_and_warm(launch, prefix="bench-compile-", warm=not args.cold_only)
                loads.append(os.getloadavg()[0])
                rows.append((layers, way, backward, cold, warm))
                print(f"{layers} layers, {way}, {backward}: cold {cold}, warm {warm}", flush=True)
    layout = "FSDP2 on a 1-D mesh" if args.fsdp_only else f"TP + FSDP2 on a (2, {args.nproc // 2}) mesh"
    print(
        f"\nBundled Llama, {layout}, {args.nproc} gloo ranks, torch {torch.__version__}, {args.backend}, "
        f"dynamo_ext from {os.path.dirname(dynamo_ext.__file__)}; 1-min load average {min(loads):.1f} to "
        f"{max(loads):.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
    )
    print(
        "| layers | way | backward | first step cold (s) | first step warm (s) | step (s) "
        f"| vs {REFERENCE}: cold / warm / step | loss after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ref = {r[0]: r for r in rows if r[1] == REFERENCE and r[2] == "eager"}
    for layers, way, backward, cold, warm in rows:
        base = ref.get(layers)
        ratios = " / ".join(
            [
                _ratio(cold["first_s"], base and base[3]["first_s"]),
                _ratio(warm and warm["first_s"], base and base[4] and base[4]["first_s"]),
                _ratio(cold["step_s"], base and base[3]["step_s"]),
            ]
        )
        warm_s = f"{warm['first_s']:.1f}" if warm else "-"
        print(
            f"| {layers} | {way} | {backward} | {cold['first_s']:.1f} | {warm_s} | {cold['step_s']:.3f} "
            f"| {ratios} | {cold['loss']:.5f} |"
        )


if __name__ == "__main__":
    main()
