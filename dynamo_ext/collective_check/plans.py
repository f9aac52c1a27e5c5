"""A compiled graph's collectives per process group: what a check of each group compares.

One :class:`GroupPlan` per group of the graph that holds this rank and another
one; its digest names the whole graph as that group's ranks see it (NOTE [when
the stream is checked], ``stream.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

from .. import _compat
from .fingerprint import CollectiveSignature


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """A compiled graph's collectives on one group with another rank (what a check of that group compares)."""

    group: str
    ranks: tuple[int, ...]
    records: tuple[CollectiveSignature, ...]
    digest: str
    bucketed: bool = False
    """Whether the compiled graph has buckets on this group (which run merged where the check decides)."""
    crossed: tuple[tuple[tuple[str, int], ...], ...] = ()
    """Per record, ``(group, count)`` for each other group with collectives earlier in the graph
    (NOTE [order across groups])."""


def _pattern(ranks: Sequence[int]) -> list[int]:
    return [r - ranks[0] for r in ranks] if ranks else []


def graph_digest(group: str, records: Sequence[CollectiveSignature], flow: str) -> str:
    """A digest of a graph's collectives (all groups; other groups by rank pattern) and data flow, for ``group``.

    Equal on ranks of ``group`` that run the same collectives, from the same
    lines, with the same data flow between them (:func:`.fingerprint.data_flow`).
    """
    rows = [
        [c.op, c.reduce_op, list(c.tensors), list(c.args), c.phase, c.site, c.group == group, _pattern(c.ranks)]
        for c in records
    ]
    return hashlib.sha1(json.dumps([rows, flow]).encode()).hexdigest()[:20]


def group_plans(
    records: Sequence[CollectiveSignature], flow: str, bucketed: frozenset[str] = frozenset()
) -> list[GroupPlan]:
    """One plan per group of ``records`` that holds this rank and another one, in order of first use.

    ``bucketed``: the groups on which the compiled graph has buckets.
    """
    rank = _compat.global_rank()
    by_group: dict[str, list[CollectiveSignature]] = {}
    crossed: dict[str, list[tuple[tuple[str, int], ...]]] = {}
    for c in records:
        if c.group and len(c.ranks) > 1 and rank in c.ranks:
            crossed.setdefault(c.group, []).append(tuple((g, len(cs)) for g, cs in by_group.items() if g != c.group))
            by_group.setdefault(c.group, []).append(c)
    return [
        GroupPlan(g, cs[0].ranks, tuple(cs), graph_digest(g, records, flow), g in bucketed, tuple(crossed[g]))
        for g, cs in by_group.items()
    ]
