"""CPU / gloo benchmark of the collective fusions, ours vs stock Inductor in the same run.

    python benchmarks/bench_collective_fusion_cpu.py [--ranks 4] [--iters 30] [--rounds 5]

Spawns ``--ranks`` gloo processes on loopback (one thread each).  Every rank compiles
each workload three times with ``backend="inductor"`` and the plugin installed: with our
passes on; with them off (then Inductor sees the stock graph and our lowerings never
fire: stock Inductor); and with ours off and stock Inductor's own opt-in bucketing
passes on (``torch._inductor.config.bucket_all_reduces_fx = "all"``,
``bucket_all_gathers_fx = "all"``, ``bucket_reduce_scatters_fx = "all"``: the post-grad
passes of ``torch/_inductor/fx_passes/bucketing.py``).  Dynamo keeps every compiled
version (one code object each), so the timed rounds alternate between them to cancel
drift; a step's time is the slowest rank's, the figure is the median over rounds.

Before that, in this process on the fake process group (whose all-reduce does nothing),
the same epilogue is timed alone: the compute the residual RMSNorm fusion changes on the CPU, without
gloo's share of the step.

Workloads:
- ``epilogue``: all-reduce + residual add + RMSNorm (bf16 and fp32), the fused epilogue alone;
- ``tp_block``: 2 x (column-parallel linear, SiLU, row-parallel linear, all-reduce,
  residual add, RMSNorm), the tensor-parallel MLP step;
- ``grads``: N independent gradient all-reduces of 1-64 KiB each (scaled by 1/world),
  bucketed vs not; also the number of collective calls each version issues per step;
- ``backward``: a hand-written backward of an N-layer tanh MLP (loss = sum of the
  output) whose layer gradients are all-reduced as soon as each is computed, with the
  next layer's backward matmuls between them: unbucketed, each all-reduce overlaps the
  compute after it (gloo runs it on its own thread); bucketed, the early ones wait for
  their bucket's last member, and the overlap is given up for fewer calls;
- ``ag_rs``: N independent dim-0 all-gathers and N reduce-scatters of small shards
  (FSDP-style), bucketed vs not.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def epilogue(h_partial, residual, weight, group_name: str):
    import torch.distributed._functional_collectives as funcol

    r = funcol.all_reduce(h_partial, "sum", group_name) + residual
    h32 = r.float()
    return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(r.dtype) * weight, r


def tp_block(x, w_in_local, w_out_local, norm, group_name: str):
    import torch.distributed._functional_collectives as funcol

    h = x
    for _ in range(2):
        partial = torch.nn.functional.silu(h @ w_in_local) @ w_out_local
        r = funcol.all_reduce(partial, "sum", group_name) + h
        h32 = r.float()
        h = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(r.dtype) * norm
    return h, r


def sync_grads(*grads):
    import torch.distributed._functional_collectives as funcol

    scale = 1.0 / dist.get_world_size()
    return [funcol.all_reduce(g * scale, "sum", dist.group.WORLD.group_name) for g in grads]


def mlp_backward(x, *weights):
    """Forward and hand-written backward of ``tanh(h @ w)`` layers; each weight gradient all-reduced at once."""
    import torch.distributed._functional_collectives as funcol

    group, scale = dist.group.WORLD.group_name, 1.0 / dist.get_world_size()
    acts = [x]
    for w in weights:
        acts.append(torch.tanh(acts[-1] @ w))
    grad, grads = torch.ones_like(acts[-1]), []
    for i in reversed(range(len(weights))):
        grad = grad * (1 - acts[i + 1] * acts[i + 1])
        grads.append(funcol.all_reduce((acts[i].t() @ grad) * scale, "sum", group))
        grad = grad @ weights[i].t()
    return grads


def gather_and_scatter(*shards):
    """N all-gathers of parameter shards and N reduce-scatters of full gradients (dim 0), independent."""
    import torch.distributed._functional_collectives as funcol

    group, n = dist.group.WORLD.group_name, len(shards) // 2
    gathered = [funcol.all_gather_tensor(s, 0, group) for s in shards[:n]]
    scattered = [funcol.reduce_scatter_tensor(g, "sum", 0, group) for g in shards[n:]]
    return gathered, scattered


VARIANTS = ("ours", "stock", "stock_bucketing")


def _twin(fn: Callable[..., Any], suffix: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object, so Dynamo caches it separately."""
    code = fn.__code__.replace(co_name=fn.__name__ + suffix)
    return types.FunctionType(code, fn.__globals__, fn.__name__ + suffix, fn.__defaults__, fn.__closure__)


