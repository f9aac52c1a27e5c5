"""The communication report, merged: rank events -> :class:`.records.Comm`; and the eager count it is checked against.

NOTE [like-with-like collective counts]
``CommDebugMode`` counts what the eager step dispatches: DTensor's functional
collectives under their legacy names (``c10d_functional.all_reduce``) and
FSDP2's c10d ops (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``).
Both map to a traffic kind (:data:`..rank.eager_comm.EAGER_KINDS`, :data:`..rank.comm.TRAFFIC`).
Eager FSDP2 issues one all-gather (and one reduce-scatter) of a flat buffer per
FSDP group; the plugin's traced FSDP2 issues one all-gather per group too (one per
parameter for a root gathered again in backward, NOTE [FSDP2 gathers per group])
and one reduce-scatter per parameter, so compiled FSDP collectives are counted
once per (graph, module, kind) - one FSDP group, the module that ``fully_shard``
wrapped - and every other collective once.
FSDP2's all-reduces are the exception: the plugin traces no HSDP (its one
all-reduce per group; ``variables/fsdp/hooks.py`` refuses it), so a traced FSDP2
all-reduce is the reduction of a gradient that is ``Partial`` on another mesh
axis (a norm weight replicated over "tp"), which eager FSDP2 also issues once
per parameter: each counts.
Inlined AOT backward graphs (compiled autograd runs their copy) are not counted.
Where the counts still differ, :mod:`.comm_explain` says why per module.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ..model.records import Collective, Comm, CountDifference, ModuleComm
from ..schema import events as ev


def _later(step: int | None, first: int | None) -> bool:
    """A graph compiled after the first training step that compiled one (``first``): counted in no total
    (NOTE [steps], :class:`.records.Comm`)."""
    return step is not None and first is not None and step > first


def _like_counted(colls: list[Collective], first: int | None = None) -> list[Collective]:
    """The collectives the like-with-like count takes (NOTE [like-with-like collective counts])."""
    out = []
    fsdp_seen: set[tuple[str, str, str, str]] = set()
    for c in colls:
        if c.inlined or _later(c.step, first):
            continue
        if c.origin == "fsdp" and c.kind != "all_reduce":
            key = (c.graph, c.graph_kind, c.module, c.kind)
            if key in fsdp_seen:
                continue
            fsdp_seen.add(key)
        out.append(c)
    return out


def _like_counts(counted: list[Collective]) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for c in counted:
        counts[(c.phase, c.kind)] += 1
    return counts


def merge_comm(
    events_by_rank: dict[int, list[ev.Event]], ref: set[int], graph_id_of: Any, breaks: tuple[str, ...] = ()
) -> Comm | None:
    """One :class:`Comm` from every rank's ``comm_graph`` events; ``None`` when no rank sent one.

    ``graph_id_of(compile_event)`` names a graph (:func:`.identity.graph_id`);
    ``ref``: the ranks whose records are shown (the finished ones); ``breaks``: ``"file:line"`` of
    the graph breaks, named where a count difference comes from code run eagerly.
    """
    if not any(isinstance(e, ev.CommGraph) for evs in events_by_rank.values() for e in evs):
        return None
    missing = tuple(
        f"rank {r}: {e.missing}"
        for r, evs in sorted(events_by_rank.items())
        for e in evs
        if isinstance(e, ev.CommGraph) and e.missing
    )
    # The first training step that compiled a graph: the counts and totals are its (NOTE [steps]).
    first = min(
        (e.step for evs in events_by_rank.values() for e in evs if isinstance(e, ev.CommGraph) and e.step is not None),
        default=None,
    )
    unknown: list[str] = []
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    order: list[tuple[str, str, int]] = []
    per_rank_sent: dict[int, int] = defaultdict(int)
    for rank, evs in sorted(events_by_rank.items()):
        ids = {e.compile_id: graph_id_of(e) for e in evs if isinstance(e, ev.Compile)}
        graphs = [e for e in evs if isinstance(e, ev.CommGraph)]
        inlined_ids = {i for g in graphs for i in g.inlined_aot_ids}
        seen: dict[tuple[str, str], int] = defaultdict(int)
        for g in graphs:
            gid = ids.get(g.compile_id, g.compile_id)
            inlined = g.graph == "backward" and g.aot_id in inlined_ids
            if g.graph == "backward" and g.aot_id is None and inlined_ids and g.collectives:
                unknown.append(f"rank {rank}: {gid}: AOT backward graph without an aot_id: inlined or not is unknown")
            base = seen[(gid, g.graph)]  # a graph compiled twice with one identity: rows follow on
            seen[(gid, g.graph)] += len(g.collectives)
            for c in g.collectives:
                key = (gid, g.graph, base + int(c["index"]))
                if not inlined and not _later(g.step, first):
                    per_rank_sent[rank] += int(c["sent"])
                row = rows.get(key)
                if row is None:
                    row = rows[key] = {"c": c, "g": g, "inlined": inlined, "ranks": [], "sent": {}}
                    order.append(key)
                elif rank in ref and row["ranks"] and row["ranks"][0] not in ref:
                    row["c"] = c
                row["ranks"].append(rank)
                row["sent"][rank] = int(c["sent"])
    colls = []
    for key in order:
        row = rows[key]
        c, g = row["c"], row["g"]
        colls.append(
            Collective(
                graph=key[0],
                graph_kind=g.graph,
                phase="forward" if g.graph == "forward" else "backward",
                index=key[2],
                op=c["op"],
                kind=c["kind"],
                group=c["group"],
                group_size=int(c["group_size"]),
                group_ranks=tuple(c["group_ranks"]),
                mesh_axis=c["mesh_axis"],
                dtype=c["dtype"],
                shape_in=str(c["shape_in"]),
                shape_out=str(c["shape_out"]),
                bytes_in=int(c["bytes_in"]),
                bytes_out=int(c["bytes_out"]),
                sent=max(row["sent"].values()),
                received=int(c["received"]),
                est_ms=c["est_ms"],
                overlap_ops=c["overlap_ops"],
                file=c["file"],
                line=int(c["line"]),
                function=c["function"],
                source=c["source"],
                module=c["module"],
                origin=c["origin"],
                placements_before=c["placements_before"],
                placements_after=c["placements_after"],
                placements_basis=c["placements_basis"],
                alternative=c["alternative"],
                alternative_basis=c["alternative_basis"],
                ranks=tuple(sorted(row["ranks"])),
                sent_by_rank=tuple(sorted(row["sent"].items())),
                inlined=row["inlined"],
                step=g.step,
            )
        )
    modules: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for c in colls:
        if not c.inlined and not _later(c.step, first):
            m = modules[(c.module or "-", c.phase)]
            m[0] += 1
            m[1] += c.sent
            m[2] += c.est_ms or 0.0
    counted = _like_counted(colls, first)
    like = _like_counts(counted)
    eager = _eager_counts(events_by_rank, ref)
    differences: tuple[CountDifference, ...] = ()
    if eager is not None:
        from .comm_explain import eager_modules_of, eager_outside_root, explain_counts

        events = events_by_rank.get(_numerics_rank(events_by_rank, ref) or 0, [])
        differences = explain_counts(
            like,
            {(ph, k): n for ph, k, n in eager},
            eager_modules_of(events),
            colls,
            counted,
            list(breaks),
            eager_c10d=eager_modules_of(events, "modules_c10d"),
            outside_root=eager_outside_root(events),
        )
    return Comm(
        collectives=tuple(colls),
        modules=tuple(
            ModuleComm(module=mod, phase=ph, count=int(v[0]), sent=int(v[1]), est_ms=round(v[2], 6))
            for (mod, ph), v in sorted(modules.items(), key=lambda kv: (kv[0][1] != "forward", -kv[1][1], kv[0][0]))
        ),
        bytes_per_step=max(per_rank_sent.values(), default=0),
        bytes_by_rank=tuple(sorted(per_rank_sent.items())),
        est_ms_per_step=round(sum(c.est_ms or 0.0 for c in colls if not c.inlined and not _later(c.step, first)), 6),
        counts=tuple((ph, k, n) for (ph, k), n in sorted(like.items())),
        eager_counts=eager,
        missing=missing + tuple(unknown),
        count_differences=differences,
        later_steps=_later_lines(colls, first),
    )


def _later_lines(colls: list[Collective], first: int | None) -> tuple[str, ...]:
    """One line per graph compiled after the first step: its step, identity, kind and collectives."""
    by: dict[tuple[int, str, str], dict[str, int]] = {}
    for c in colls:
        if _later(c.step, first) and not c.inlined:
            kinds = by.setdefault((c.step or 0, c.graph, c.graph_kind), {})
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return tuple(
        f"step {step}: {kind} graph {graph}: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        for (step, graph, kind), kinds in sorted(by.items())
    )


def _numerics_rank(events_by_rank: dict[int, list[ev.Event]], ref: set[int]) -> int | None:
    """The first rank (finished ones first) whose ``numerics`` event has eager counts."""
    for rank in sorted(ref) + sorted(set(events_by_rank) - ref):
        if any(isinstance(e, ev.Numerics) and e.eager_comm for e in events_by_rank.get(rank, [])):
            return rank
    return None


def _eager_counts(events_by_rank: dict[int, list[ev.Event]], ref: set[int]) -> tuple | None:
    rank = _numerics_rank(events_by_rank, ref)
    if rank is None:
        return None
    comm = next(e.eager_comm for e in events_by_rank[rank] if isinstance(e, ev.Numerics) and e.eager_comm)
    return tuple((ph, k, int(n)) for ph in ("backward", "forward") for k, n in sorted(comm.get(ph, {}).items()))
