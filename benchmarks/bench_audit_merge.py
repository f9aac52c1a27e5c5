"""``dynamo-ext audit merge`` on 1,024 synthetic rank files: wall time and peak memory.

    python benchmarks/bench_audit_merge.py [--ranks 1024] [--ranks-per-node 8] [--keep DIR]

Writes one rank file per rank as ``python -m dynamo_ext.audit.collect`` does
(header, then per rank 6 graph breaks with 6-frame stacks, hints and
explanations, 16 compiles with collective sequences, 2 recompiles, the end
line), with one outlier rank (512: an extra break and recompile), then times
``merge_dir`` (reading, folding, building the report) and the terminal report.
Peak memory is Python's allocations during the merge (``tracemalloc``, in a
second, untimed run), for N ranks and for N/8, to show how it grows.
Target: under 10 s for 1,024 ranks on the 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import tracemalloc

_GB_TYPES = (
    "Failed to trace builtin operator",
    "Unsupported Tensor.item() call with capture_scalar_outputs=False",
    "Data-dependent branching",
    "Attempted to call function marked as skipped",
    "Unsupported method call",
    "Call to `torch._dynamo.graph_break()`",
)


def _events(rank: int, world: int, per_node: int, outlier: int) -> list[dict]:
    from dynamo_ext.audit.schema.events import FORMAT_VERSION

    t = 1.7e9 + rank
    node = rank // per_node
    evs: list[dict] = [
        {
            "ev": "start", "format_version": FORMAT_VERSION, "rank": rank, "world_size": world,
            "local_rank": rank % per_node,
            "local_world_size": per_node, "node_rank": node, "host": f"node{node:03d}", "launcher": "torchrun",
            "pid": 10000 + rank, "torch_version": "2.13.0+cpu",
            "plugin": {"installed": True, "version": "0.1.0", "error": ""}, "target": "train.py", "time": t,
        }
    ]  # fmt: skip
    stack = [[f"model/layer{i}.py", 10 + i, f"forward{i}", f"x = self.block{i}(x)"] for i in range(5)]
    nbreaks = 6 + (rank == outlier)
    for b in range(nbreaks):
        evs.append(
            {
                "ev": "break", "kind": "graph_break", "gb_type": _GB_TYPES[b % len(_GB_TYPES)], "wrapper": "",
                "reason": _GB_TYPES[b % len(_GB_TYPES)],
                "explanation": "Dynamo does not know how to trace this call. " * 4,
                "hints": ["Avoid calling it inside the compiled region.", "Please report an issue to PyTorch."],
                "context": f"builtin call {b}", "stack": [*stack, ["train.py", 100 + b, "step", f"breaks_{b}(x)"]],
                "user_index": 5, "abs_file": "/nonexistent/train.py", "distributed": b == 3, "phase": "forward",
                "compile_id": f"{b}/0", "time": t,
            }
        )  # fmt: skip
    for g in range(16 + 2 * (rank == outlier)):
        # The outlier's two extra graphs issue no collectives (rank-dependent compute, no hang risk).
        seq = ["all_gather_into_tensor"] * 4 + ["all_reduce"] * (g % 3) if g < 16 else []
        evs.append(
            {
                "ev": "compile", "compile_id": f"{g}/0", "function": "step", "code_name": "step",
                "file": "train.py", "line": 100 + g, "op_count": 40 + g, "has_graph": True,
                "collectives": {n: seq.count(n) for n in set(seq)},
                "backward_collectives": {"reduce_scatter_tensor": 4} if seq else {}, "collective_sequence": seq,
                "backward_collective_sequence": ["reduce_scatter_tensor"] * 4 if seq else [], "time_s": 0.5,
                "recompile_reason": "tensor 'x' size mismatch at index 0. expected 8, actual 16" if g >= 14 else None,
                "fail_type": None, "fail_reason": None, "phase": "forward", "time": t,
            }
        )  # fmt: skip
    counters = {"graph_break": nbreaks, "unique_graphs": 16, "calls_captured": 100, "graph_break_missed": 0}
    evs.append({"ev": "end", "counters": counters, "status": 0, "time": t + 60})
    return evs


def write_rank_files(directory: str, ranks: int, *, ranks_per_node: int = 8, outlier: int = 512) -> None:
    """Write ``rank<R>.jsonl`` for ``ranks`` ranks into ``directory`` (see the module docstring)."""
    os.makedirs(directory, exist_ok=True)
    for r in range(ranks):
        with open(os.path.join(directory, f"rank{r}.jsonl"), "w", encoding="utf-8") as f:
            for e in _events(r, ranks, ranks_per_node, outlier):
                f.write(json.dumps(e) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--keep", metavar="DIR", help="write the rank files here and keep them")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dynamo_ext.audit.merge.rank_files import merge_dir
    from dynamo_ext.audit.render.text import render_text

    work = args.keep or tempfile.mkdtemp(prefix="bench-audit-merge-")
    try:
        results = {}
        for n in (args.ranks // 8, args.ranks):
            d = os.path.join(work, f"r{n}")
            write_rank_files(d, n, ranks_per_node=args.ranks_per_node, outlier=n // 2)
            size = sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d))
            t0 = time.perf_counter()
            report = merge_dir(d)
            t1 = time.perf_counter()
            text = render_text(report)
            t2 = time.perf_counter()
            tracemalloc.start()
            merge_dir(d)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            results[n] = (t1 - t0, t2 - t1, peak, size)
            print(
                f"{n:5d} ranks ({size / 2**20:.1f} MiB of rank files): merge {t1 - t0:.2f} s, terminal report "
                f"{t2 - t1:.2f} s, peak Python memory during merge {peak / 2**20:.1f} MiB"
            )
        rows = [
            " ".join(line.split()) for line in text.split("\nRanks")[1].splitlines() if line[:3].strip()[:1].isdigit()
        ]
        print(f"report's ranks table ({len(rows)} rows):", " | ".join(rows))
        small, big = results[args.ranks // 8], results[args.ranks]
        print(
            f"ratio {args.ranks} / {args.ranks // 8} ranks: time {big[0] / small[0]:.1f}x, peak memory "
            f"{big[2] / small[2]:.1f}x, input size {big[3] / small[3]:.1f}x"
        )
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
