"""Rank sets in words: ``0–511, 513–1023`` instead of a thousand numbers.

The one formatter for ranks in messages and reports: the audit's report, the
collective check's mismatch errors and ``dynamo-ext audit diff`` all write a
set of ranks the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["DASH", "format_ranks", "spans"]

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
