"""Why the communication report's collective counts differ from eager ``CommDebugMode``'s, in words.

NOTE [count differences]
The report counts the collectives of the compiled graphs (like with like: NOTE
[like-with-like collective counts] in :mod:`.comm`); ``CommDebugMode``
counts every collective the eager step dispatches.  Where the two differ for a
(phase, kind), the difference is split over the units that together hold every
collective of the step: each top-level module (the outermost modules the eager
step ran, below the root: ``tok_embeddings``, ``layers.0``, ... ``norm``), the
root's own (FSDP2's root hooks), and what ran outside any module (a loss
function, a hook compiled as its own frame).  Both sides are counted per unit:
the compiled collectives by the module path of their node, the eager ones from
``CommDebugMode``'s per-module counts (a module's count includes its
submodules', so a unit's is its own entry; the root's own is the root's minus
its top-level modules'; outside is the step's minus the root's).  The per-unit
differences therefore add up to the total difference, and each gets a reason:

- eager only, and no compiled graph has a collective of that unit in that
  phase: the code ran outside the compiled graphs (eagerly, around a graph
  break, or the whole phase ran eagerly);
- compiled only, outside any module: a graph compiled from a hook or function
  that is no module (its collectives have no module path), which eager counts
  in the module whose hook ran it;
- FSDP2 traced in the compiled graphs (they hold FSDP2 collectives of that
  phase and kind), no graph break, and the unit's DTensor collectives agree
  (its count minus FSDP2's, on both sides): FSDP2's collectives sit in another
  unit or are fewer.  Eager FSDP2 all-gathers a unit's parameters for its
  backward ahead, from the backward hook of the unit after it in forward
  order (prefetch), and ``CommDebugMode`` counts the gather there; it
  re-gathers every unit it resharded after forward, where the compiled
  backward gathers only parameters its backward uses (an embedding's backward
  uses no weight) and keeps those not resharded (``reshard_after_forward=False``,
  e.g. the last module group).  One more reason gives FSDP2's totals of the
  phase and kind on both sides (see NOTE [modules reached through an FSDP2
  state] in :mod:`dynamo_ext.variables.fsdp.sources` for how the compiled
  graphs name a module group's modules);
- a unit with compiled collectives whose eager count has more: when its
  DTensor (functional) collectives agree and no compiled graph has an FSDP2 or
  explicit collective of it, the eager surplus is c10d's own ops (FSDP2's hooks,
  explicit ``dist`` calls) that ran eagerly (``CommDebugMode`` counts those
  apart: ``modules_c10d`` of :func:`..rank.eager_comm.count_eager`);
- a unit whose compiled backward has more than eager's, where at least that
  many of its compiled backward collectives of the kind recompute one of its
  compiled forward collectives (same module, line, shapes and group) and its
  FSDP2 collectives agree: activation checkpointing's recomputation.  Eager's
  stops once the tensors the region saved are rebuilt; the compiled
  partitioner also recomputes, rather than saves, a checkpointed output that
  later code's backward needs (the last block's output, which the final norm
  saves);
- anything else is left unexplained and the report says MISMATCH.
"""

from __future__ import annotations

from collections import defaultdict

from ..model.records import Collective, CountDifference
from ..schema import events as ev

OUTSIDE = "outside any module"
ROOT = "<root>"


def _top_levels(paths: set[str]) -> list[str]:
    """The outermost module paths below the root: no other path (but the root) is a prefix of them."""
    inner = [p for p in paths if p not in (ROOT, "Global")]
    return sorted(p for p in inner if not any(p.startswith(q + ".") for q in inner if q != p))


def _unit(module: str, tops: list[str]) -> str:
    if not module:
        return OUTSIDE
    if module == ROOT:
        return ROOT
    return next((t for t in tops if module == t or module.startswith(t + ".")), module)


def _eager_units(
    modules: dict[str, dict[str, dict[str, int]]],
    tops: list[str],
    phase: str,
    kind: str,
    outside_root: frozenset[str] = frozenset(),
) -> dict[str, int]:
    """Eager counts per unit; ``outside_root``: top-level modules that ran while the root did not (their counts
    are in ``Global``'s, not the root's)."""

    def n(path: str) -> int:
        return int(modules.get(path, {}).get(phase, {}).get(kind, 0))

    units = {t: n(t) for t in tops}
    units[ROOT] = n(ROOT) - sum(v for t, v in units.items() if t not in outside_root)
    units[OUTSIDE] = n("Global") - n(ROOT) - sum(v for t, v in units.items() if t in outside_root)
    return units


