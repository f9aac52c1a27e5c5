"""Compare two reports (``dynamo-ext audit diff``) and the CI gate (budgets, baseline)."""

from __future__ import annotations

import argparse
import dataclasses

from ...rank_ranges import format_ranks
from ..model.records import AuditReport, GraphBreak


@dataclasses.dataclass(frozen=True)
class BreakDiff:
    """Breaks by stable identity: in NEW only, in OLD only, in both."""

    new: tuple[GraphBreak, ...]
    fixed: tuple[GraphBreak, ...]
    unchanged: tuple[GraphBreak, ...]

    def __str__(self) -> str:
        lines = []
        for label, rows in (("new", self.new), ("fixed", self.fixed), ("unchanged", self.unchanged)):
            lines.append(f"{label}: {len(rows)}")
            lines += [f"  {b.id}  (ranks {format_ranks(b.ranks)}, x{b.count})" for b in rows]
        return "\n".join(lines) + "\n"


def diff_reports(old: AuditReport, new: AuditReport) -> BreakDiff:
    """New, fixed and unchanged breaks of ``new`` relative to ``old``."""
    old_ids = {b.id for b in old.graph_breaks}
    new_ids = {b.id for b in new.graph_breaks}
    return BreakDiff(
        new=tuple(b for b in new.graph_breaks if b.id not in old_ids),
        fixed=tuple(b for b in old.graph_breaks if b.id not in new_ids),
        unchanged=tuple(b for b in new.graph_breaks if b.id in old_ids),
    )


def gate(
    report: AuditReport,
    *,
    max_breaks: int | None = None,
    max_recompiles: int | None = None,
    baseline: AuditReport | None = None,
    max_hang_risks: int | None = 0,
    max_comm_bytes: int | None = None,
) -> list[str]:
    """Why ``report`` fails the CI gate (empty when it passes).

    Budgets compare the worst rank's totals (:attr:`AuditReport.total_breaks`,
    :attr:`AuditReport.total_recompiles`); a baseline fails the gate on any break
    whose identity it does not have; a tensor that differs between the compiled
    and the eager step (:attr:`AuditReport.numerics`, when checked) fails it; more than ``max_hang_risks`` graphs whose
    collective sequences differ across ranks (:attr:`AuditReport.hang_risks`)
    fail it too (``None``: not checked).  ``max_comm_bytes``: bytes a rank may send per step in the
    compiled graphs' collectives (:attr:`.records.Comm.bytes_per_step`; no communication report: 0 bytes;
    an incomplete one, :attr:`.records.Comm.missing`, fails it).
    """
    problems = []
    if report.numerics is not None and report.numerics.mismatches:
        n = report.numerics
        problems.append(
            f"numerics: {len(n.mismatches)} tensor(s) differ between the compiled and the eager step; first: {n.first}"
        )
    risks = report.hang_risks
    if max_hang_risks is not None and len(risks) > max_hang_risks:
        problems.append(f"{len(risks)} hang risk(s), budget --max-hang-risks {max_hang_risks}")
        problems += [f"hang risk: {r}" for r in risks]
    if max_breaks is not None and report.total_breaks > max_breaks:
        problems.append(f"{report.total_breaks} graph break(s) per rank, budget --max-breaks {max_breaks}")
    if max_recompiles is not None and report.total_recompiles > max_recompiles:
        problems.append(f"{report.total_recompiles} recompile(s) per rank, budget --max-recompiles {max_recompiles}")
    sent = report.comm.bytes_per_step if report.comm is not None else 0
    if max_comm_bytes is not None and sent > max_comm_bytes:
        problems.append(f"{sent} bytes sent per rank per step by collectives, budget --comm-budget {max_comm_bytes}")
    elif max_comm_bytes is not None and report.comm is not None and report.comm.missing:
        problems.append(
            f"--comm-budget {max_comm_bytes} cannot be checked: the communication report is incomplete "
            f"({report.comm.missing[0]})"
        )
    if baseline is not None:
        for b in diff_reports(baseline, report).new:
            problems.append(f"new graph break not in the baseline: {b.id}")
    return problems


def add_gate_arguments(p: argparse.ArgumentParser) -> None:
    """The gate's options, the same for ``dynamo-ext audit`` and ``dynamo-ext audit merge``."""
    p.add_argument(
        "--max-breaks", type=int, default=None, metavar="K", help="exit 1 when a rank has more than K breaks"
    )
    p.add_argument(
        "--max-recompiles", type=int, default=None, metavar="K", help="exit 1 when a rank recompiles more than K times"
    )
    p.add_argument(
        "--max-hang-risks",
        type=int,
        default=0,
        metavar="K",
        help="exit 1 when more than K graphs issue different collective sequences on different ranks (default 0)",
    )
    p.add_argument("--baseline", metavar="FILE", help="exit 1 on a graph break that this earlier --json report lacks")
    p.add_argument(
        "--comm-budget",
        type=int,
        default=None,
        metavar="BYTES",
        help="exit 1 when a rank sends more than BYTES per step in the compiled graphs' collectives",
    )


def read_gate_arguments(args: argparse.Namespace) -> tuple[AuditReport | None, str | None]:
    """``(baseline report or None, None)``, or ``(None, why)`` when ``--baseline``/``--comm-budget`` is bad."""
    if args.comm_budget is not None and args.comm_budget < 0:
        return None, f"--comm-budget must be a number of bytes >= 0, got {args.comm_budget}"
    if not args.baseline:
        return None, None
    from ..model.io import load_report

    try:
        return load_report(args.baseline), None
    except (OSError, ValueError) as e:
        return None, f"cannot read --baseline {args.baseline}: {e}"


def gate_from_arguments(report: AuditReport, args: argparse.Namespace, baseline: AuditReport | None) -> list[str]:
    """:func:`gate` with the limits of :func:`add_gate_arguments`."""
    return gate(
        report,
        max_breaks=args.max_breaks,
        max_recompiles=args.max_recompiles,
        baseline=baseline,
        max_hang_risks=args.max_hang_risks,
        max_comm_bytes=args.comm_budget,
    )
