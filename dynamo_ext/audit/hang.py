"""Where each rank still running at the local audit's timeout is, in words and records (NOTE [hung rank]).

Read from the ``stack`` events the ranks write when the launcher asks (:mod:`.launch`): a rank outside
torch.distributed is hung in its own code; a rank inside a compiled collective, or in the collective
check's wait before one (NOTE [the collective a rank waits in] in ``rank/waits.py``), is placed at that
collective (op, group, stream position, the user's line) and waits for the ranks of its group that have
not reached that position; other ranks inside torch.distributed are placed at the innermost
torch.distributed frame.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..rank_ranges import format_ranks
from .model.records import RankWait

Stacks = Mapping[int, "dict[str, Any] | None"]
"""rank -> its ``stack`` event (as written: a dict), ``None`` for a rank that did not answer."""


def _reached(stack: dict[str, Any] | None) -> dict[str, int]:
    """group -> the furthest stream position the rank reached on it: the last compiled collective it entered,
    or the one it waits to enter in the collective check's wait."""
    out: dict[str, int] = {}
    for row in (stack or {}).get("collectives") or ():
        group = str(row["group"])
        out[group] = max(out.get(group, -1), int(row["position"]))
    for row in (stack or {}).get("waiting") or ():
        group = str(row["group"])
        out[group] = max(out.get(group, -1), int(row["position"]))
    return out


def rank_waits(rank: int, stacks: Stacks) -> tuple[RankWait, ...]:
    """The compiled collectives ``rank`` waits in (or waits to enter, in the check's wait), each with the ranks
    of its group not known to have reached its position: behind on the group, hung before it, silent, or not
    running any more."""
    stack = stacks.get(rank)
    out = []
    for row in (stack or {}).get("waiting") or ():
        group, position = str(row["group"]), int(row["position"])
        ranks = tuple(int(r) for r in row["ranks"])
        behind = tuple(q for q in ranks if q != rank and _reached(stacks.get(q)).get(group, -1) < position)
        out.append(
            RankWait(
                collective=str(row["collective"]),
                group=group,
                ranks=ranks,
                position=position,
                source=str(row["source"]),
                in_check=bool(row["in_check"]),
                waits_for=behind,
            )
        )
    return tuple(out)


def _plural(ranks: tuple[int, ...]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"


def describe_waits(waits: tuple[RankWait, ...]) -> str:
    """``waiting in a compiled collective: forward all_reduce(...) on group '0' (ranks 0, 1), position 4, at
    train.py:15: dist.all_reduce(x), waiting for rank 1``; "in the collective check before a compiled
    collective" for a rank in the check's wait."""
    head = (
        "waiting in the collective check before a compiled collective"
        if waits[0].in_check
        else "waiting in a compiled collective"
    )
    rows = [
        f"{w.collective}, position {w.position}, at {w.source or '<unknown source>'}"
        + (f", waiting for {_plural(w.waits_for)}" if w.waits_for else "")
        for w in waits
    ]
    return f"{head}: " + " and ".join(rows)


def where(rank: int, stacks: Stacks, *, last: str = "nothing") -> str:
    """Where a rank still running is, in words (NOTE [hung rank]); ``last``: its last event, for a rank that
    did not answer."""
    stack = stacks.get(rank)
    if stack is None:
        return f"position unknown (last event: {last})"
    frames = stack["stack"]
    file, line, function, source = frames[min(int(stack.get("user_index", 0)), len(frames) - 1)]
    at = f"at {file}:{line} in {function}" + (f" ({source})" if source else "")
    waits = rank_waits(rank, stacks)
    if waits:  # NOTE [the collective a rank waits in]: the collective's own line, not the compiled frame's
        return describe_waits(waits)
    if stack.get("in_distributed"):
        inner = next((f for f in reversed(frames) if f[0].startswith("torch/distributed/")), frames[-1])
        return f"waiting in torch.distributed ({inner[2]}) {at}"
    return f"hung {at}"


def _behind(stacks: Stacks, ranks: list[int]) -> list[str]:
    """``rank(s) 1 behind on group '0' (last entered position 6; rank(s) 0 at 7)`` per group (NOTE [where each
    rank waits]), from the positions the ranks' stacks report."""
    positions: dict[str, dict[int, int]] = {}
    for r in ranks:
        for group, position in _reached(stacks.get(r)).items():
            positions.setdefault(group, {})[r] = position
    out = []
    for group, by_rank in sorted(positions.items()):
        ahead = max(by_rank.values())
        late = sorted(r for r, pos in by_rank.items() if pos < ahead)
        if late:
            first = [r for r, pos in by_rank.items() if pos == ahead]
            out.append(
                f"rank(s) {', '.join(map(str, late))} behind on group {group!r} (last entered position "
                f"{', '.join(str(by_rank[r]) for r in late)}; rank(s) {', '.join(map(str, sorted(first)))} at {ahead})"
            )
    return out


def timeout_line(stacks: Stacks, ranks: list[int], timeout: float, *, last: Mapping[int, str] | None = None) -> str:
    """``timeout: after 45 s: rank 1 hung at ...; rank 0 waiting in a compiled collective: ...; killed``
    (NOTE [hung rank]); ``ranks``: those still running at the timeout."""
    if not ranks:
        return f"timeout: after {timeout:g} s; killed"
    last = last or {}

    def waits(r: int) -> bool | None:
        stack = stacks.get(r)
        return None if stack is None else bool(stack.get("in_distributed"))

    def at(r: int) -> str:
        return f"rank {r} {where(r, stacks, last=last.get(r, 'nothing'))}"

    hung = [r for r in ranks if waits(r) is False]
    waiting = [r for r in ranks if waits(r)]
    parts = [at(r) for r in hung]
    if hung and waiting:
        located = [r for r in waiting if rank_waits(r, stacks)]
        parts += [at(r) for r in located]
        rest = [r for r in waiting if r not in located]
        if rest:
            parts.append(f"rank(s) {', '.join(map(str, rest))} waiting in torch.distributed")
    else:  # no rank outside torch.distributed: collectives that do not match, each rank where it waits
        parts += [at(r) for r in waiting]
    parts += [at(r) for r in ranks if waits(r) is None]
    parts += _behind(stacks, ranks)
    return f"timeout: after {timeout:g} s: " + "; ".join(parts) + "; killed"
