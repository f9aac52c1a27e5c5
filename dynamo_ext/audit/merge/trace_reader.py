"""Read a directory of ``TORCH_TRACE`` structured logs (what tlparse reads) as audit events.

A job that already ran with ``TORCH_TRACE=DIR`` can be audited without
running it again: ``dynamo-ext audit merge DIR``.  Each rank's log
(``dedicated_log_torch_trace_rank_<R>_*.log``) is a glog line per structured
record, ``V1123 16:05:09.055000 20606 torch/...py:5098] {metadata JSON}``,
followed by its payload, one tab-indented line per payload line.  Those are
the records :class:`.collector.Collector` reads live (NOTE [audit signals]):
graphs and ``compilation_metrics`` go through the collector unchanged; graph
breaks, which the collector reads from the live exception, are parsed from
the artifact's text here (Dynamo's message: the ``gb_type`` on the
``torch._dynamo.exc.Unsupported:`` line, explanation, hints and the user code
traceback).

NOTE [what a trace cannot say]
A trace holds graph breaks with their user frames, recompiles with the failed
guard, and the graphs (so collectives and hang risks).  It does not hold:
whether a rank finished (no exit status, no exception: statuses are
``unknown``), the rank's host and node, the world size (taken from the files
present, so a rank that wrote nothing is invisible), the numerics check, the
plugin's state, Dynamo's final counters; and frame skips only when the job also
ran with ``TORCH_LOGS=graph_breaks`` (Dynamo logs them only then).  The report
says so in its ``notes``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from ..model.kinds import BreakKind, RankStatus
from ..model.records import AuditReport
from ..rank.collector import Collector, _collapse_resume, parse_message
from ..rank.identity import is_distributed_cause, normalize_path, target_root, user_frame_index
from ..schema.events import EventKind
from .merger import Merger

TRACE_FILE = re.compile(r"^dedicated_log_torch_trace(?:_rank_(\d+))?_.*\.log$")
_GLOG = re.compile(r"^[VIWEC]\d{4} [\d:.]+ +\d+ [^\]]*\] (\{.*\})\s*$")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)\n(?:\s{4,}(.*)\n)?', re.M)
_EXC = re.compile(r"^torch\._dynamo\.exc\.(\w+): (.*)$", re.M)
_SKIP_HEAD = "Graph break: torch.compile cannot properly resume"

NOTES = (
    "read from TORCH_TRACE logs: graph breaks, recompiles and graphs only (NOTE [what a trace cannot say])",
    "not in a trace: whether each rank finished (status 'unknown', no exit status or exception), hosts and nodes, "
    "ranks that wrote no log (the world size is the files present), the numerics check, the plugin's state, "
    "Dynamo's final counters",
    "frame skips are in a trace only if the job also ran with TORCH_LOGS=graph_breaks",
)


def trace_files(directory: str) -> dict[int, str]:
    """``{rank: path}`` of the TORCH_TRACE logs in ``directory`` (a log without a rank is rank 0)."""
    out: dict[int, str] = {}
    for name in sorted(os.listdir(directory)):
        m = TRACE_FILE.match(name)
        if m:
            out.setdefault(int(m.group(1) or 0), os.path.join(directory, name))
    return out


def is_trace_dir(directory: str) -> bool:
    """Whether ``directory`` holds TORCH_TRACE logs."""
    return bool(trace_files(directory))


def records(path: str) -> Iterator[tuple[dict[str, Any], str]]:
    """``(metadata, payload)`` of each structured record of one log, in order, streamed."""
    md: dict[str, Any] | None = None
    payload: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("\t"):
                if md is not None:
                    payload.append(line[1:].rstrip("\n"))
                continue
            m = _GLOG.match(line)
            if not m:
                continue
            if md is not None:
                yield md, "\n".join(payload)
            try:
                md = json.loads(m.group(1))
            except json.JSONDecodeError:
                md = None
            payload = []
    if md is not None:
        yield md, "\n".join(payload)


def break_event(md: dict[str, Any], payload: str, *, root: str | None) -> dict[str, Any]:
    """The ``break`` event (as :class:`.collector.Collector` writes it) of one ``dynamo_graph_break_reason`` text."""
    skipped = payload.startswith(_SKIP_HEAD)
    head, _, tb = payload.partition("\nTraceback (most recent call last):")
    excs = _EXC.findall(tb)
    # Python prints a chain innermost cause first: that is the break's identity; the last one is its wrapper.
    cause_at = tb.find(f"torch._dynamo.exc.{excs[0][0]}: ") if excs else -1
    cause_text = tb[cause_at:].split(": ", 1)[1] if cause_at >= 0 else head
    cause_text = cause_text.split("\n\nThe above exception was the direct cause")[0]
    first, explanation, hints, context = parse_message(cause_text)
    wrapper = excs[-1][1].strip() if len(excs) > 1 and excs[-1][1].strip() != first else ""
    section = head.split("User code traceback:", 1)[1] if "User code traceback:" in head else head
    if skipped:
        section = head.split("in the following user code:", 1)[-1]
    frames = [[f, int(n), fn, (src or "").strip()] for f, n, fn, src in _FRAME.findall(section + "\n")]
    frames = _collapse_resume(frames)
    if not frames:
        m = re.search(r"in user code at (.+):(\d+)", head)
        frames = [[m.group(1), int(m.group(2)), "<unknown>", ""]] if m else [["<unknown>", 0, "<unknown>", ""]]
    files = [f[0] for f in frames]
    idx = user_frame_index(files)
    ca = md.get("compiled_autograd_id")
    frame = f"{md.get('frame_id')}/{md.get('frame_compile_id')}"
    return {
        "ev": EventKind.BREAK,
        "kind": BreakKind.FRAME_SKIP if skipped else BreakKind.GRAPH_BREAK,
        "gb_type": first or "unknown graph break",
        "wrapper": wrapper,
        "reason": first,
        "explanation": explanation,
        "hints": list(hints),
        "context": context,
        "stack": [[normalize_path(f[0], root=root), f[1], f[2], f[3]] for f in frames],
        "user_index": idx,
        "abs_file": frames[idx][0],
        "distributed": is_distributed_cause(first, files, f"{cause_text}\n{context}"),
        "phase": "backward" if ca is not None else "forward",
        "compile_id": frame if ca is None else f"!{ca}/{frame}",
    }


class _Record:
    """What :meth:`.collector.Collector.emit` reads from a ``logging.LogRecord``."""

    def __init__(self, metadata: dict[str, Any], payload: str) -> None:
        self.metadata = metadata
        self.payload = payload


def rank_events(path: str, *, root: str | None) -> Iterator[dict[str, Any]]:
    """The audit events of one rank's TORCH_TRACE log, streamed."""
    out: list[dict[str, Any]] = []
    collector = Collector(out.append, root=root)
    for md, payload in records(path):
        art = md.get("artifact")
        if isinstance(art, dict) and art.get("name") == "dynamo_graph_break_reason":
            out.append(break_event(md, payload, root=root))
        else:
            collector.emit(_Record(md, payload))  # type: ignore[arg-type]
        yield from out
        out.clear()


