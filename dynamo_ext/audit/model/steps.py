"""Per training step: what each rank compiled in each step (NOTE [steps] in ``schema/events.py``)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable

_KINDS = ("graph_breaks", "frame_skips", "graphs", "recompiles")


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """What happened in one training step: graph breaks, frame skips, graphs compiled and recompiles.

    In a rank's summary, that rank's; in the report's ``steps``, the most any rank had (each count on its own).
    Step 0: before the first step (building the target).
    """

    step: int
    graph_breaks: int
    frame_skips: int
    graphs: int
    recompiles: int


class StepTally:
    """Counts one rank's events per step (:meth:`add`), then :meth:`counts` for its summary."""

    def __init__(self) -> None:
        self._counts: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(_KINDS, 0))

    def add(self, step: int | None, kind: str) -> None:
        """One event of ``kind`` (a :class:`StepCounts` field) in ``step`` (``None``: not stamped, not counted)."""
        if step is not None:
            self._counts[step][kind] += 1

    def counts(self, steps: int | None) -> tuple[StepCounts, ...]:
        """Every step from 1 to ``steps`` (the steps the rank started; ``None``: as far as its events go), with
        its counts (0 for a step with none), plus step 0 when something happened before the first."""
        if steps is None and not self._counts:
            return ()
        last = max([steps or 0, *self._counts])
        numbers = ([0] if 0 in self._counts else []) + list(range(1, last + 1))
        return tuple(StepCounts(n, **self._counts.get(n, dict.fromkeys(_KINDS, 0))) for n in numbers)


def worst_per_step(per_rank: Iterable[tuple[StepCounts, ...]]) -> tuple[StepCounts, ...]:
    """Each step's counts over ranks, the most any rank had of each."""
    worst: dict[int, dict[str, int]] = {}
    for counts in per_rank:
        for c in counts:
            w = worst.setdefault(c.step, dict.fromkeys(_KINDS, 0))
            for k in _KINDS:
                w[k] = max(w[k], getattr(c, k))
    return tuple(StepCounts(n, **worst[n]) for n in sorted(worst))