def _compile_variants(
    fn: Callable[..., Any], args: tuple[Any, ...], names: tuple[str, ...] = VARIANTS
) -> dict[str, Callable[..., Any]]:
    """``fn`` compiled three ways (:data:`VARIANTS`): our passes; none; stock Inductor's bucketing passes."""
    from dynamo_ext import _compat
    from dynamo_ext.inductor_lowerings import options

    fields = ("residual_rms_norm", "bucket_all_reduces", "bucket_all_gathers_reduce_scatters")
    stock_passes = {"bucket_all_reduces_fx": "all", "bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"}
    out = {}
    for name in names:
        compiled = torch.compile(_twin(fn, "_" + name), backend="inductor")
        saved = tuple(getattr(options, f) for f in fields)
        for f in fields:
            setattr(options, f, name == "ours")
        try:
            with _compat.inductor_config().patch(stock_passes if name == "stock_bucketing" else {}):
                compiled(*args)  # compile now, under these settings
        finally:
            for f, v in zip(fields, saved):
                setattr(options, f, v)
        out[name] = compiled
    return out


def _collective_calls(fn: Callable[..., Any], args: tuple[Any, ...]) -> int:
    """Collectives one call of ``fn`` issues, counted by the profiler (it sees compiled code too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sum(1 for e in prof.events() if e.name.startswith("_c10d_functional::") and "wait_tensor" not in e.name)


def _time(fn: Callable[..., Any], args: tuple[Any, ...], iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _workloads(rank: int, world: int, grads_n: int) -> list[tuple[str, Callable[..., Any], tuple[Any, ...]]]:
    g = torch.Generator().manual_seed(0)
    group = dist.group.WORLD.group_name
    out = []
    for tokens, hidden, dtype in ((512, 4096, torch.float32), (2048, 4096, torch.bfloat16)):
        h = torch.randn(tokens, hidden, generator=g).to(dtype)
        r = torch.randn(tokens, hidden, generator=g).to(dtype)
        w = torch.randn(hidden, generator=g).to(dtype)
        out.append((f"epilogue {tokens}x{hidden} {str(dtype)[6:]}", epilogue, (h, r, w, group)))
    tokens, hidden, ffn = 256, 1024, 4096
    x = torch.randn(tokens, hidden, generator=g)
    w_in = torch.randn(hidden, ffn // world, generator=g) / hidden**0.5
    w_out = torch.randn(ffn // world, hidden, generator=g) / ffn**0.5
    out.append((f"tp_block {tokens}x{hidden} ffn {ffn} fp32", tp_block, (x, w_in, w_out, torch.ones(hidden), group)))
    sizes = [int(256 * 64 ** (i / (grads_n - 1))) // 16 * 16 for i in range(grads_n)]
    grads = tuple(torch.randn(s, generator=g) for s in sizes)
    out.append((f"grads {grads_n} x 1-64 KiB fp32", sync_grads, grads))
    layers, width, batch = 16, 256, 64
    x = torch.randn(batch, width, generator=g)
    weights = tuple(torch.randn(width, width, generator=g) / width**0.5 for _ in range(layers))
    out.append((f"backward {layers} x {width}x{width} fp32", mlp_backward, (x, *weights)))
    n = 16
    shards = tuple(torch.randn(64 * (1 + i % 4), 64, generator=g) for i in range(n))
    fulls = tuple(torch.randn(world * 64 * (1 + i % 4), 64, generator=g) for i in range(n))
    out.append((f"ag_rs {n}+{n} x 16-64 KiB fp32", gather_and_scatter, (*shards, *fulls)))
    return out


def _rank_main(rank: int, world: int, port: int, iters: int, rounds: int, grads_n: int, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    import dynamo_ext

    dynamo_ext.install()
    rows = []
    only = [p for p in os.environ.get("DYNAMO_EXT_BENCH_ONLY", "").split(",") if p]
    for name, fn, args in _workloads(rank, world, grads_n):
        if only and not any(name.startswith(p) for p in only):
            continue
        variants = _compile_variants(fn, args)
        want = variants["stock"](*args)
        for k in ("ours", "stock_bucketing"):  # the same numbers (fp32: the bucketed sums may round differently)
            torch.testing.assert_close(variants[k](*args), want, rtol=1e-5, atol=1e-5, msg=f"{name}: {k} vs stock")
        calls = {k: _collective_calls(f, args) for k, f in variants.items()}
        times: dict[str, list[float]] = {k: [] for k in VARIANTS}
        for _ in range(rounds):
            for k in VARIANTS:
                times[k].append(_time(variants[k], args, iters))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((name, med, calls))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _compute_only(iters: int, rounds: int) -> list[tuple[str, float, float]]:
    """The epilogue on a fake 4-rank group (no communication), one thread, ours vs stock."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dynamo_ext

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    dynamo_ext.install()
    rows = []
    try:
        g = torch.Generator().manual_seed(0)
        for tokens, hidden, dtype in (
            (64, 4096, torch.float32),
            (512, 4096, torch.float32),
            (2048, 4096, torch.bfloat16),
        ):
            args = tuple(torch.randn(s, generator=g).to(dtype) for s in ((tokens, hidden), (tokens, hidden), (hidden,)))
            args = (*args, dist.group.WORLD.group_name)
            both = _compile_variants(epilogue, args, ("ours", "stock"))
            times: dict[str, list[float]] = {"ours": [], "stock": []}
            for _ in range(rounds):
                for k, f in both.items():
                    start = time.perf_counter()
                    for _ in range(iters):
                        f(*args)
                    times[k].append((time.perf_counter() - start) / iters)
            rows.append(
                (
                    f"epilogue {tokens}x{hidden} {str(dtype)[6:]}",
                    *(statistics.median(times[k]) for k in ("ours", "stock")),
                )
            )
    finally:
        dynamo_ext.uninstall()
        dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating ours/stock rounds (median taken)")
    parser.add_argument("--grads", type=int, default=32, help="number of small gradient all-reduces")
    parser.add_argument("--skip-compute-only", action="store_true", help="only the gloo workloads")
    parser.add_argument("--only", default="", help="comma-separated workload name prefixes (default: all)")
    a = parser.parse_args()
    os.environ["DYNAMO_EXT_BENCH_ONLY"] = a.only
    compute = [] if a.skip_compute_only else _compute_only(a.iters, a.rounds)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _rank_main,
        args=(a.ranks, port, a.iters, a.rounds, a.grads, queue),
        nprocs=a.ranks,
        start_method="spawn",
        join=True,
    )
    rows = queue.get()
    print(
        f"torch {torch.__version__}, {a.ranks} gloo ranks on {os.cpu_count()} CPU cores, 1 thread each; "
        f"median of {a.rounds} rounds x {a.iters} steps; time = slowest rank"
    )
    print("\n[compute only: fake process group, 1 thread, no communication]")
    print(f"{'workload':40s} {'ours ms':>9s} {'stock ms':>9s} {'stock/ours':>10s}")
    for name, ours, stock in compute:
        print(f"{name:40s} {ours * 1e3:9.3f} {stock * 1e3:9.3f} {stock / ours:9.2f}x")
    print(f"\n[{a.ranks} gloo ranks; stock+b: stock Inductor with its own bucket_*_fx passes on]")
    print(
        f"{'workload':40s} {'ours ms':>9s} {'stock ms':>9s} {'stock+b ms':>10s} {'stock/ours':>10s} "
        f"{'stock+b/ours':>12s} {'calls ours/stock/stock+b':>24s}"
    )
    for name, med, calls in rows:
        ours, stock, stock_b = (med[k] for k in VARIANTS)
        counts = "/".join(str(calls[k]) for k in VARIANTS)
        print(
            f"{name:40s} {ours * 1e3:9.3f} {stock * 1e3:9.3f} {stock_b * 1e3:10.3f} {stock / ours:9.2f}x "
            f"{stock_b / ours:11.2f}x {counts:>24s}"
        )


if __name__ == "__main__":
    main()
