"""The numerics check (``--check-numerics``) merged over ranks."""

from __future__ import annotations

from ..model.kinds import MismatchKind
from ..model.records import Numerics, NumericsMismatch
from ..schema import events as ev


def merge_numerics(per_rank: dict[int, ev.Numerics]) -> Numerics | None:
    """The numerics check over ranks from each rank's ``numerics`` event; ``None`` when no rank ran it.

    Mismatches sorted by comparison order, then rank (the first is the first tensor that differs);
    ``compared``: the most any rank compared.
    """
    if not per_rank:
        return None
    mismatches = sorted(
        (
            NumericsMismatch(
                rank=r,
                index=int(m["index"]),
                kind=MismatchKind(m["kind"]),
                name=m["name"],
                detail=m.get("detail", ""),
                max_abs=m.get("max_abs"),
                max_rel=m.get("max_rel"),
                step=m.get("step"),
            )
            for r, e in per_rank.items()
            for m in e.mismatches
        ),
        key=lambda m: (m.index, m.rank),
    )
    return Numerics(
        compared=max(e.compared for e in per_rank.values()),
        ranks=tuple(sorted(per_rank)),
        mismatches=tuple(mismatches),
        steps=max((e.steps or 1 for e in per_rank.values()), default=1),
        tolerances=next((e.tolerances for e in per_rank.values() if e.tolerances), ()),
    )
