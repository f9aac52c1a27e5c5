"""Merge the event streams of every rank into one :class:`AuditReport`.

NOTE [impact and hang risk]
A break's impact is ``occurrences x ranks affected + graphs split +
2 x recompiles caused``: every occurrence splits a graph on its rank, and a
recompile of the resume function that follows the break costs a full compile.
A break, graph or recompile that some finished ranks have and others do not
(or have a different number of times, or with different ops) is *divergent*.
That alone is no hang risk: the plugin's rooted collectives (broadcast, reduce,
scatter, gather) and rank-dependent compute legitimately compile different
graphs per rank.  A graph is a **hang risk** when the ordered sequence of
collectives it issues (forward, then backward) differs between the finished
ranks, a rank lacking the graph issuing none; a divergent break or recompile
is a hang risk when a graph of its code is.  Ranks whose collective sequences
differ wait on collectives their peers never issue.

NOTE [graph identity]
A graph is identified by its code object (``file:firstline function``, resume
functions named after the function they resume) and why it was compiled: the
first compile has no suffix, a recompile ``| recompile: <failed guard>``.  Not
by compile order: an extra recompile on one rank leaves every other identity
as it was.  Compiles with the same identity on a rank are one row, with their
collective sequences concatenated in compile order.
"""

from __future__ import annotations

import dataclasses
import linecache
import re
from collections import defaultdict
from typing import Any

import torch

from .identity import break_id, fix_for
from .records import AuditReport, Frame, Graph, GraphBreak, Numerics, NumericsMismatch, RankSummary, Recompile

_RESUME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_(\d+)$")
_CID_PREFIX = re.compile(r"^\s*!?[\d/]+:\s*", re.M)


def _snippet(path: str, line: int, context: int = 3) -> tuple[tuple[int, str], ...]:
    if not path or line <= 0:
        return ()
    out = []
    for n in range(max(1, line - context), line + context + 1):
        text = linecache.getline(path, n)
        if not text and n > line:
            break
        out.append((n, text.rstrip("\n")))
    return tuple(out)


def _phase(phases: set[str]) -> str:
    return "+".join(p for p in ("forward", "backward") if p in phases) or "forward"


def _reference_ranks(events_by_rank: dict[int, list[dict[str, Any]]], statuses: dict[int, dict[str, Any]]) -> set[int]:
    ok = {r for r, s in statuses.items() if s.get("status") == "ok"}
    return ok or set(events_by_rank)


