"""The W-rank sweep of ``bench_fused_allreduce_gpu.py``: fused one-shot and two-shot against the unfused sequence.

NOTE [fused vs unfused on W simulated ranks]
W ranks as W streams of one GPU (NOTE [in-process ranks] in ``harness.py``), each with
its input in its own peer buffer.  Per step, every rank runs, on its own stream:

- ``one_shot`` / ``two_shot``: the fused all-reduce + residual add + RMSNorm kernel;
- ``unfused``: the all-reduce, then Inductor's add + RMSNorm: the all-reduce is an
  Inductor-compiled sum of the W peer buffers (fp32, rank order: what a one-shot
  all-reduce reads and writes; NCCL cannot run W ranks on one GPU), its result written
  to memory, then the add + RMSNorm epilogue compiled by Inductor (tokens dynamic: one
  compile per dtype and hidden size, plus the 1-token graph Dynamo specializes).

A step is timed from an event recorded before the W ranks start to one after the last
ends (the ranks' streams wait on the timing stream and it on them).  Launching W ranks
costs the host more than small steps take on the device, so each batch of steps is
queued behind a ``torch.cuda._sleep`` long enough to cover its launches: the events then
time the device, not Python.  The median of ``reps`` (>= 100) steps after ``warmup`` steps.
Every variant's outputs on every rank are checked against the fp32 reference first.

Effective bandwidth counts the bytes the op must move per rank (W inputs, residual, both
outputs, weight), times W, over the step time, as a % of the device's measured copy
bandwidth.  Crossovers (:func:`crossovers`): the largest token count up to which a fused
kernel is faster than unfused at every size measured, and from where two-shot beats
one-shot.  What one GPU cannot show (NVLink, the memory ordering across GPUs):
benchmarks/README.md.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from _fused_ranks import EPS, bounds, buffer_nbytes, casts_for, errors, max_blocks_for, reference

VARIANTS = ("one_shot", "two_shot", "unfused")
MAX_SLEEP_US = 200_000
QUEUED_BYTES = 8 << 30
"""Memory the outputs of one queued batch of steps may hold: steps queued behind a sleep cannot reuse each
other's outputs (the ranks' outputs are recorded on the timing stream), so large steps queue fewer at a time."""


def all_reduce_sum(*xs):
    """The unfused all-reduce on one device: every rank's buffer summed in fp32 in rank order, rounded once."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def add_rms_norm(reduced, residual, weight):
    """The epilogue Inductor compiles after the all-reduce (the benchmark's ``epilogue`` without the collective)."""
    import torch

    r = reduced + residual
    h32 = r.float()
    return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(r.dtype), r


