"""FSDP2 training steps/s and bytes saved for backward: eager, stock torch.compile, dynamo-ext.

    python benchmarks/bench_fsdp_training.py [--nproc 4] [--steps 20] [--hidden 256]

On ``--nproc`` gloo ranks (torch's elastic launcher), the same 2-block model
(``tests/fsdp_training.py``; ``fully_shard`` per block + root,
``reshard_after_forward=True``) trains SGD steps four ways, one after the other
in the same processes:

- ``eager``: eager FSDP2;
- ``stock``: ``torch.compile(model, backend=--backend)`` without the plugin,
  backward eager (stock breaks the graph at FSDP2's hooks; under compiled
  autograd it leaves gradients unreduced, so it is not run that way);
- ``plugin``: the same with ``dynamo_ext.install()``, backward eager;
- ``plugin+CA``: the plugin with the backward traced by compiled autograd.

Per way it prints steps/s (median of 3 rounds after warm-up, rank 0), the
graphs compiled and recompiles after step 1, the bytes held for backward per
rank after a forward (:func:`fsdp_training.saved_bytes`), and the largest
parameter difference from eager after the steps; then the ratios
plugin/stock steps/s (target >= 1) and saved bytes plugin/eager (target <= 1.10).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import launch_on_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from fsdp_training import batch, build, saved_bytes  # noqa: E402

ROWS = 32


def _counting(counts: list[int], name: str) -> Any:
    def backend(gm: Any, example_inputs: Any) -> Any:
        counts.append(1)
        return torch._dynamo.lookup_backend(name)(gm, example_inputs)

    return backend


def _one_way(rank: int, world: int, way: str, steps: int, hidden: int, backend: str) -> dict[str, Any]:
    import dynamo_ext
    from dynamo_ext import _compat

    torch._dynamo.reset()
    plugin = way.startswith("plugin")
    if plugin:
        dynamo_ext.install()
    try:
        fwd: list[int] = []
        bwd: list[int] = []
        net = build(world, hidden=hidden, inner=2 * hidden)
        model = net if way == "eager" else torch.compile(net, backend=_counting(fwd, backend))
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)

        def step(i: int) -> None:
            loss = model(batch(rank, i, rows=ROWS, hidden=hidden)).pow(2).mean()
            if way == "plugin+CA":
                with _compat.compiled_autograd(torch.compile(backend=_counting(bwd, backend), fullgraph=True)):
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()

        step(0)
        graphs_after_first = len(fwd) + len(bwd)
        rates = []
        for r in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(steps):
                step(1 + r * steps + i)
            rates.append(steps / (time.perf_counter() - t0))
        recompiles = len(fwd) + len(bwd) - graphs_after_first
        params = [p.to_local().detach().clone() for p in net.parameters()]
        mem_net = build(world, hidden=hidden, inner=2 * hidden)
        mem_model = mem_net if way == "eager" else torch.compile(mem_net, backend=backend)
        mem = saved_bytes(mem_net, mem_model, batch(rank, 0, rows=ROWS, hidden=hidden))
        return {
            "steps/s": statistics.median(rates),
            "graphs": graphs_after_first,
            "recompiles": recompiles,
            "saved": mem,
            "params": params,
        }
    finally:
        if plugin:
            dynamo_ext.uninstall()


def _rank_main(steps: int, hidden: int, backend: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        out = {
            way: _one_way(rank, world, way, steps, hidden, backend) for way in ("eager", "stock", "plugin", "plugin+CA")
        }
        ref = out["eager"]["params"]
        for r in out.values():
            r["param_diff"] = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(ref, r["params"]))
            del r["params"]
        return out
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round (3 rounds)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--backend", default="aot_eager", help="aot_eager (FSDP2's collectives unbucketed) or inductor")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    results = launch_on_ranks(_rank_main, args.steps, args.hidden, args.backend, nproc=args.nproc)
    r0 = results[0]
    table = Table(
        title=f"FSDP2 training, {args.nproc} gloo ranks, torch {torch.__version__}, {args.backend}, hidden {args.hidden}"
    )
    for col in (
        "way",
        "steps/s (rank 0)",
        "graphs at step 1",
        "recompiles after",
        "saved bytes/rank (max)",
        "max |param - eager|",
    ):
        table.add_column(col)
    for way, r in r0.items():
        saved = max(results[k][way]["saved"] for k in results)
        diff = max(results[k][way]["param_diff"] for k in results)
        table.add_row(way, f"{r['steps/s']:.1f}", str(r["graphs"]), str(r["recompiles"]), str(saved), f"{diff:.2e}")
    console = Console()
    console.print(table)
    eager_saved = max(results[k]["eager"]["saved"] for k in results)
    for way in ("plugin", "plugin+CA"):
        speed = r0[way]["steps/s"] / r0["stock"]["steps/s"]
        mem = max(results[k][way]["saved"] for k in results) / eager_saved
        console.print(
            f"{way}: steps/s vs stock {speed:.2f}x (target >= 1.00); saved bytes vs eager {mem:.2f}x (target <= 1.10)"
        )


if __name__ == "__main__":
    main()