def merge(
    events_by_rank: dict[int, list[dict[str, Any]]],
    *,
    target: str,
    world_size: int,
    backend: str,
    statuses: dict[int, dict[str, Any]] | None = None,
    errors: tuple[str, ...] = (),
) -> AuditReport:
    """One report from every rank's events.

    ``statuses[rank]`` may give ``status`` (ok/error/died/timeout), ``error`` and
    ``log``; a rank without one is ``ok`` when it sent an ``end`` event, else
    ``died``.
    """
    statuses = dict(statuses or {})
    for r in range(world_size):
        evs = events_by_rank.get(r, [])
        st = statuses.setdefault(r, {})
        if "status" not in st:
            err = next((e for e in evs if e["ev"] == "error"), None)
            ended = any(e["ev"] == "end" for e in evs)
            st["status"] = "error" if err else ("ok" if ended else "died")
        if not st.get("error"):
            err = next((e for e in evs if e["ev"] == "error"), None)
            if err:
                st["error"] = err["message"]
    ref = _reference_ranks(events_by_rank, statuses)
    multi = len(ref) > 1

    # ---- recompiles (needed first: breaks count the recompiles they cause) ----
    rec_groups: dict[str, dict[str, Any]] = {}
    resume_recompiles: dict[tuple[str, int], int] = defaultdict(int)
    for rank, evs in sorted(events_by_rank.items()):
        for e in evs:
            if e["ev"] != "compile" or not e.get("recompile_reason"):
                continue
            reason = _CID_PREFIX.sub("", str(e["recompile_reason"])).strip()
            rid = f"{e['file']}:{e['line']} {e['function']} | {reason}"
            g = rec_groups.setdefault(rid, {"e": e, "reason": reason, "counts": defaultdict(int)})
            g["counts"][rank] += 1
            m = _RESUME.match(e.get("code_name", ""))
            if m:
                resume_recompiles[(e["file"], int(m.group(2)))] += 1
    recompiles = tuple(
        Recompile(
            id=rid,
            function=g["e"]["function"],
            file=g["e"]["file"],
            line=int(g["e"]["line"]),
            reason=g["reason"],
            ranks=tuple(sorted(g["counts"])),
            count_by_rank=tuple(sorted(g["counts"].items())),
            hang_risk=False,
            divergent=multi and _divergent(g["counts"], ref),
        )
        for rid, g in rec_groups.items()
    )
    recompiles = tuple(sorted(recompiles, key=lambda r: (-r.count, r.id)))

    # ---- graph breaks ---------------------------------------------------------------
    groups: dict[str, dict[str, Any]] = {}
    for rank, evs in sorted(events_by_rank.items()):
        for e in evs:
            if e["ev"] != "break":
                continue
            stack = e["stack"]
            idx = min(max(int(e.get("user_index", len(stack) - 1)), 0), len(stack) - 1)
            file, line, function, _ = stack[idx]
            bid = break_id(e["gb_type"], file, int(line), function)
            g = groups.setdefault(
                bid,
                {"e": e, "idx": idx, "counts": defaultdict(int), "phases": set(), "kinds": set(), "wrappers": set()},
            )
            g["counts"][rank] += 1
            g["phases"].add(e.get("phase", "forward"))
            g["kinds"].add(e["kind"])
            if e.get("wrapper"):
                g["wrappers"].add(e["wrapper"])
    breaks = []
    for bid, g in groups.items():
        e, idx = g["e"], g["idx"]
        frames = tuple(Frame(str(f[0]), int(f[1]), str(f[2]), str(f[3])) for f in e["stack"])
        user = frames[idx]
        counts = dict(g["counts"])
        caused = sum(
            n for (file, line), n in resume_recompiles.items() if any(f.file == file and f.line == line for f in frames)
        )
        occurrences = sum(counts.values())
        text = "\n".join(
            [
                e.get("context", ""),
                e.get("explanation", ""),
                e.get("reason", ""),
                *(f"{f.file} {f.source}" for f in frames),
            ]
        )
        breaks.append(
            GraphBreak(
                id=bid,
                kind="frame_skip" if "frame_skip" in g["kinds"] else "graph_break",
                gb_type=e["gb_type"],
                wrapper=", ".join(sorted(g["wrappers"])),
                file=user.file,
                line=user.line,
                function=user.function,
                source=user.source,
                reason=e.get("reason", ""),
                explanation=e.get("explanation", ""),
                hints=tuple(e.get("hints", ())),
                fix=fix_for(e["gb_type"], text, e.get("hints", ()), bool(e["distributed"])),
                distributed=bool(e["distributed"]),
                phase=_phase(g["phases"]),
                ranks=tuple(sorted(counts)),
                count_by_rank=tuple(sorted(counts.items())),
                stack=frames,
                snippet=_snippet(e.get("abs_file", user.file), user.line),
                recompiles_caused=caused,
                hang_risk=False,
                divergent=multi and _divergent(counts, ref),
                impact=occurrences * len(counts) + occurrences + 2 * caused,
            )
        )
    breaks.sort(key=lambda b: (-b.impact, not b.distributed, b.id))

    # ---- graphs (NOTE [graph identity]) -------------------------------------------------
    ggroups: dict[str, dict[str, Any]] = {}
    for rank, evs in sorted(events_by_rank.items()):
        for e in evs:
            if e["ev"] != "compile" or not e.get("has_graph"):
                continue
            gid = graph_id(e)
            g = ggroups.setdefault(gid, {"e": e, "ops": {}, "colls": {}, "seqs": defaultdict(list), "time": 0.0})
            g["ops"][rank] = int(e["op_count"])
            g["colls"].setdefault(
                rank,
                (tuple(sorted(e["collectives"].items())), tuple(sorted(e["backward_collectives"].items()))),
            )
            g["seqs"][rank] += _sequence(e)
            g["time"] = max(g["time"], float(e.get("time_s") or 0.0))
    graphs = []
    for gid, g in ggroups.items():
        e = g["e"]
        colls = next(iter(g["colls"].values()))
        seqs = {r: tuple(s) for r, s in g["seqs"].items()}
        present = set(g["ops"])
        divergent = multi and (len(set(g["ops"].values())) > 1 or not ref <= present)
        # Ranks lacking the graph issue none of its collectives.
        ref_seqs = {seqs.get(r, ()) for r in ref}
        graphs.append(
            Graph(
                id=gid,
                function=e["function"],
                file=e["file"],
                line=int(e["line"]),
                phase=e.get("phase", "forward"),
                ranks=tuple(sorted(g["ops"])),
                op_count_by_rank=tuple(sorted(g["ops"].items())),
                collectives=colls[0],
                backward_collectives=colls[1],
                compile_time_s=round(g["time"], 4),
                hang_risk=multi and len(ref_seqs) > 1,
                divergent=divergent,
                collective_sequence_by_rank=tuple(sorted({**dict.fromkeys(ref, ()), **seqs}.items())),
            )
        )
    risky = {(g.file, g.function) for g in graphs if g.hang_risk}
    if risky:
        # A rank-divergent break or recompile in code whose graphs' collectives differ is where the risk comes from.
        breaks = [
            dataclasses.replace(b, hang_risk=True)
            if b.divergent and any((f.file, f.function) in risky for f in b.stack)
            else b
            for b in breaks
        ]
        recompiles = tuple(
            dataclasses.replace(r, hang_risk=True) if r.divergent and (r.file, r.function) in risky else r
            for r in recompiles
        )

    # ---- ranks ------------------------------------------------------------------
    ranks = []
    plugin: dict[str, Any] = {}
    for r in range(world_size):
        evs = events_by_rank.get(r, [])
        start = next((e for e in evs if e["ev"] == "start"), {})
        plugin = plugin or dict(start.get("plugin", {}))
        end = next((e for e in evs if e["ev"] == "end"), None)
        counters = (end or {}).get("counters", {})
        st = statuses[r]
        ranks.append(
            RankSummary(
                rank=r,
                status=st["status"],
                error=st.get("error", "") or "",
                graph_breaks=sum(1 for e in evs if e["ev"] == "break" and e["kind"] == "graph_break"),
                frame_skips=sum(1 for e in evs if e["ev"] == "break" and e["kind"] == "frame_skip"),
                graphs=sum(1 for e in evs if e["ev"] == "compile" and e.get("has_graph")),
                recompiles=sum(1 for e in evs if e["ev"] == "compile" and e.get("recompile_reason")),
                compile_time_s=round(sum(float(e.get("time_s") or 0.0) for e in evs if e["ev"] == "compile"), 4),
                dynamo_graph_breaks=counters.get("graph_break") if end else None,
                dynamo_missed=int(counters.get("graph_break_missed", 0) or 0),
                dynamo_unique_graphs=counters.get("unique_graphs") if end else None,
                log=st.get("log", "") or "",
            )
        )
    numerics = _numerics(events_by_rank)
    from .comm_merge import merge_comm

    comm = merge_comm(events_by_rank, ref, graph_id)
    internal = tuple(
        f"rank {r}: {e['message']}" for r, evs in sorted(events_by_rank.items()) for e in evs if e["ev"] == "internal"
    )
    return AuditReport(
        target=target,
        world_size=world_size,
        backend=backend,
        torch_version=torch.__version__,
        plugin=plugin or {"installed": False, "version": "", "error": "no rank started"},
        graph_breaks=tuple(breaks),
        graphs=tuple(graphs),
        recompiles=recompiles,
        ranks=tuple(ranks),
        errors=tuple(errors) + internal,
        numerics=numerics,
        comm=comm,
    )


