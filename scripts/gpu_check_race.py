"""gpu_check's "race" phase: thousands of back-to-back fused calls with random sizes on W simulated ranks.

    python scripts/gpu_check_race.py [--world 2 4 8] [--calls 1500] [--json PATH] [--deadline-s 60]
    python scripts/gpu_check_race.py --dry-run   # CPU: Triton's interpreter, ranks as threads, tiny sizes

NOTE [race test with independent rank streams]
W ranks of one process on one GPU (NOTE [in-process ranks] in ``harness.py``), each on its
own stream.  Every call picks a random size (rows from 1 to ``--max-rows``, log-uniform;
hidden 4096, 8192 (two chunks a row) or, for bf16, 1002 (no vector reads)), a dtype and
the one- or two-shot kernel (one-shot only at 1002 (1)); each rank then, on its own stream, copies its next input into
its peer buffer, launches, and compares its outputs with the fp32 reference (all-reduce
in rank order, residual add, RMSNorm: ``_fused_ranks.reference``), writing the errors into
a device tensor.  Unlike ``InProcessRanks.race_check`` no rank waits for the others
between calls: a rank that leaves its kernel starts overwriting its buffer for the next
call at once, as the next matmul does in a TP block, so only the kernels' exit barriers
keep its peers' reads safe; grids change from call to call (``min(rows, max_blocks)``
programs), so a signal slot left raised by one call meets a different program layout in
the next.  The host waits only every ``--batch`` calls, by polling events: a call that
does not finish ends the run with each rank's barrier state and the call each rank is in
(NOTE [gpu_check watchdog]).  Under ``--dry-run`` the ranks are threads under Triton's
interpreter and each call is synchronous (``InProcessRanks.run``).

(1) The two-shot kernel's staging offsets are int arguments too, and at a row length that
is not a multiple of 16 whether they are multiples of 16 changes with the row count: each
new one is another compile (NOTE [fused kernels compiled ahead]), too many for the phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "benchmarks"), os.path.join(HERE, "..")]

from gpu_check_watchdog import JsonPart, Watchdog, wait_events  # noqa: E402


@dataclasses.dataclass
class Case:
    """One size's inputs (one per rank), residual, weight and reference, on the device."""

    shape: tuple[int, int]
    dtype: Any
    inputs: list[Any]
    residual: Any
    weight: Any
    want: tuple[Any, Any, Any]
    casts: dict[str, Any]


def make_cases(world: int, n: int, *, hiddens: list[int], odd_hidden: int, max_rows: int, device: Any, seed: int):
    """``n`` random cases (NOTE [race test with independent rank streams])."""
    import torch
    from _fused_ranks import casts_for, reference

    rng = random.Random(seed)
    g = torch.Generator(device=device).manual_seed(seed)
    cases = []
    for i in range(n):
        dtype = (torch.bfloat16, torch.float32)[i % 2]
        widths = hiddens + ([odd_hidden] if dtype == torch.bfloat16 and odd_hidden else [])
        rows = max(1, round(2 ** rng.uniform(0, math.log2(max_rows))))
        shape = (rows, rng.choice(widths))
        inputs = [torch.randn(shape, generator=g, device=device).to(dtype) for _ in range(world)]
        residual = torch.randn(shape, generator=g, device=device).to(dtype)
        weight = (1 + 0.5 * torch.randn(shape[1], generator=g, device=device)).to(dtype)
        casts = casts_for(dtype)
        cases.append(Case(shape, dtype, inputs, residual, weight, reference(inputs, residual, weight, **casts), casts))
    return cases