def explain_counts(
    like: dict[tuple[str, str], int],
    eager: dict[tuple[str, str], int],
    eager_modules: dict[str, dict[str, dict[str, int]]] | None,
    colls: list[Collective],
    counted: list[Collective],
    breaks: list[str],
    eager_c10d: dict[str, dict[str, dict[str, int]]] | None = None,
    outside_root: frozenset[str] = frozenset(),
) -> tuple[CountDifference, ...]:
    """One :class:`.records.CountDifference` per (phase, kind) whose counts differ (NOTE [count differences]).

    ``like``/``eager``: the two counts per (phase, kind); ``eager_modules``: ``CommDebugMode``'s per-module
    counts (:func:`..rank.eager_comm.count_eager`), ``None`` when the rank files have none (then every difference
    is unexplained); ``colls``: every collective of the report; ``counted``: those ``like`` counts (the
    like-with-like selection); ``breaks``: ``"file:line"`` of the report's graph breaks, named in reasons;
    ``eager_c10d``: the per-module counts of c10d's own ops (``None``: not recorded); ``outside_root``: modules
    that ran while the root did not (:func:`..rank.eager_comm.count_eager`).
    """
    out = []
    for phase, kind in sorted(set(like) | set(eager)):
        a, b = like.get((phase, kind), 0), eager.get((phase, kind), 0)
        if a == b:
            continue
        if eager_modules is None:
            out.append(CountDifference(phase, kind, a, b, (), f"compiled {a}, eager {b}: no per-module eager count"))
            continue
        tops = _top_levels(set(eager_modules))
        mine: dict[str, int] = defaultdict(int)
        mine_c10d: dict[str, int] = defaultdict(int)  # FSDP2's and explicit ones: c10d ops when eager
        explicit: dict[str, int] = defaultdict(int)
        graphs: dict[str, set[str]] = defaultdict(set)
        mine_fsdp = [c for c in counted if c.phase == phase and c.kind == kind and c.origin == "fsdp"]
        for c in counted:
            if c.phase == phase and c.kind == kind:
                mine[_unit(c.module, tops)] += 1
                mine_c10d[_unit(c.module, tops)] += c.origin in ("fsdp", "explicit")
                explicit[_unit(c.module, tops)] += c.origin == "explicit"
                graphs[_unit(c.module, tops)].add(c.graph)
        in_phase = {_unit(c.module, tops) for c in colls if c.phase == phase and not c.inlined}
        theirs = _eager_units(eager_modules, tops, phase, kind, outside_root)
        theirs_c10d = _eager_units(eager_c10d, tops, phase, kind, outside_root) if eager_c10d is not None else {}
        # Compiled only outside any module: a hook's graph, whose collective eager counts in the hook's module.
        hooked = mine.get(OUTSIDE, 0) > theirs.get(OUTSIDE, 0)
        # FSDP2 traced, nothing eager around it: its collectives are placed or numbered otherwise than eager's.
        fsdp_traced = eager_c10d is not None and not breaks and any(c.origin == "fsdp" for c in mine_fsdp)
        units = [*tops, ROOT, OUTSIDE, *sorted(set(mine) - {*tops, ROOT, OUTSIDE})]
        reasons, unexplained = [], []
        fsdp_moved = False
        for unit in units:
            x, y = mine.get(unit, 0), theirs.get(unit, 0)
            if x == y:
                continue
            where = f"{unit}: compiled {x}, eager {y}"
            mc, tc = mine_c10d.get(unit, 0), theirs_c10d.get(unit, 0)
            recomputed = _recomputed(counted, unit, tops, kind) if phase == "backward" and x > y else []
            if x == 0 and not in_phase:
                reasons.append(f"{where}: the {phase} ran eagerly, its collectives are in no compiled graph")
            elif fsdp_traced and mc != tc and x - mc == y - tc:
                fsdp_moved = True
                whose = "FSDP2's and explicit" if explicit.get(unit) else "FSDP2's"
                reasons.append(f"{where}: {whose} {kind}s differ (compiled {mc}, eager {tc}), DTensor's agree")
            elif x == 0 and unit not in in_phase:
                at = f" (graph breaks at {', '.join(breaks[:3])}{', ...' if len(breaks) > 3 else ''})" if breaks else ""
                also = f", or in a graph of no module ({OUTSIDE})" if hooked else ""
                reasons.append(f"{where}: no compiled graph has a collective of it: ran eagerly{at}{also}")
            elif (
                unit in theirs_c10d
                and mine_c10d.get(unit, 0) == 0
                and theirs_c10d[unit] > 0
                and x == y - theirs_c10d[unit]
            ):
                reasons.append(
                    f"{where}: its {theirs_c10d[unit]} c10d collective(s) (FSDP2's hooks, explicit dist calls) ran "
                    f"eagerly, outside the compiled graphs, which have its {x} DTensor one(s)"
                )
            elif y == 0 and unit == OUTSIDE:
                names = ", ".join(sorted({g.split(" | ")[0] for g in graphs[unit]}))
                reasons.append(
                    f"{where}: compiled in a graph of no module ({names}: a hook or function compiled as a frame of "
                    "its own); eager counts it in the module whose hook ran it"
                )
            elif recomputed and len(recomputed) >= x - y and mc == tc:
                names = ", ".join(sorted({c.module for c in recomputed}))
                reasons.append(
                    f"{where}: its compiled backward recomputes {len(recomputed)} of its forward {kind}(s) ({names}), "
                    f"{x - y} more than eager's backward: activation checkpointing, whose eager recomputation "
                    "stops once the region's saved tensors are rebuilt, while the compiled partitioner recomputes "
                    "a checkpointed output that later code's backward needs instead of saving it"
                )
            else:
                unexplained.append(f"{where} (compiled: {mc} FSDP2's or explicit, {x - mc} DTensor's; eager: {tc} "
                                   f"c10d, {y - tc} functional)")  # fmt: skip
        if fsdp_moved:
            reasons.append(_fsdp_totals(phase, kind, colls, counted, eager_c10d or {}, tops, units, outside_root))
        out.append(CountDifference(phase, kind, a, b, tuple(reasons), "; ".join(unexplained)))
    return tuple(out)


