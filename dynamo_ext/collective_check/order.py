"""The order of collectives across process groups: each entry's positions on the writer's other groups.

NOTE [order across groups]
Per group, the streams can agree while the ranks interleave two groups
differently: rank 0 all-reduces on group A then on group B, rank 1 on B then A
(one helper line issuing both, so every position of each group looks alike).
Each rank then waits in its first collective for the other: a hang no
per-group comparison sees.  So every entry carries, for each other group the
writer has used, how many compiled collectives it issued there before this one
(its stream position on that group; groups at 0 are left out).  Two ranks that
are both in group G and in group H must issue G's position ``p`` after the same
number of H's collectives; a rank compares that for each group both it and the
peer belong to, and only those: in a 2-D mesh rank 0's tensor-parallel group
is {0, 1} and rank 2's is {2, 3}, so ranks 0 and 2 (which share their
data-parallel group only) compare no other group's count, while ranks 0 and 1
compare their counts on the world group if both use it.  The counts compare
the order between every two groups two ranks share, which is the order that
makes them wait for each other; a cycle through three ranks that share no two
groups (0 waits for 1 in group {0, 1}, 1 for 2 in {1, 2}, 2 for 0 in {0, 2})
is not seen.  A rank's counts at a graph's start are its positions then (what
:mod:`.stream` counts anyway), plus, per collective, those of the same graph's
earlier collectives on other groups: no cost per call beyond the count.
A responder's entry (NOTE [answering a peer's check]) rebuilds the counts
from the rank's history; a group whose count is older than that history is
listed as unknown (``"u"``) and not compared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..rank_ranges import format_ranks
from .fingerprint import CollectiveSignature

if TYPE_CHECKING:
    from .exchange import GroupRun
    from .responder import History


def positions(counts: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """``(group, position)`` for each group of ``counts`` past position 0 (a run's ``base``)."""
    return tuple((g, n) for g, n in counts.items() if n)


def rebuilt_positions(history: History, call: int) -> tuple[tuple[tuple[str, int], ...], frozenset[str]]:
    """This rank's positions on its groups when call ``call`` started, rebuilt from ``history`` (for a responder's
    entries), and the groups whose position there is older than the history."""
    counts, unknown = {}, set()
    for group in list(history.runs):
        position = history.position_before(group, call)
        if position is None:
            unknown.add(group)
        else:
            counts[group] = position
    return positions(counts), frozenset(unknown)


def order_difference(
    run: GroupRun,
    i: int,
    rank: int,
    peer: int,
    entry: dict[str, Any],
    theirs: CollectiveSignature,
    ranks_of: Callable[[str], tuple[int, ...]],
    own_record: Callable[[str, int], CollectiveSignature | None],
) -> str | None:
    """The difference, in words, where ``peer`` (its ``entry`` holding ``theirs``) issued ``run.records[i]`` after
    another number of collectives than ``rank`` on a group both ranks are in; ``None`` where they agree.

    ``ranks_of(group)``: the group's ranks (``()`` where unknown: not compared); ``own_record(group, position)``:
    this rank's collective there, where the check holds it (named in the message).
    """
    their_counts = entry.get("x")
    if their_counts is None:
        return None
    mine = run.others(i)
    for other in sorted({*mine, *their_counts} - {*entry.get("u", ()), *run.unknown, run.group}):
        a, b = mine.get(other, 0), int(their_counts.get(other, 0))
        ranks = ranks_of(other)
        if a == b or rank not in ranks or peer not in ranks:
            continue
        first, later = (rank, peer) if a > b else (peer, rank)
        text = (
            f"the order of groups {run.group!r} (ranks {format_ranks(run.ranks)}) and {other!r} (ranks "
            f"{format_ranks(ranks)}) differs between rank {rank} and rank {peer}: before position "
            f"{run.start + i} of group {run.group!r}, rank {rank} issued {a} collective(s) on group {other!r} "
            f"and rank {peer} {b}, so rank {first} issues position {min(a, b)} of group {other!r} before it "
            f"and rank {later} after it:\n  rank {rank}: {line(run.records[i])}\n  rank {peer}: {line(theirs)}"
        )
        known = own_record(other, min(a, b))
        if known is not None:
            text += f"\n  position {min(a, b)} of group {other!r} on rank {rank}: {line(known)}"
        return text
    return None


def line(c: CollectiveSignature | None) -> str:
    """A collective and its source line, for messages."""
    if c is None:
        return "no collective"
    return f"{c.describe()} at {c.source or '<unknown source>'}"