def run_world(world: int, args: argparse.Namespace, watchdog: Watchdog, deadline: float) -> dict[str, Any]:
    """``args.calls`` calls on ``world`` ranks; the row this world adds to the JSON."""
    import torch
    from _fused_ranks import ALGORITHMS, bounds, buffer_nbytes, errors, launch_rank, max_blocks_for

    from dynamo_ext.inductor_lowerings.kernels import harness

    interpret = args.dry_run
    device = torch.device("cpu" if interpret else "cuda")
    t0 = time.perf_counter()
    cases = make_cases(
        world,
        args.cases,
        hiddens=args.hidden,
        odd_hidden=args.odd_hidden,
        max_rows=args.max_rows,
        device=device,
        seed=args.seed + world,
    )
    size = max(buffer_nbytes([c.shape], c.dtype) for c in cases)
    ranks = harness.InProcessRanks(world, size, device, max_blocks=max_blocks_for(world, device))
    watchdog.forget()  # the previous world size's ranks and calls
    watchdog.watch(ranks, f"race W={world}")
    rng = random.Random(args.seed * 7 + world)
    err = torch.zeros(world, args.calls, 3, dtype=torch.float64, device=device)
    plan: list[tuple[int, str]] = []  # (case index, algorithm) per call
    kw = {"max_block_n": args.max_block_n} if args.max_block_n else {}
    if not interpret:
        torch.cuda.synchronize()  # the cases, made on the default stream, are in place before any rank reads them
    batch_events: list[list[Any]] = []
    state = {"first": 0}

    def describe() -> str:
        lines = [f"race W={world}: calls {state['first']}..{len(plan) - 1} in flight"]
        for r in range(world):
            done = [i for i, evs in enumerate(batch_events) if evs[r].query()]
            k = state["first"] + (max(done) + 1 if done else 0)
            if k < len(plan):
                c = cases[plan[k][0]]
                lines.append(f"  rank {r}: in call {k}: {plan[k][1]} {c.shape[0]}x{c.shape[1]} {c.dtype}")
            else:
                lines.append(f"  rank {r}: done with every call launched")
        return "\n".join(lines)

    watchdog.describe_with(describe)
    k = 0
    while k < args.calls and time.monotonic() < deadline:
        index = rng.randrange(len(cases))
        case = cases[index]
        algorithm = rng.choice(ALGORITHMS) if case.shape[1] in args.hidden else "one_shot"  # (1)
        plan.append((index, algorithm))
        watchdog.beat(f"race W={world} call {k}: {algorithm} {case.shape} {case.dtype}")

        def one_rank(rank: int, case: Case = case, algorithm: str = algorithm, k: int = k) -> None:
            x = ranks.input(rank, case.shape, case.dtype)
            x.copy_(case.inputs[rank])  # the producer, on this rank's stream, right before the kernel
            got = launch_rank(ranks, algorithm, rank, x, case.residual, case.weight, **case.casts, **kw)
            err[rank, k].copy_(errors(got, case.want))

        if interpret:
            ranks.run(one_rank, kernel=harness._kernel(algorithm))
        else:
            events = []
            for rank, stream in enumerate(ranks.streams):
                with torch.cuda.stream(stream):
                    one_rank(rank)
                    events.append(torch.cuda.Event())
                    events[-1].record(stream)
            batch_events.append(events)
            if len(batch_events) == args.batch:
                wait_events([e for evs in batch_events for e in evs], timeout_s=args.hang_s, watchdog=watchdog,
                            what=f"race W={world} calls {state['first']}..{k}")  # fmt: skip
                batch_events.clear()
                state["first"] = k + 1
        k += 1
    if batch_events:
        wait_events([e for evs in batch_events for e in evs], timeout_s=args.hang_s, watchdog=watchdog,
                    what=f"race W={world} calls {state['first']}..{k - 1}")  # fmt: skip
    calls = k
    if not interpret:
        torch.cuda.synchronize()
    worst = err[:, :calls].amax(dim=0).cpu()  # [calls, 3]: the worst rank per call
    row: dict[str, Any] = {
        "world": world,
        "calls": calls,
        "calls_asked": args.calls,
        "max_blocks": ranks.max_blocks,
        "cases": sorted({f"{c.shape[0]}x{c.shape[1]} {str(c.dtype).replace('torch.', '')}" for c in cases}),
        "algorithms": {a: sum(1 for _, b in plan[:calls] if b == a) for a in ALGORITHMS},
        "slots_raised": ranks.signal_slots_raised(),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    bad = []
    for dtype_name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        picked = [i for i, (c, _) in enumerate(plan[:calls]) if cases[c].dtype == dtype]
        if not picked:
            continue
        w = worst[picked]
        b = bounds(dtype)
        row[dtype_name] = {
            "calls": len(picked),
            "sum_max_ulp": float(w[:, 0].max()),
            "norm_max_ulp": float(w[:, 1].max()),
            "rstd_max_rel": float(w[:, 2].max()),
            "bounds": b,
        }
        over = (w[:, 0] > b["sum_ulp"]) | (w[:, 1] > b["norm_ulp"]) | ~torch.isfinite(w).all(dim=1)
        bad += [picked[i] for i in over.nonzero().flatten().tolist()]
    row["bad_calls"] = len(bad)
    if bad:
        first = sorted(bad)[0]
        c, a = cases[plan[first][0]], plan[first][1]
        row["first_bad"] = {"call": first, "algorithm": a, "shape": list(c.shape), "dtype": str(c.dtype),
                            "errors": worst[first].tolist()}  # fmt: skip
    row["ok"] = not bad and row["slots_raised"] == 0 and calls > 0
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--calls", type=int, default=1500, help="calls per world size")
    parser.add_argument("--cases", type=int, default=24, help="random sizes per world size (inputs kept on device)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--odd-hidden", type=int, default=1002, help="a bf16 row length without vector reads; 0: none")
    parser.add_argument("--max-rows", type=int, default=1024)
    parser.add_argument("--max-block-n", type=int, default=0, help="chunk rows above this (0: the kernels' default)")
    parser.add_argument("--batch", type=int, default=50, help="calls between two host waits")
    parser.add_argument("--hang-s", type=float, default=60.0, help="a batch not done after this is a hang")
    parser.add_argument("--deadline-s", type=float, default=0, help="stop launching after this many seconds (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here (rewritten after each world size)")
    parser.add_argument("--dry-run", action="store_true", help="CPU: the interpreter, 2 thread-ranks, tiny sizes")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        args.world, args.calls, args.cases, args.hidden = [2], 4, 3, [40, 24]
        args.odd_hidden, args.max_rows, args.max_block_n = 0, 5, 16
    import torch

    part = JsonPart(args.json)
    part.set(mode="dry-run (interpreter)" if args.dry_run else "cuda", rows=[])
    if not args.dry_run and not torch.cuda.is_available():
        part.set(skipped="no CUDA device")
        print("no CUDA device: the race test needs one (or --dry-run)")
        return 0
    deadline = time.monotonic() + (args.deadline_s or 1e9)
    ok = True
    with Watchdog(args.hang_s + 30, name="race", on_fire=lambda report: part.set(watchdog=report)) as watchdog:
        for world in args.world:
            try:
                row = run_world(world, args, watchdog, deadline)
            except Exception as e:  # recorded; the next world size still runs (unless the device is broken)
                row = {"world": world, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
            ok &= row["ok"]
            part.append("rows", row)
            print(row, flush=True)
    part.set(ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