class StepTimer:
    """Median device time of a step (NOTE [fused vs unfused on W simulated ranks]); wall clock on the CPU."""

    def __init__(self, cuda: bool, *, reps: int, warmup: int, batch: int = 20, watchdog: Any = None) -> None:
        self.cuda, self.reps, self.warmup, self.batch, self.watchdog = cuda, reps, warmup, batch, watchdog
        self.cycles_per_us = 0.0
        if cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1 << 20)  # clocks up
            start.record()
            torch.cuda._sleep(1 << 24)
            end.record()
            torch.cuda.synchronize()
            self.cycles_per_us = (1 << 24) / (start.elapsed_time(end) * 1e3)

    def us(self, step: Callable[[], Any], what: str = "step", *, step_bytes: int = 0) -> float:
        """Median µs of ``step()``; ``step_bytes``: what one step's outputs hold (sizes the queued batches)."""
        if not self.cuda:
            for _ in range(self.warmup):
                step()
            samples = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                step()
                samples.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(samples)
        import torch
        from gpu_check_watchdog import wait_events

        for _ in range(self.warmup):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        host_us = (time.perf_counter() - t0) / 3 * 1e6
        batch = max(1, min(self.batch, QUEUED_BYTES // max(step_bytes, 1)))
        samples: list[float] = []
        while len(samples) < self.reps:
            n = min(batch, self.reps - len(samples))
            torch.cuda._sleep(int(min(1.5 * host_us * n + 50, MAX_SLEEP_US) * self.cycles_per_us))
            pairs = []
            for _ in range(n):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                pairs.append((start, end))
            wait_events([pairs[-1][1]], timeout_s=20, watchdog=self.watchdog, what=what)
            samples += [s.elapsed_time(e) * 1e3 for s, e in pairs]
        return statistics.median(samples)


def copy_bandwidth_gbs(timer: StepTimer, device: Any) -> float:
    """Device-to-device ``copy_`` of 1 GiB (16 MiB on the CPU), bytes read + written per second, in GB/s."""
    import torch

    nbytes = (1 << 30) if timer.cuda else (16 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (timer.us(lambda: dst.copy_(src), "copy bandwidth") * 1e-6) / 1e9


def _twin(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object, so each compiled twin has its own Dynamo cache."""
    import types

    name = f"{fn.__name__}_{tag}"
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name)


def _run_ranks(ranks: Any, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` on every rank's stream (CUDA) or one after another (CPU: nothing here waits for a peer)."""
    if ranks.streams:
        return ranks.run(fn, kernel=None)
    return [fn(r) for r in range(ranks.world_size)]


def measure(
    ranks: Any, shape: tuple[int, int], dtype: Any, unfused: tuple[Any, Any], timer: StepTimer, *, seed: int
) -> dict[str, Any]:
    """One size on ``ranks``: each variant checked against the reference, then timed; a row of the JSON."""
    import torch

    world, device = ranks.world_size, ranks.device
    g = torch.Generator(device=device).manual_seed(seed)
    xs = [ranks.input(r, shape, dtype) for r in range(world)]
    for x in xs:
        x.copy_(torch.randn(shape, generator=g, device=device))
    residual = torch.randn(shape, generator=g, device=device).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[1], generator=g, device=device)).to(dtype)
    casts = casts_for(dtype)
    want = reference(xs, residual, weight, **casts)
    red, epi = unfused

    def unfused_rank(rank: int) -> tuple[Any, Any]:
        ins = [*xs]
        for x in ins:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        reduced = red(*ins)
        torch._dynamo.maybe_mark_dynamic(reduced, 0)
        torch._dynamo.maybe_mark_dynamic(residual, 0)
        normed, summed = epi(reduced, residual, weight)
        return summed, normed

    steps = {
        "one_shot": lambda: ranks.launch("one_shot", xs, residual, weight, eps=EPS, **casts),
        "two_shot": lambda: ranks.launch("two_shot", xs, residual, weight, eps=EPS, **casts),
        "unfused": lambda: _run_ranks(ranks, unfused_rank),
    }
    nbytes = shape[0] * shape[1] * dtype.itemsize
    moved = world * ((world + 3) * nbytes + shape[1] * dtype.itemsize)
    row: dict[str, Any] = {
        "dtype": str(dtype).replace("torch.", ""),
        "world": world,
        "hidden": shape[1],
        "tokens": shape[0],
        "input_bytes": nbytes,
        "moved_bytes": moved,
    }
    b = bounds(dtype)
    for name, step in steps.items():
        what = f"{name} W={world} {shape[0]}x{shape[1]} {row['dtype']}"
        if timer.watchdog is not None:
            timer.watchdog.beat(what)
        row[f"{name}_us"], row[f"{name}_gbs"], row[f"{name}_ok"] = None, None, False
        try:
            outs = step()
            worst = torch.zeros(3, dtype=torch.float64, device=device)
            for out in outs:
                got = (*out, want[2]) if name == "unfused" else out  # unfused has no rstd output: compared as exact
                worst = torch.maximum(worst, errors(got, want))
            worst = worst.tolist()
            row[f"{name}_max_ulp"] = {"sum": worst[0], "norm": worst[1]}
            row[f"{name}_ok"] = worst[0] <= b["sum_ulp"] and worst[1] <= b["norm_ulp"]
            us = timer.us(step, what, step_bytes=3 * world * nbytes)
        except Exception as e:  # recorded in the row; the other variants and sizes still run
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
            continue
        row[f"{name}_us"] = round(us, 3)
        row[f"{name}_gbs"] = round(moved / (us * 1e-6) / 1e9, 2)
    return row


def _first_run(tokens: list[int], faster: list[bool]) -> tuple[int | None, int | None]:
    """``(largest t up to which every size is faster, first t that is not)``; None where there is none."""
    up_to = None
    for t, f in zip(tokens, faster):
        if not f:
            return up_to, t
        up_to = t
    return up_to, None


def _us(row: dict[str, Any], variant: str) -> float:
    """A variant's time; infinite where it was not measured or, for a fused kernel, gave a wrong number (never
    "faster").  The unfused sequence is the baseline: its difference from the reference is only reported."""
    us = row.get(f"{variant}_us")
    wrong = variant != "unfused" and not row.get(f"{variant}_ok", True)
    return float("inf") if us is None or wrong else us


def crossovers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dtype, world, hidden): where each fused kernel stops being faster than unfused, where two-shot
    starts beating one-shot (from that size on, at every size measured), in tokens and input bytes."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["world"], r["hidden"]), []).append(r)
    out = []
    for (dtype, world, hidden), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["tokens"])
        tokens = [r["tokens"] for r in rs]
        per_token = rs[0]["input_bytes"] // rs[0]["tokens"]
        entry: dict[str, Any] = {"dtype": dtype, "world": world, "hidden": hidden, "tokens_measured": tokens}
        for name in ("one_shot", "two_shot", "fused"):

            def us(r: dict[str, Any], name: str = name) -> float:
                if name == "fused":
                    return min(_us(r, "one_shot"), _us(r, "two_shot"))
                return _us(r, name)

            faster = [us(r) < _us(r, "unfused") for r in rs]
            up_to, stops = _first_run(tokens, faster)
            entry[f"{name}_faster_up_to_tokens"] = up_to
            entry[f"{name}_stops_being_faster_at_tokens"] = stops
            entry[f"{name}_faster_up_to_bytes"] = None if up_to is None else up_to * per_token
            entry[f"{name}_faster_at_tokens"] = [t for t, f in zip(tokens, faster) if f]
        two_wins = [_us(r, "two_shot") < _us(r, "one_shot") for r in rs]
        start = next((i for i in range(len(rs)) if all(two_wins[i:])), None)
        entry["two_shot_beats_one_shot_from_tokens"] = None if start is None else tokens[start]
        entry["two_shot_beats_one_shot_from_bytes"] = None if start is None else tokens[start] * per_token
        out.append(entry)
    return out


