"""Compile cost of the bundled Llama (TP + FSDP2, (2, 2) mesh): time to the first step and steady step time.

    python benchmarks/bench_compile_time.py [--layers 2 8] [--nproc 4] [--steps 3] [--ways ...] [--fsdp-only]

For each number of layers, each way and each backward, two launches on 4 gloo
ranks (torch's elastic launcher): "cold" with a fresh ``TORCHINDUCTOR_CACHE_DIR``
(Inductor's FX graph cache, AOTAutograd's cache), then "warm" with the same
directory (a restart).  In each launch the model
(``dynamo_ext.audit.example_llama``, small dims, ``--layers`` blocks) takes a
first training step (forward, backward, AdamW step: compile included), then
``--steps`` timed steps.  Figures are the slowest rank's.  Ways:

- ``stock``: ``torch.compile(model)`` without the plugin (breaks at each FSDP2 block);
- ``per-block``: stock ``torch.compile`` on each block's ``forward`` (torchtitan's
  way; FSDP2's hooks stay eager around the compiled blocks);
- ``plugin``: ``dynamo_ext.install()``, ``torch.compile(model)``: one graph;
- ``plugin+reuse``: the same with ``dynamo_ext.config.block_reuse`` on (NOTE [block reuse]).

Backwards: ``eager`` (the autograd engine) and ``CA`` (compiled autograd, ``plugin``
only: stock under compiled autograd leaves FSDP2's gradients unreduced, and block
reuse refuses it, NOTE [block reuse under compiled autograd]).
``--cold-only`` skips the warm launch (its column then repeats the cold figure).
``--fsdp-only`` shards with FSDP2 alone on a 1-D mesh (no TP), where the blocks'
compute is plain tensors.  Prints one table with the ratios to ``stock`` (eager
backward) and the loss after the steps (every way must agree).  32 layers:
``--layers 32`` (long on a CPU: the plugin traces every layer).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from _common import launch_on_ranks

WAYS = ("stock", "per-block", "plugin", "plugin+reuse")
BACKWARDS = ("eager", "CA")


def _rank_main(layers: int, way: str, backward: str, steps: int, backend: str, fsdp_only: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812

    import dynamo_ext
    import dynamo_ext.config
    from dynamo_ext.audit import example_llama as ex

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        plugin = way.startswith("plugin")
        if plugin:
            dynamo_ext.install()
        dynamo_ext.config.block_reuse = way == "plugin+reuse"
        cfg = ex.Config(n_layers=layers)
        torch.manual_seed(0)
        model, dp_rank = _parallel_model(ex, cfg, fsdp_only)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if way == "per-block":
            for block in model.layers:
                block.forward = torch.compile(block.forward, backend=backend)
            compiled = model
        else:
            compiled = torch.compile(model, backend=backend)
        gen = torch.Generator().manual_seed(1234 + dp_rank)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)

        def step() -> float:
            logits = compiled(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
            with ex.compiled_backward(backend, enabled=backward == "CA"):
                loss.backward()
            optim.step()
            optim.zero_grad()
            return float(loss.detach())

        dist.barrier()
        first = _slowest(step)
        times, loss = [], 0.0
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            loss = step()
            times.append(_max_over_ranks(time.perf_counter() - t0))
        return {"first_s": first, "step_s": statistics.median(times) if times else float("nan"), "loss": loss}
    finally:
        dynamo_ext.config.block_reuse = False
        dynamo_ext.uninstall()
        dist.destroy_process_group()


def _parallel_model(ex: Any, cfg: Any, fsdp_only: bool) -> tuple[Any, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not fsdp_only:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return ex.parallelize(ex.Decoder(cfg), mesh), mesh["dp"].get_local_rank()
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = ex.Decoder(cfg)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh), dist.get_rank()


def _max_over_ranks(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _slowest(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return _max_over_ranks(time.perf_counter() - t0)


def _launch(args: argparse.Namespace, layers: int, way: str, backward: str, cache: str) -> dict[str, Any]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    t0 = time.perf_counter()
    results = launch_on_ranks(
        _rank_main, layers, way, backward, args.steps, args.backend, args.fsdp_only, nproc=args.nproc
    )
    return {**results[0], "launch_s": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--backwards", nargs="+", default=list(BACKWARDS), choices=BACKWARDS)
    parser.add_argument("--fsdp-only", action="store_true", help="FSDP2 on a 1-D mesh, no TP")
    parser.add_argument("--cold-only", action="store_true", help="skip the warm (second) launch")
    args = parser.parse_args()
    import torch
    from rich.console import Console
    from rich.table import Table

    rows = []
    for layers in args.layers:
        for way in args.ways:
            for backward in args.backwards:
                if backward == "CA" and way != "plugin":  # stock: unreduced gradients; reuse: refused
                    continue
                cache = tempfile.mkdtemp(prefix="bench-compile-")
                cold = _launch(args, layers, way, backward, cache)
                warm = cold if args.cold_only else _launch(args, layers, way, backward, cache)
                rows.append((layers, way, backward, cold, warm))
                print(f"{layers} layers, {way}, {backward}: cold {cold}, warm {warm}", flush=True)
    load = os.getloadavg()
    layout = "FSDP2 on 4 ranks" if args.fsdp_only else "TP + FSDP2 on a (2, 2) mesh"
    table = Table(
        title=f"Bundled Llama, {layout}, {args.nproc} gloo ranks, torch {torch.__version__}, {args.backend}, "
        f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
    )
    for col in ("layers", "way", "backward", "first step cold (s)", "first step warm (s)", "step (s)", "vs stock cold"):
        table.add_column(col)
    table.add_column("loss after")
    stock = {r[0]: r[3]["first_s"] for r in rows if r[1] == "stock" and r[2] == "eager"}
    for layers, way, backward, cold, warm in rows:
        ratio = f"{cold['first_s'] / stock[layers]:.2f}x" if layers in stock else "-"
        table.add_row(
            str(layers),
            way,
            backward,
            f"{cold['first_s']:.1f}",
            f"{warm['first_s']:.1f}",
            f"{cold['step_s']:.3f}",
            ratio,
            f"{cold['loss']:.5f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
