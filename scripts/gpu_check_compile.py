"""gpu_check's "compile" phase: the fused kernels' Triton variants compiled ahead, in parallel processes.

    python scripts/gpu_check_compile.py [--world 2 4 8] [--workers N] [--json PATH]
    python scripts/gpu_check_compile.py --dry-run     # no GPU: the plan and the patch points, nothing compiled

NOTE [fused kernels compiled ahead]
Triton compiles one binary per specialization: the constexprs (world size, dtypes, row
chunking, vector width) and, for every int argument, whether it is 1 or a multiple of 16.
``rank`` and ``n_rows`` are such ints, so one (W, algorithm, dtype, hidden) has nine
variants (rank 0 / 1 / other x rows 1 / multiple of 16 / other): about 230 for the race
test and the benchmark sweep, a second or more each, too long for one process inside a
short lease.  Worker processes here each run the launchers for a share of them with the
kernel replaced by one that only compiles (``JITFunction.warmup``, the same arguments, so
the same cache key), filling Triton's on-disk cache that the later phases read.  Nothing
runs on the device, so no rank waits for its peers here.  Best effort: a variant that fails
or is not reached is compiled by the phase that first launches it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "benchmarks"), os.path.join(HERE, "..")]

from _fused_ranks import ALGORITHMS, DTYPES  # noqa: E402
from gpu_check_watchdog import JsonPart  # noqa: E402

HIDDENS = (4096, 8192)
ODD_HIDDEN = 1002
"""A row length the race test adds (bf16 only): not a multiple of 8 (no vector reads) nor of 16."""
ROWS = (1, 2, 16)
"""One row count of each integer specialization: 1, neither, a multiple of 16."""
TEST_TASKS = ((2, "one_shot", "bfloat16", 16384), (4, "one_shot", "bfloat16", 16384))
"""tests/test_kernel_harness.py's one size outside the sweep's (a chunked 16384-wide row)."""


def tasks(worlds: list[int]) -> list[tuple[int, str, str, int]]:
    """``(world, algorithm, dtype, hidden)`` of the race test and the sweep, each compiled for :data:`ROWS` and
    ranks 0, 1 and 2."""
    out = [(w, a, d, h) for w in worlds for d in DTYPES for h in HIDDENS for a in ALGORITHMS]
    out += [(w, "one_shot", "bfloat16", ODD_HIDDEN) for w in worlds]  # the race test's only kernel there
    return out + [t for t in TEST_TASKS if t[0] in worlds]


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """The launchers' kernels replaced by ones that compile and never launch (NOTE [fused kernels compiled
    ahead])."""
    from dynamo_ext.inductor_lowerings.kernels import one_shot_all_reduce_rms_norm as one_shot
    from dynamo_ext.inductor_lowerings.kernels import two_shot_all_reduce_rms_norm as two_shot

    class WarmupOnly:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)

    patched = [
        (one_shot, "_one_shot_all_reduce_residual_rms_norm_kernel"),
        (two_shot, "_two_shot_all_reduce_residual_rms_norm_kernel"),
    ]
    saved = [getattr(module, name) for module, name in patched]
    for (module, name), kernel in zip(patched, saved):
        setattr(module, name, WarmupOnly(kernel))
    try:
        yield
    finally:
        for (module, name), kernel in zip(patched, saved):
            setattr(module, name, kernel)


def compile_task(task: tuple[int, str, str, int]) -> dict[str, Any]:
    """Compile one task's variants in this (worker) process; ``{"task", "variants", "seconds", "error"?}``."""
    import torch
    from _fused_ranks import buffer_nbytes, casts_for, launch_rank, max_blocks_for

    from dynamo_ext.inductor_lowerings.kernels import harness

    world, algorithm, dtype_name, hidden = task
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda")
    t0 = time.perf_counter()
    done = 0
    try:
        size = buffer_nbytes([(max(ROWS), hidden)], dtype)
        ranks = harness.InProcessRanks(world, size, device, max_blocks=max_blocks_for(world, device))
        weight = torch.ones(hidden, dtype=dtype, device=device)
        with compile_only():
            for rows in ROWS:
                residual = torch.zeros(rows, hidden, dtype=dtype, device=device)
                for rank in sorted({0, 1, min(2, world - 1)}):
                    x = ranks.input(rank, (rows, hidden), dtype)
                    launch_rank(ranks, algorithm, rank, x, residual, weight, **casts_for(dtype))
                    done += 1
    except Exception as e:  # reported per task; the phases compile what is missing
        return {"task": list(task), "variants": done, "seconds": time.perf_counter() - t0, "error": repr(e)}
    return {"task": list(task), "variants": done, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--json", help="write the results here (rewritten after each task)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: check the patch points, print the plan")
    args = parser.parse_args(argv)
    part = JsonPart(args.json)
    todo = tasks(args.world)
    per_task = len(ROWS) * 3
    part.set(planned_tasks=len(todo), planned_variants_at_most=len(todo) * per_task, workers=args.workers, done=[])
    print(f"{len(todo)} tasks, at most {len(todo) * per_task} kernel variants, {args.workers} workers", flush=True)
    if args.dry_run:
        with compile_only():  # the launcher modules still have the names patched here
            pass
        part.set(dry_run=True)
        print("dry run: the launchers' kernels can be replaced; nothing compiled (needs CUDA)")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compile")
        part.set(skipped="no CUDA device")
        return 0
    failed = 0
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(args.workers, len(todo)), mp_context=ctx) as pool:
        for result in pool.map(compile_task, todo):
            failed += "error" in result
            part.append("done", result)
            print(result, flush=True)
    compiled = sum(r["variants"] for r in part.data["done"])
    part.set(variants_compiled=compiled, tasks_failed=failed)
    print(f"compiled {compiled} variants; {failed} tasks failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
