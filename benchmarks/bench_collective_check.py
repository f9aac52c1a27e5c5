#!/usr/bin/env python3
"""Cost of the collective-sequence check (``dynamo_ext.config.collective_check``) on the public corpus.

``--ranks`` gloo processes on loopback, the plugin installed.  For every public
corpus case without compiled autograd or an expected error, each rank, with
the check off and on alternately (``--repeat`` rounds, best kept):

- compile time: ``torch._dynamo.reset()``, a barrier, then the first call
  (and backward for backward cases) of ``torch.compile(fn, backend=...,
  fullgraph=True)``: Dynamo, AOTAutograd, the backend, and with the check on
  the fingerprint and the store exchange.  The slowest rank counts (the first
  collective makes every rank wait for it anyway).  The check's agreed set is
  reset before each measurement, so every "on" measurement pays the exchange;
- steady per-call time: the median of ``--calls`` later calls.

Printed: the ratios on/off per case, their geometric means, and the compile
time summed over the cases, on/off (target: <= 1.05).  Then, in one process,
the wrapper's own cost per call in a context already checked (NOTE [when the
stream is checked]; target <= 1 us) against calling the compiled function
directly.  ``--wrapper-only`` prints just that.

    python benchmarks/bench_collective_check.py [--ranks 4] [--backend aot_eager] [--repeat 3] [--calls 50] [-k mesh]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
import timeit
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import free_port, timed_corpus_cases

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"


def _clone(a):
    if isinstance(a, torch.Tensor):
        c = a.detach().clone()
        return c.requires_grad_(a.requires_grad) if c.is_leaf else c
    return a


def _step(case, fn, args):
    out = fn(*args)
    if case.backward:
        ts = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
        loss = sum(t.to_local().sum() if hasattr(t, "to_local") else t.sum() for t in ts)
        loss.backward()
    return out


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _measure(case, fn, args, backend, calls):
    torch._dynamo.reset()
    cfn = torch.compile(fn, backend=backend, fullgraph=True)
    dist.barrier()
    t0 = time.perf_counter()
    _step(case, cfn, [_clone(a) for a in args])
    first = _slowest(time.perf_counter() - t0)
    samples = []
    for _ in range(calls):
        call_args = [_clone(a) for a in args]
        t0 = time.perf_counter()
        _step(case, cfn, call_args)
        samples.append(time.perf_counter() - t0)
    return first, _slowest(statistics.median(samples))


def _rank(rank, world, port, a):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    sys.path.insert(0, str(CORPUS))
    import corpus
    from torch.distributed.device_mesh import init_device_mesh

    import dynamo_ext
    from dynamo_ext import collective_check, config

    dynamo_ext.install()
    env = corpus.Env(
        rank=rank,
        world_size=world,
        mesh1d=init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
        mesh2d=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp")),
    )
    import cases_public  # noqa: F401  (registers the cases)

    rows = []
    for name, c, fn, args in timed_corpus_cases(corpus.CASES, env, a.k):
        best = {False: [math.inf, math.inf], True: [math.inf, math.inf]}
        ok = True
        for _ in range(a.repeat):
            for on in (False, True):
                config.collective_check = on
                collective_check.reset()
                try:
                    first, call = _measure(c, fn, args, a.backend, a.calls)
                except Exception as e:  # noqa: BLE001  (a case this backend cannot compile: no figure)
                    ok = False
                    if rank == 0:
                        print(f"{name:38s} skipped ({type(e).__name__}: {str(e)[:80]})")
                    break
                best[on] = [min(best[on][0], first), min(best[on][1], call)]
            if not ok:
                break
        dist.barrier()
        if ok:
            rows.append((name, best))
    if rank == 0:
        _report(rows, a)
    dist.destroy_process_group()


def _report(rows, a):
    print(
        f"\n{'case':38s} {'compile off ms':>14s} {'on':>8s} {'ratio':>6s}   {'call off us':>11s} {'on':>8s} {'ratio':>6s}"
    )
    ratios, call_ratios = [], []
    for name, b in rows:
        r, cr = b[True][0] / b[False][0], b[True][1] / b[False][1]
        ratios.append(r)
        call_ratios.append(cr)
        print(
            f"{name:38s} {b[False][0] * 1e3:14.1f} {b[True][0] * 1e3:8.1f} {r:6.3f}   "
            f"{b[False][1] * 1e6:11.1f} {b[True][1] * 1e6:8.1f} {cr:6.3f}"
        )
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    total_off, total_on = sum(b[False][0] for _, b in rows), sum(b[True][0] for _, b in rows)
    print(
        f"\n{len(rows)} cases, {a.ranks} gloo ranks, backend {a.backend}: compile time check on/off: "
        f"geomean {gm(ratios):.3f}, total {total_on:.2f} s / {total_off:.2f} s = {total_on / total_off:.3f} "
        f"(target <= 1.05); steady per-call on/off geomean {gm(call_ratios):.3f}"
    )


def _wrapper_cost(n: int = 200_000) -> None:
    """Per call, the stream check's wrapper on a graph whose context was checked (NOTE [when the stream is checked])."""
    from dynamo_ext.collective_check import CollectiveSignature, stream

    def compiled(x):
        return x

    for groups in (1, 2):
        plans = [
            stream.GroupPlan(
                str(g),
                (0, 1),
                (CollectiveSignature("_c10d_functional.all_reduce", str(g), (0, 1), "sum", (), (), "forward"),),
                "d",
            )
            for g in range(groups)
        ]
        wrapped = stream.checked(compiled, plans)
        stream._state.seen[(None, "d")] = stream._state.seen[("d", "d")] = True  # as after those two checks
        wrapped(0)

        # CPU time of this process, not wall time: on a shared machine the wall clock also counts other processes.
        def best(f):
            return min(timeit.repeat("f(0)", number=n, repeat=7, globals={"f": f}, timer=time.process_time)) / n

        bare, checked = best(compiled), best(wrapped)
        print(
            f"per call, context seen, {groups} group(s): wrapper {checked * 1e9:.0f} ns vs direct {bare * 1e9:.0f} ns "
            f"(+{(checked - bare) * 1e9:.0f} ns CPU time: per group a dictionary lookup, the position count and a "
            "history append; a call count; one Python frame)"
        )
    stream.reset()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("-k", default=None, help="only cases whose name or tag contains this")
    p.add_argument("--wrapper-only", action="store_true", help="only the per-call cost of the wrapper")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.wrapper_only:
        _wrapper_cost()
        return 0
    port = free_port()
    mp.spawn(_rank, args=(a.ranks, port, a), nprocs=a.ranks, join=True)
    _wrapper_cost()
    print(f"torch {torch.__version__}, {a.ranks} rank(s) x 1 thread, {os.cpu_count()} CPU cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