def _guess_root(path: str) -> str | None:
    """The job's root (:func:`.identity.target_root`) from the first compiled file that exists on this machine."""
    for md, _ in records(path):
        m = md.get("compilation_metrics")
        if isinstance(m, dict) and m.get("co_filename") and os.path.exists(m["co_filename"]):
            return target_root(m["co_filename"])
    return None


def merge_trace_dir(directory: str, *, root: str | None = None) -> AuditReport:
    """The merged report of a TORCH_TRACE directory; ``notes`` say what a trace cannot fill.

    ``root``: what file names are made relative to (default: the target root of
    the first compiled file found on this machine, else the working directory).

    Raises:
        ValueError: ``directory`` holds no TORCH_TRACE logs.
    """
    files = trace_files(directory)
    if not files:
        raise ValueError(f"{directory!r} holds no TORCH_TRACE logs (dedicated_log_torch_trace_rank_*.log)")
    root = root or _guess_root(files[min(files)])
    merger = Merger()
    for rank in sorted(files):
        merger.add_rank(rank, rank_events(files[rank], root=root))
    world = max(files) + 1
    statuses = {
        r: {"status": RankStatus.UNKNOWN}
        if r in files
        else {
            "status": RankStatus.MISSING,
            "error": f"no TORCH_TRACE log for rank {r} (ranks up to {world - 1} wrote one)",
        }
        for r in range(world)
    }
    report = merger.report(target=directory, world_size=world, backend="", statuses=statuses)
    plugin = {"installed": False, "version": "", "error": "unknown: a TORCH_TRACE log does not say"}
    return dataclasses.replace(report, plugin=plugin, notes=NOTES)
