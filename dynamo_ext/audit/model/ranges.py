"""Rank sets in words: ``0–511, 513–1023`` instead of a thousand numbers, and ranks grouped by what they did.

A report over 1,000 ranks stays readable when ranks with identical findings
share one line and only the outliers are named, by rank and host.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)

DASH = "\u2013"  # en dash, as in "ranks 0–511"


def spans(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ranks, as ``(first, last)`` pairs, ascending; duplicates ignored."""
    out: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if out and r == out[-1][1] + 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


def format_ranks(ranks: Iterable[int], *, world_size: int | None = None) -> str:
    """``"0–511, 513–1023"``; ``"all"`` when ``ranks`` is every rank of ``world_size``; ``"-"`` when empty.

    Two consecutive ranks are written ``"3, 4"`` (a range of two reads as a typo).
    """
    runs = spans(ranks)
    if not runs:
        return "-"
    if world_size and runs == [(0, world_size - 1)]:
        return "all"
    parts = []
    for a, b in runs:
        if a == b:
            parts.append(str(a))
        elif b == a + 1:
            parts += [str(a), str(b)]
        else:
            parts.append(f"{a}{DASH}{b}")
    return ", ".join(parts)


def group_by(items: Iterable[tuple[int, K]]) -> list[tuple[K, tuple[int, ...]]]:
    """Ranks grouped by an equal key, ``[(key, ranks), ...]`` ordered by each group's lowest rank."""
    groups: dict[K, list[int]] = {}
    for rank, key in items:
        groups.setdefault(key, []).append(rank)
    return sorted(((k, tuple(sorted(rs))) for k, rs in groups.items()), key=lambda kv: kv[1][0])


def format_counts(count_by_rank: Iterable[tuple[int, int]], *, world_size: int | None = None) -> str:
    """How often something happened per rank: ``"1/rank"`` when every rank listed saw it equally often,
    else ``"1 on 0–511, 513–1023; 3 on 512"`` (most ranks first)."""
    groups = group_by((r, n) for r, n in count_by_rank)
    if not groups:
        return "-"
    if len(groups) == 1:
        return f"{groups[0][0]}/rank"
    groups.sort(key=lambda kv: (-len(kv[1]), kv[1][0]))
    return "; ".join(f"{n} on {format_ranks(rs, world_size=world_size)}" for n, rs in groups)