def _recomputed(counted: list[Collective], unit: str, tops: list[str], kind: str) -> list[Collective]:
    """The unit's compiled backward collectives of ``kind`` that repeat one of its compiled forward ones."""

    def key(c: Collective) -> tuple:
        return (c.module, c.kind, c.origin, c.file, c.line, c.shape_in, c.shape_out, c.group)

    mine = [c for c in counted if c.kind == kind and _unit(c.module, tops) == unit and c.origin != "fsdp"]
    forward = {key(c) for c in mine if c.phase == "forward"}
    return [c for c in mine if c.phase == "backward" and key(c) in forward]


def _fsdp_totals(
    phase: str,
    kind: str,
    colls: list[Collective],
    counted: list[Collective],
    eager_c10d: dict[str, dict[str, dict[str, int]]],
    tops: list[str],
    units: list[str],
    outside_root: frozenset[str] = frozenset(),
) -> str:
    """FSDP2's (phase, kind) collectives in all, per unit on both sides, and why eager's sit or number otherwise."""
    mine: dict[str, int] = defaultdict(int)
    for c in counted:
        if c.phase == phase and c.kind == kind and c.origin in ("fsdp", "explicit"):
            mine[_unit(c.module, tops)] += 1
    theirs = _eager_units(eager_c10d, tops, phase, kind, outside_root)

    def listed(n: dict[str, int]) -> str:
        return f"{sum(n.values())} ({', '.join(f'{u} {n[u]}' for u in units if n.get(u, 0) > 0) or 'none'})"

    whose = (
        "FSDP2's and explicit"
        if any(c.origin == "explicit" for c in counted if c.phase == phase and c.kind == kind)
        else "FSDP2's"
    )
    text = f"{whose} {phase} {kind}s in all: compiled {listed(mine)}, eager {listed(theirs)}"
    if kind == "all_gather" and phase == "backward":
        gathered = {_unit(c.module, tops) for c in colls if c.origin == "fsdp" and c.kind == kind and not c.inlined}
        again = {_unit(c.module, tops) for c in colls if c.origin == "fsdp" and c.kind == kind and c.phase == phase}
        kept = ", ".join(u for u in units if u in gathered - again) or "none"
        text += (
            ": eager FSDP2 all-gathers a unit's parameters for its backward ahead, in the backward hook of the unit "
            "after it in forward order (prefetch), where CommDebugMode counts it, and re-gathers every unit it "
            "resharded after forward; the compiled backward gathers a unit's parameters where its backward uses "
            f"them, and not those of {kept} (kept from the forward, reshard_after_forward=False, or unused by "
            "the backward, as an embedding's weight)"
        )
    else:
        text += (
            ": eager FSDP2's hooks issue them in the unit whose hook ran them, the compiled graphs where the "
            "parameters are used"
        )
    return text


def eager_modules_of(events: list[ev.Event], key: str = "modules") -> dict[str, dict[str, dict[str, int]]] | None:
    """The per-module eager counts (``key``: ``"modules"`` or ``"modules_c10d"``) of a rank's ``numerics`` event."""
    for e in events:
        if isinstance(e, ev.Numerics) and e.eager_comm:
            return e.eager_comm.get(key)
    return None


def eager_outside_root(events: list[ev.Event]) -> frozenset[str]:
    """The modules that ran while the root module did not, from a rank's ``numerics`` event (``outside_root``)."""
    for e in events:
        if isinstance(e, ev.Numerics) and e.eager_comm:
            return frozenset(str(p) for p in e.eager_comm.get("outside_root") or ())
    return frozenset()