def run_sweep(
    *,
    worlds: list[int],
    hiddens: list[int],
    tokens: list[int],
    dtypes: list[str],
    cuda: bool,
    part: Any,
    watchdog: Any,
    reps: int,
    warmup: int,
    unfused_backend: str,
    deadline: float,
) -> list[dict[str, Any]]:
    """Every (dtype, world, hidden, tokens), rows appended to ``part`` (a ``JsonPart``) as they come."""
    import torch

    from dynamo_ext.inductor_lowerings import ops
    from dynamo_ext.inductor_lowerings.kernels import harness

    device = torch.device("cuda" if cuda else "cpu")
    timer = StepTimer(cuda, reps=reps, warmup=warmup, watchdog=watchdog)
    copy_gbs = copy_bandwidth_gbs(timer, device)
    part.set(copy_gbs=round(copy_gbs, 1), rows=[], crossovers=[], unfused_backend=unfused_backend)
    compiled: dict[tuple[Any, ...], Any] = {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for world in worlds:
            size = buffer_nbytes([(max(tokens), max(hiddens))], dtype)
            ranks = harness.InProcessRanks(world, size, device, max_blocks=max_blocks_for(world, device))
            if watchdog is not None:
                watchdog.forget()  # the previous ranks
                watchdog.watch(ranks, f"sweep W={world} {dtype_name}")
            red_key = ("red", world, dtype_name)
            compiled.setdefault(red_key, torch.compile(_twin(all_reduce_sum, f"w{world}_{dtype_name}"),
                                                       backend=unfused_backend))  # fmt: skip
            for hidden in hiddens:
                epi_key = ("epi", hidden, dtype_name)
                compiled.setdefault(epi_key, torch.compile(_twin(add_rms_norm, f"h{hidden}_{dtype_name}"),
                                                           backend=unfused_backend))  # fmt: skip
                for t in tokens:
                    if time.monotonic() > deadline:
                        part.set(stopped_early=f"deadline reached before {dtype_name} W={world} {t}x{hidden}")
                        return part.data["rows"]
                    row = measure(ranks, (t, hidden), dtype, (compiled[red_key], compiled[epi_key]), timer,
                                  seed=hash((world, hidden, t)) & 0xFFFF)  # fmt: skip
                    row["max_blocks"] = ranks.max_blocks
                    row["options_pick"] = ops.fused_all_reduce_algorithm(row["input_bytes"]) or "stock"
                    for v in VARIANTS:
                        gbs = row[f"{v}_gbs"]
                        row[f"{v}_pct_of_copy"] = None if gbs is None else round(100 * gbs / copy_gbs, 1)
                    part.append("rows", row)
                    part.set(crossovers=crossovers(part.data["rows"]))
                    print(format_row(row), flush=True)
            del ranks
            if cuda:
                torch.cuda.empty_cache()
    return part.data["rows"]


def _cell(value: float | None, width: int, suffix: str = "") -> str:
    return f"{'-':>{width}s}{suffix}" if value is None else f"{value:{width}.1f}{suffix}"


def format_row(row: dict[str, Any]) -> str:
    cells = " ".join(_cell(row[f"{v}_us"], 10, "" if row[f"{v}_ok"] else "!") for v in VARIANTS)
    pct = " ".join(_cell(row[f"{v}_pct_of_copy"], 6, "%") for v in VARIANTS)
    return f"{row['dtype']:>8s} {row['world']:2d} {row['hidden']:6d} {row['tokens']:6d} {cells}   {pct}"


def header() -> str:
    us = " ".join(f"{v + ' us':>10s}" for v in VARIANTS)
    pct = " ".join(f"{v[:6]:>7s}" for v in VARIANTS)
    return (
        f"{'dtype':>8s} {'W':>2s} {'hidden':>6s} {'tokens':>6s} {us}   {pct} (% of copy bandwidth; ! = wrong or failed)"
    )


def format_crossovers(entries: list[dict[str, Any]]) -> list[str]:
    lines = ["dtype     W hidden  one-shot faster up to  two-shot faster up to  two-shot beats one-shot from (tokens)"]
    for e in entries:
        lines.append(
            f"{e['dtype']:>8s} {e['world']:2d} {e['hidden']:6d}  {e['one_shot_faster_up_to_tokens']!s:>21s}  "
            f"{e['two_shot_faster_up_to_tokens']!s:>21s}  {e['two_shot_beats_one_shot_from_tokens']!s:>10s}"
        )
    return lines
