"""``dynamo-ext audit``: graph breaks and recompiles of a multi-rank program, merged over ranks.

    from dynamo_ext.audit import audit
    report = audit(fn, x, backend="aot_eager")   # in-process, this rank
    print(report)                                # the terminal report
    report.to_json()                             # the documented JSON schema

The command line (``dynamo-ext audit``, :mod:`.cli`) runs a script or a
``module:function`` on N ranks with torch's launcher; under your own launcher
(torchrun on many nodes, srun) each rank runs ``python -m
dynamo_ext.audit.collect --out DIR`` and ``dynamo-ext audit merge DIR``
reports afterwards; see docs/audit.md.

Subpackages by role, arrows one way (a package imports only those above it):
:mod:`.schema` (the rank-file format), :mod:`.model` (the report's records),
:mod:`.rank` (what runs on each rank), :mod:`.merge` (rank files and TORCH_TRACE
logs into a report), :mod:`.render` (text, HTML), :mod:`.gate` (budgets,
baseline, diff), :mod:`.targets` (bundled targets); then :mod:`.launch`,
:mod:`.api`, :mod:`.cli` and :mod:`.pytest_plugin` use them.
"""

from typing import TYPE_CHECKING, Any

from .gate.diff import BreakDiff, diff_reports, gate
from .model.io import load_report, report_from_json
from .model.records import (
    AuditReport,
    Frame,
    Fusion,
    Graph,
    GraphBreak,
    Numerics,
    NumericsMismatch,
    RankSummary,
    Recompile,
)
from .rank.numerics import Step, check_step
from .render import text as _text  # noqa: F401  (registers str(report): NOTE [report text] in model/records.py)

if TYPE_CHECKING:  # loaded lazily at run time: __getattr__ below
    from .api import audit

__all__ = [
    "AuditReport",
    "BreakDiff",
    "Frame",
    "Fusion",
    "Graph",
    "GraphBreak",
    "Numerics",
    "NumericsMismatch",
    "RankSummary",
    "Recompile",
    "Step",
    "audit",
    "check_step",
    "diff_reports",
    "gate",
    "load_report",
    "report_from_json",
]


def __getattr__(name: str) -> Any:
    # ``audit`` imports torch; loading it lazily keeps ``import dynamo_ext.audit.cli`` free of torch, so the
    # command imports torch inside main(), where it decides what happens to library warnings (cli.py).
    if name == "audit":
        from .api import audit

        return audit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
