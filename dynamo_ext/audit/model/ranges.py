"""Ranks grouped by what they did; rank sets in words (:func:`dynamo_ext.rank_ranges.format_ranks`).

A report over 1,000 ranks stays readable when ranks with identical findings
share one line and only the outliers are named, by rank and host.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

from ...rank_ranges import format_ranks

__all__ = ["format_counts", "format_ranks", "group_by"]

K = TypeVar("K", bound=Hashable)


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
