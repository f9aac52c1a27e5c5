"""The compiled collective a rank waits in, read on the rank when the launcher asks where it is.

NOTE [the collective a rank waits in]
A rank blocked in a compiled graph shows the compiled code's frames and the
line the resumed function starts at, not the collective's.  With positions
tracked (NOTE [where each rank waits] in ``collective_check/stream.py``), the
collective check records, per group, the graph that started last on it, the
stream position of its first collective there and the group's count of
issued collectives then; the group's count now tells how many of the graph's
collectives this rank entered:

- some (``k > 0``): the rank is in the ``k``-th, at position ``start + k - 1``
  (when its stack is inside the graph: ``stream.in_flight``'s ``in_graph``);
- none (``k == 0``) while its stack is in the check's exchange
  (``collective_check/exchange.py``): the check waits for the peers' entries
  at the graph's first position on the group, before the rank enters its
  first collective there, at position ``start``.  This is the wait a graph's
  new context meets (NOTE [when the stream is checked]), e.g. the second call
  of a step whose graph follows itself on a group.

Each row names the collective (op, tensors, group and its ranks), the
position, the user's line and whether the rank is inside the check's wait;
the launcher names the ranks each row waits for from the other ranks' rows
(:mod:`..hang`).  The check's state is read, not changed (``stream._state``,
the record each tracked run writes; this module is the one reader outside the
check).
"""

from __future__ import annotations

from typing import Any

from ... import _compat

_IN_GRAPH = "collective_check/stream.py"
_IN_CHECK = "collective_check/exchange.py"


def _started() -> list[tuple[str, Any, int, int]]:
    """``(group, plan, first position, count then)`` per group a tracked graph started on (the check's record)."""
    from ...collective_check import stream

    state = getattr(stream, "_state", None)
    started = getattr(state, "started", None) or {}
    merged = getattr(state, "merged_away", None) or {}
    rows = []
    for group, (plan, start, count) in list(started.items()):
        seq = _compat.group_sequence_number(group)
        if seq is not None:
            rows.append((group, plan, start, seq + merged.get(group, 0) - count))
    return rows


def _row(group: str, plan: Any, position: int, index: int, in_check: bool) -> dict[str, Any]:
    c = plan.records[index]
    return {
        "group": group,
        "ranks": list(plan.ranks),
        "position": position,
        "collective": c.describe(),
        "source": c.source,
        "in_check": in_check,
    }


def compiled_waits(files: list[str]) -> list[dict[str, Any]]:
    """The compiled collectives this rank waits in, or waits to enter in the collective check's wait (NOTE [the
    collective a rank waits in]); ``files``: its stack's files, outermost first.  Empty elsewhere, and where
    positions are not tracked.  Safe to call from another thread."""
    in_check = any(f.endswith(_IN_CHECK) for f in files)
    in_graph = any(f.endswith(_IN_GRAPH) for f in files)
    if not (in_check or in_graph):
        return []
    rows = []
    for group, plan, start, entered in _started():
        if in_check and entered == 0 and plan.records:
            rows.append(_row(group, plan, start, 0, True))
        elif not in_check and 0 < entered <= len(plan.records):
            rows.append(_row(group, plan, start + entered - 1, entered - 1, False))
    return rows