def _numerics(events_by_rank: dict[int, list[dict[str, Any]]]) -> Numerics | None:
    per_rank = {r: e for r, evs in events_by_rank.items() for e in evs if e["ev"] == "numerics"}
    if not per_rank:
        return None
    mismatches = sorted(
        (
            NumericsMismatch(
                rank=r,
                index=int(m["index"]),
                kind=m["kind"],
                name=m["name"],
                detail=m.get("detail", ""),
                max_abs=m.get("max_abs"),
                max_rel=m.get("max_rel"),
            )
            for r, e in per_rank.items()
            for m in e["mismatches"]
        ),
        key=lambda m: (m.index, m.rank),
    )
    return Numerics(
        compared=max(int(e["compared"]) for e in per_rank.values()),
        ranks=tuple(sorted(per_rank)),
        mismatches=tuple(mismatches),
    )


def graph_id(e: dict[str, Any]) -> str:
    """The identity of a compiled graph: its code object and why it was compiled (see NOTE [graph identity])."""
    base = f"{e['file']}:{e['line']} {e['function']}"
    reason = _CID_PREFIX.sub("", str(e.get("recompile_reason") or "")).strip()
    return f"{base} | recompile: {reason.splitlines()[0].split('  #')[0].strip()}" if reason else base


def _sequence(e: dict[str, Any]) -> list[str]:
    """The collectives a compile issues, in order: forward graph, then backward (``bwd:`` names)."""
    fwd = e.get("collective_sequence")
    bwd = e.get("backward_collective_sequence")
    if fwd is None:  # events from before sequences were recorded: sorted counts
        fwd = [n for n, k in sorted(e.get("collectives", {}).items()) for _ in range(k)]
        bwd = [n for n, k in sorted(e.get("backward_collectives", {}).items()) for _ in range(k)]
    return list(fwd) + [f"bwd:{n}" for n in bwd or ()]


def _divergent(counts: dict[int, int], ref: set[int]) -> bool:
    """Some reference rank lacks it, or the reference ranks have it a different number of times."""
    if not ref <= set(counts):
        return True
    return len({counts[r] for r in ref}) > 1
