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

Graphs and recompiles are keyed by their identity across ranks (NOTE [graph identity] in :mod:`.identity`).
"""

from __future__ import annotations

import dataclasses
import linecache
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..model.kinds import BreakKind, RankStatus
from ..model.records import AuditReport, Frame, Fusion, Graph, GraphBreak, RankSummary, Recompile
from ..model.steps import StepTally
from ..rank.identity import break_id, fix_for
from ..schema import events as ev
from .identity import RESUME, graph_id, recompile_reason
from .numerics import merge_numerics
from .recompile_why import why_recompiled


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


# NOTE [streaming merge]
# :class:`Merger` folds one rank's events at a time into per-finding
# accumulators (keyed by the break, recompile and graph identities), so merging
# N rank files holds one rank's events plus what the report itself holds: the
# distinct findings, each with its ranks and per-rank counts, and one summary
# per rank.  Collective sequences are interned: 1,000 ranks issuing the same
# sequence share one tuple.  ``benchmarks/bench_audit_merge.py`` measures it.


class Merger:
    """Builds one :class:`AuditReport` from rank event streams, one rank at a time (NOTE [streaming merge]).

    ``add_rank(rank, events)`` consumes an iterable of event dicts (a rank
    file being read, see :mod:`.rank_files`); ``report(...)`` gives the merged
    report.  :func:`merge` is the same for event lists already in memory.
    """

    def __init__(self) -> None:
        self._recompiles: dict[str, dict[str, Any]] = {}
        self._resume_recompiles: dict[tuple[str, int], int] = defaultdict(int)
        self._breaks: dict[str, dict[str, Any]] = {}
        self._graphs: dict[str, dict[str, Any]] = {}
        self._interned: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._ranks: dict[int, dict[str, Any]] = {}
        self._numerics: dict[int, ev.Numerics] = {}
        self._internal: list[str] = []
        self._plugin: dict[str, Any] = {}
        # The events .comm.merge_comm reads, for ranks that recorded a communication report.
        self._comm_events: dict[int, list[ev.Event]] = {}

    def _intern(self, seq: list[str]) -> tuple[str, ...]:
        t = tuple(seq)
        return self._interned.setdefault(t, t)

    def add_rank(self, rank: int, events: Iterable[ev.Event | dict[str, Any]]) -> None:
        """Fold every event of ``rank`` (read once, in order): typed events, or their rank-file dicts.

        Raises:
            ValueError: a dict that is no valid event (:func:`..schema.events.parse_event`).
        """
        info: dict[str, Any] = {
            "start": {},
            "end": None,
            "error": None,
            "graph_breaks": 0,
            "frame_skips": 0,
            "graphs": 0,
            "recompiles": 0,
            "compile_time_s": 0.0,
            "tally": StepTally(),  # NOTE [steps] in schema/events.py
        }
        seqs: dict[str, list[str]] = defaultdict(list)
        comm: list[ev.Event] = []
        has_comm = False
        # Fusions by compile id: a forward graph's arrive before its compile event, a lazy backward's after it.
        graph_of: dict[str, str] = {}
        pending: dict[str, list[ev.Fusion]] = defaultdict(list)
        for raw in events:
            e = ev.parse_event(raw)
            if isinstance(e, ev.Break):
                self._add_break(rank, e)
                kind = "frame_skips" if e.kind == BreakKind.FRAME_SKIP else "graph_breaks"
                info[kind] += 1
                info["tally"].add(e.step, kind)
            elif isinstance(e, ev.Compile):
                # What the communication report needs of a compile: its graph's identity.
                comm.append(dataclasses.replace(e, collectives={}, backward_collectives={}, collective_sequence=(),
                                                backward_collective_sequence=(), fail_reason=None))  # fmt: skip
                info["compile_time_s"] += e.time_s
                if e.recompile_reason:
                    info["recompiles"] += 1
                    info["tally"].add(e.step, "recompiles")
                    self._add_recompile(rank, e)
                if e.has_graph:
                    info["graphs"] += 1
                    info["tally"].add(e.step, "graphs")
                    gid = self._add_graph(rank, e)
                    seqs[gid] += _sequence(e)
                    graph_of[e.compile_id] = gid
                    for f in pending.pop(e.compile_id, ()):
                        self._add_fusion(rank, gid, f)
                else:
                    pending.pop(e.compile_id, None)
            elif isinstance(e, ev.Fusion):
                if e.after_compile and e.compile_id in graph_of:
                    self._add_fusion(rank, graph_of[e.compile_id], e)
                else:
                    pending[e.compile_id].append(e)
            elif isinstance(e, ev.CommGraph):
                comm.append(e)
                has_comm = True
            elif isinstance(e, ev.Start):
                info["start"] = {"host": e.host, "node_rank": e.node_rank, "local_rank": e.local_rank}
                self._plugin = self._plugin or dict(e.plugin)
            elif isinstance(e, ev.End):
                info["end"] = {"counters": e.counters, "steps": e.steps}
            elif isinstance(e, ev.Error):
                info["error"] = info["error"] or e.message
            elif isinstance(e, ev.Numerics):
                comm.append(e)
                self._numerics[rank] = e
            elif isinstance(e, ev.Internal):
                self._internal.append(f"rank {rank}: {e.message}")
        # Fusions still pending belong to a compile that never finished (no graph): left out.
        for gid, seq in seqs.items():
            self._graphs[gid]["seqs"][rank] = self._intern(seq)
        self._ranks[rank] = info
        if has_comm:
            self._comm_events[rank] = comm

    def _add_recompile(self, rank: int, e: ev.Compile) -> None:
        reason = recompile_reason(e.recompile_reason)
        rid = f"{e.file}:{e.line} {e.function} | {reason}"
        g = self._recompiles.setdefault(rid, {"e": e, "reason": reason, "counts": defaultdict(int), "steps": set()})
        g["counts"][rank] += 1
        g["steps"].add(e.step)
        m = RESUME.match(e.code_name)
        if m:
            self._resume_recompiles[(e.file, int(m.group(2)))] += 1

    def _add_break(self, rank: int, e: ev.Break) -> None:
        stack = e.stack
        user = len(stack) - 1 if e.user_index is None else e.user_index
        idx = min(max(user, 0), len(stack) - 1)
        file, line, function, _ = stack[idx]
        bid = break_id(e.gb_type, file, int(line), function)
        g = self._breaks.setdefault(
            bid,
            {"e": e, "idx": idx, "counts": defaultdict(int), "phases": set(), "kinds": set(), "wrappers": set(),
             "steps": set()},
        )  # fmt: skip
        g["counts"][rank] += 1
        g["steps"].add(e.step)
        g["phases"].add(e.phase)
        g["kinds"].add(e.kind)
        if e.wrapper:
            g["wrappers"].add(e.wrapper)

    def _add_fusion(self, rank: int, gid: str, f: ev.Fusion) -> None:
        key = (f.fusion, f.kernel, f.group_name, f.nbytes, f.node, f.phase)
        self._graphs[gid]["fusions"].setdefault(key, set()).add(rank)

    def _add_graph(self, rank: int, e: ev.Compile) -> str:
        gid = graph_id(e)
        g = self._graphs.setdefault(
            gid, {"e": e, "ops": {}, "colls": None, "seqs": {}, "time": 0.0, "fusions": {}, "steps": set()}
        )
        g["ops"][rank] = e.op_count
        g["steps"].add(e.step)
        if g["colls"] is None:
            g["colls"] = (tuple(sorted(e.collectives.items())), tuple(sorted(e.backward_collectives.items())))
        g["time"] = max(g["time"], e.time_s)
        return gid

    # ---- the report ---------------------------------------------------------------
    def report(
        self,
        *,
        target: str,
        world_size: int,
        backend: str,
        statuses: dict[int, dict[str, Any]] | None = None,
        errors: tuple[str, ...] = (),
        torch_version: str | None = None,
        ranks: tuple[int, ...] | None = None,
    ) -> AuditReport:
        """The merged report.

        ``statuses[rank]`` may give ``status`` (ok/error/died/timeout/stopped/missing),
        ``error`` and ``log``; a rank without one is ``error`` when it recorded an
        error, ``ok`` when it sent an ``end`` event, else ``died``.  ``ranks``: the
        ranks the report covers (default ``0 .. world_size - 1``; an in-process audit
        on rank 3 covers ``(3,)``).
        """
        covered = tuple(range(world_size)) if ranks is None else ranks
        statuses = {r: dict(s) for r, s in (statuses or {}).items()}
        for r in covered:
            info = self._ranks.get(r, {})
            st = statuses.setdefault(r, {})
            if "status" not in st:
                st["status"] = (
                    RankStatus.ERROR if info.get("error") else (RankStatus.OK if info.get("end") else RankStatus.DIED)
                )
            if not st.get("error") and info.get("error"):
                st["error"] = info["error"]
        ok = {r for r, s in statuses.items() if s.get("status") == RankStatus.OK}
        ref = ok or set(self._ranks)
        multi = len(ref) > 1
        recompiles = self._recompile_records(ref, multi)
        breaks = self._break_records(ref, multi)
        graphs = self._graph_records(ref, multi)
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
        summaries = tuple(self._rank_summary(r, statuses[r]) for r in covered)
        from .comm import merge_comm

        return AuditReport(
            target=target,
            world_size=world_size,
            backend=backend,
            torch_version=torch_version or torch.__version__,
            plugin=self._plugin or {"installed": False, "version": "", "error": "no rank started"},
            graph_breaks=tuple(breaks),
            graphs=tuple(graphs),
            recompiles=recompiles,
            ranks=summaries,
            errors=tuple(errors) + tuple(self._internal),
            numerics=merge_numerics(self._numerics),
            comm=merge_comm(
                self._comm_events, ref, graph_id, breaks=tuple(dict.fromkeys(f"{b.file}:{b.line}" for b in breaks))
            ),
        )

    def _recompile_records(self, ref: set[int], multi: bool) -> tuple[Recompile, ...]:
        out = (
            Recompile(
                id=rid,
                function=g["e"].function,
                file=g["e"].file,
                line=g["e"].line,
                reason=g["reason"],
                ranks=tuple(sorted(g["counts"])),
                count_by_rank=tuple(sorted(g["counts"].items())),
                hang_risk=False,
                divergent=multi and _divergent(g["counts"], ref),
                steps=_steps(g["steps"]),
                why=why_recompiled(g["reason"]),
            )
            for rid, g in self._recompiles.items()
        )
        return tuple(sorted(out, key=lambda r: (-r.count, r.id)))

    def _break_records(self, ref: set[int], multi: bool) -> list[GraphBreak]:
        breaks = []
        for bid, g in self._breaks.items():
            e, idx = g["e"], g["idx"]
            frames = tuple(Frame(str(f[0]), int(f[1]), str(f[2]), str(f[3])) for f in e.stack)
            user = frames[idx]
            counts = dict(g["counts"])
            caused = sum(
                n
                for (file, line), n in self._resume_recompiles.items()
                if any(f.file == file and f.line == line for f in frames)
            )
            occurrences = sum(counts.values())
            text = "\n".join(
                [
                    e.context,
                    e.explanation,
                    e.reason,
                    *(f"{f.file} {f.source}" for f in frames),
                ]
            )
            breaks.append(
                GraphBreak(
                    id=bid,
                    kind=BreakKind.FRAME_SKIP if BreakKind.FRAME_SKIP in g["kinds"] else BreakKind.GRAPH_BREAK,
                    gb_type=e.gb_type,
                    wrapper=", ".join(sorted(g["wrappers"])),
                    file=user.file,
                    line=user.line,
                    function=user.function,
                    source=user.source,
                    reason=e.reason,
                    explanation=e.explanation,
                    hints=e.hints,
                    fix=fix_for(e.gb_type, text, e.hints, e.distributed),
                    distributed=e.distributed,
                    phase=_phase(g["phases"]),
                    ranks=tuple(sorted(counts)),
                    count_by_rank=tuple(sorted(counts.items())),
                    stack=frames,
                    snippet=_snippet(user.file if e.abs_file is None else e.abs_file, user.line),
                    recompiles_caused=caused,
                    hang_risk=False,
                    divergent=multi and _divergent(counts, ref),
                    impact=occurrences * len(counts) + occurrences + 2 * caused,
                    steps=_steps(g["steps"]),
                )
            )
        breaks.sort(key=lambda b: (-b.impact, not b.distributed, b.id))
        return breaks

    def _graph_records(self, ref: set[int], multi: bool) -> list[Graph]:
        graphs = []
        for gid, g in self._graphs.items():
            e = g["e"]
            seqs = g["seqs"]
            present = set(g["ops"])
            divergent = multi and (len(set(g["ops"].values())) > 1 or not ref <= present)
            # Ranks lacking the graph issue none of its collectives.
            ref_seqs = {seqs.get(r, ()) for r in ref}
            graphs.append(
                Graph(
                    id=gid,
                    function=e.function,
                    file=e.file,
                    line=e.line,
                    phase=e.phase,
                    ranks=tuple(sorted(g["ops"])),
                    op_count_by_rank=tuple(sorted(g["ops"].items())),
                    collectives=g["colls"][0],
                    backward_collectives=g["colls"][1],
                    compile_time_s=round(g["time"], 4),
                    hang_risk=multi and len(ref_seqs) > 1,
                    divergent=divergent,
                    collective_sequence_by_rank=tuple(sorted({**dict.fromkeys(ref, ()), **seqs}.items())),
                    fusions=tuple(Fusion(*k, ranks=tuple(sorted(rs))) for k, rs in g["fusions"].items()),
                    steps=_steps(g["steps"]),
                )
            )
        return graphs

    def _rank_summary(self, r: int, st: dict[str, Any]) -> RankSummary:
        info = self._ranks.get(r, {})
        start = info.get("start", {})
        end = info.get("end")
        counters = (end or {}).get("counters", {})
        return RankSummary(
            rank=r,
            status=RankStatus(st["status"]),
            error=st.get("error", "") or "",
            graph_breaks=info.get("graph_breaks", 0),
            frame_skips=info.get("frame_skips", 0),
            graphs=info.get("graphs", 0),
            recompiles=info.get("recompiles", 0),
            compile_time_s=round(info.get("compile_time_s", 0.0), 4),
            dynamo_graph_breaks=counters.get("graph_break") if counters else None,
            dynamo_missed=int(counters.get("graph_break_missed", 0) or 0),
            dynamo_unique_graphs=counters.get("unique_graphs") if counters else None,
            log=st.get("log", "") or "",
            host=str(st.get("host") or start.get("host") or ""),
            node_rank=st.get("node_rank", start.get("node_rank")),
            local_rank=start.get("local_rank"),
            waiting=tuple(st.get("waiting", ())),  # RankWait records: only the launcher knows them
            steps=info["tally"].counts((end or {}).get("steps")) if "tally" in info else (),
        )


def merge(
    events_by_rank: Mapping[int, Iterable[ev.Event | dict[str, Any]]],
    *,
    target: str,
    world_size: int,
    backend: str,
    statuses: dict[int, dict[str, Any]] | None = None,
    errors: tuple[str, ...] = (),
    ranks: tuple[int, ...] | None = None,
) -> AuditReport:
    """One report from every rank's events (in memory; :class:`Merger` for streams).

    ``statuses[rank]`` may give ``status`` (ok/error/died/timeout), ``error`` and
    ``log``; a rank without one is ``ok`` when it sent an ``end`` event, else
    ``died``.  ``ranks``: as :meth:`Merger.report`.
    """
    m = Merger()
    for rank, evs in sorted(events_by_rank.items()):
        m.add_rank(rank, evs)
    return m.report(
        target=target, world_size=world_size, backend=backend, statuses=statuses, errors=errors, ranks=ranks
    )


def _sequence(e: ev.Compile) -> list[str]:
    """The collectives a compile issues, in order: forward graph, then backward (``bwd:`` names)."""
    return [*e.collective_sequence, *(f"bwd:{n}" for n in e.backward_collective_sequence)]


def _steps(seen: set[int | None]) -> tuple[int, ...]:
    return tuple(sorted(s for s in seen if s is not None))


def _divergent(counts: dict[int, int], ref: set[int]) -> bool:
    """Some reference rank lacks it, or the reference ranks have it a different number of times."""
    if not ref <= set(counts):
        return True
    return len({counts[r] for r in ref}) > 1
