#!/usr/bin/env python3
"""Dynamo trace time and per-call overhead, plugin vs stock, on the public corpus.

One process, a fake 4-rank process group (collectives return garbage fast, so
only tracing and dispatch are measured).  For every public corpus case that
stock torch compiles as one graph:

- trace time: ``torch._dynamo.reset()`` then the first call of
  ``torch.compile(fn, backend="eager", fullgraph=True)`` (the graph runs
  eagerly, so this is Dynamo tracing + guard building), best of ``--repeat``;
- per-call time: later calls of the same compiled function, which are guard
  evaluation + the graph; median over ``--calls`` calls, best of ``--repeat``.

Stock and plugin are measured alternately in the same process (``install()``
/ ``uninstall()`` between them) and the ratios plugin/stock are printed, per
case and as the geometric mean.  Target: both geometric means <= 1.10.

    python benchmarks/bench_trace_and_guards.py [--repeat 3] [--calls 200] [-k mesh]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from _common import timed_corpus_cases

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"


def _clone(a):
    return a.detach().clone() if isinstance(a, torch.Tensor) and not hasattr(a, "placements") else a


def measure(fn, args, calls: int) -> tuple[float, float]:
    """(trace seconds, per-call seconds) for one compiled function."""
    torch._dynamo.reset()
    cfn = torch.compile(fn, backend="eager", fullgraph=True)
    args = [_clone(a) for a in args]
    t0 = time.perf_counter()
    cfn(*args)
    trace = time.perf_counter() - t0
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        cfn(*args)
        samples.append(time.perf_counter() - t0)
    return trace, statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("-k", default=None, help="only cases whose name or tag contains this")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(CORPUS))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import corpus
    from helpers import fake_world
    from torch.distributed.device_mesh import init_device_mesh

    import dynamo_ext

    torch.set_num_threads(1)
    with fake_world(4):
        env = corpus.Env(
            rank=0,
            world_size=4,
            mesh1d=init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
            mesh2d=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
        )
        import cases_public  # noqa: F401  (registers the cases)

        rows = []
        for name, _case, fn, args in timed_corpus_cases(corpus.CASES, env, a.k):
            best = {"stock": [math.inf, math.inf], "plugin": [math.inf, math.inf]}
            try:
                for _ in range(a.repeat):
                    for mode in ("stock", "plugin"):
                        (dynamo_ext.install if mode == "plugin" else dynamo_ext.uninstall)()
                        tr, call = measure(fn, args, a.calls)
                        best[mode] = [min(best[mode][0], tr), min(best[mode][1], call)]
            except Exception as e:  # stock cannot compile it as one graph: no baseline
                print(f"{name:38s} skipped ({type(e).__name__})")
                continue
            finally:
                dynamo_ext.uninstall()
            rows.append((name, best))
        dist.barrier()

    print(
        f"\n{'case':38s} {'trace stock ms':>14s} {'plugin':>8s} {'ratio':>6s}   {'call stock us':>13s} {'plugin':>8s} {'ratio':>6s}"
    )
    tr_ratios, call_ratios = [], []
    for name, b in rows:
        tr, cr = b["plugin"][0] / b["stock"][0], b["plugin"][1] / b["stock"][1]
        tr_ratios.append(tr)
        call_ratios.append(cr)
        print(
            f"{name:38s} {b['stock'][0] * 1e3:14.1f} {b['plugin'][0] * 1e3:8.1f} {tr:6.2f}   "
            f"{b['stock'][1] * 1e6:13.1f} {b['plugin'][1] * 1e6:8.1f} {cr:6.2f}"
        )
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    print(
        f"\ngeomean over {len(rows)} cases: trace time plugin/stock = {gm(tr_ratios):.3f}, "
        f"per-call time plugin/stock = {gm(call_ratios):.3f}  (target <= 1.10)"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
