"""The audit's data: frozen records, merged across ranks.

A rank's collector (:mod:`..rank.collector`) writes rank-file events (:mod:`..schema`);
:mod:`..merge` turns the events of every rank into one :class:`AuditReport`.  The JSON
form (:meth:`AuditReport.to_json`, by the generic :mod:`.codec`) is the stable schema
documented in ``docs/audit.md`` and generated into ``report.schema.json``
(:mod:`.json_schema`); :func:`.io.report_from_json` reads it back (for ``diff`` and
``--baseline``).  ``str(report)`` is the terminal report without colour
(NOTE [report text]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

from . import codec
from .comm import Collective, Comm, CountDifference, ModuleComm  # noqa: F401  (AuditReport.comm; importers use these names)
from .kinds import BreakKind, MismatchKind, RankStatus
from .ranges import format_ranks, group_by
from .steps import StepCounts, worst_per_step

# Bump on an incompatible change of the JSON layout; adding keys is compatible.
SCHEMA_VERSION = 1

# NOTE [report text]
# ``str(report)`` is the terminal report, but the renderer (``render/text.py``) reads the model, so the
# model cannot import it back: the renderer registers itself here when it loads, and
# ``dynamo_ext/audit/__init__.py`` loads it.  A package's ``__init__`` runs before any of its modules,
# so every process that has an :class:`AuditReport` has the renderer.
_text_renderer: list[Callable[[AuditReport], str]] = []


def register_text_renderer(render: Callable[[AuditReport], str]) -> None:
    """Make ``render(report)`` what ``str(report)`` returns (NOTE [report text]); the last one registered wins."""
    _text_renderer[:] = [render]


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame of a user stack."""

    file: str
    line: int
    function: str
    source: str = ""


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """One distinct graph break, merged over every rank that hit it.

    ``id`` is the stable identity ``gb_type | file:line | function``; it is what
    ``--baseline`` and ``audit diff`` compare.  ``kind`` (:class:`.kinds.BreakKind`) is ``"graph_break"``
    (Dynamo split the frame; counted in ``counters["graph_break"]``) or
    ``"frame_skip"`` (Dynamo gave up on the whole frame and runs it eagerly;
    at least one occurrence did).
    ``gb_type`` is the innermost cause; ``wrapper`` the gb_type Dynamo wrapped
    it in, if any (``"graph break in loop"``: the cause made a frame skip).
    """

    __json_extra__: ClassVar[tuple[str, ...]] = ("count",)
    # Reports written before breaks had a wrapper.
    __json_defaults__: ClassVar[dict[str, Any]] = {"wrapper": ""}

    id: str
    kind: BreakKind
    gb_type: str
    wrapper: str
    file: str
    line: int
    function: str
    source: str
    reason: str
    explanation: str
    hints: tuple[str, ...]
    fix: str
    distributed: bool
    phase: str
    ranks: tuple[int, ...]
    count_by_rank: tuple[tuple[int, int], ...]
    stack: tuple[Frame, ...]
    snippet: tuple[tuple[int, str], ...]
    recompiles_caused: int
    hang_risk: bool
    impact: int
    divergent: bool = False
    steps: tuple[int, ...] = ()  # the training steps it happened in, on any rank (NOTE [steps])

    @property
    def count(self) -> int:
        """Occurrences summed over ranks."""
        return sum(n for _, n in self.count_by_rank)

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}"


@dataclasses.dataclass(frozen=True)
class Fusion:
    """One fusion dynamo-ext's Inductor passes applied in a graph, merged over the ranks that applied it.

    From the ``dynamo_ext_fusion`` structured-trace artifact (one per applied
    fusion, see ``dynamo_ext/inductor_lowerings/decisions.py``).  ``fusion``: the
    pass (``"residual_rms_norm"``); ``kernel``: what runs (``"one_shot"``,
    ``"two_shot"`` or ``"epilogue"``); ``group``: the collective's process-group
    name; ``nbytes``: the all-reduced bytes per rank; ``node``: the collective's FX
    node; ``phase``: ``"forward"`` or ``"backward"`` (the graph Inductor compiled).
    """

    fusion: str
    kernel: str
    group: str
    nbytes: int
    node: str
    phase: str
    ranks: tuple[int, ...]

    def __str__(self) -> str:
        bwd = " (bwd)" if self.phase == "backward" else ""
        return f"{self.fusion} ({self.kernel}) at {self.node}{bwd}, group {self.group}, {self.nbytes} B"

    def describe(self, graph_ranks: tuple[int, ...]) -> str:
        """``str(self)``, with the ranks when only some of the graph's ranks (``graph_ranks``) applied it."""
        return str(self) if self.ranks == graph_ranks else f"{self} [ranks {format_ranks(self.ranks)}]"


@dataclasses.dataclass(frozen=True)
class Graph:
    """One compiled graph (a Dynamo frame compile that produced a graph), merged over ranks.

    ``id`` is ``file:firstline function`` for the first compile of that code
    object and ``file:firstline function | recompile: <failed guard>`` for a
    recompile; never the compile order.  ``divergent``: ranks have it a
    different number of times or with different op counts.  ``hang_risk``: the
    ordered collectives it issues differ between ranks
    (``collective_sequence_by_rank``: forward names, then ``bwd:`` names).
    ``fusions``: the fusions dynamo-ext's Inductor passes applied to it (forward
    and backward graph), each distinct one once, in the order first seen.
    """

    __json_extra__: ClassVar[tuple[str, ...]] = ("op_count",)

    id: str
    function: str
    file: str
    line: int
    phase: str
    ranks: tuple[int, ...]
    op_count_by_rank: tuple[tuple[int, int], ...]
    collectives: tuple[tuple[str, int], ...]
    backward_collectives: tuple[tuple[str, int], ...]
    compile_time_s: float
    hang_risk: bool
    divergent: bool = False
    collective_sequence_by_rank: tuple[tuple[int, tuple[str, ...]], ...] = ()
    fusions: tuple[Fusion, ...] = ()
    steps: tuple[int, ...] = ()  # the training steps it was compiled in, on any rank (NOTE [steps])

    @property
    def op_count(self) -> int:
        return max((n for _, n in self.op_count_by_rank), default=0)


@dataclasses.dataclass(frozen=True)
class Recompile:
    """One recompile reason (the failed guard, in words), merged over ranks."""

    __json_extra__: ClassVar[tuple[str, ...]] = ("count",)

    id: str
    function: str
    file: str
    line: int
    reason: str
    ranks: tuple[int, ...]
    count_by_rank: tuple[tuple[int, int], ...]
    hang_risk: bool
    divergent: bool = False
    steps: tuple[int, ...] = ()  # the training steps it happened in, on any rank (NOTE [steps])
    why: str = ""  # what changed and what makes it compile once (NOTE [why a recompile]); "": not read

    @property
    def count(self) -> int:
        return sum(n for _, n in self.count_by_rank)


@dataclasses.dataclass(frozen=True)
class RankWait:
    """A compiled collective a rank still running at the timeout waits in (NOTE [the collective a rank waits in]).

    ``collective``: the op, its tensors and reduce op, the group and its ranks
    (``forward all_reduce(float32[4], sum) on group '0' (ranks 0, 1)``); ``group``
    and ``ranks``: the process group's name and global ranks; ``position``: the
    collective's place in the group's stream of compiled collectives (NOTE [where
    each rank waits]); ``source``: the user's line (``file:line: code``);
    ``in_check``: the rank waits in the collective check's exchange before it
    enters the collective (the check of a graph's new context), else inside the
    collective; ``waits_for``: the group's ranks not known to have reached this
    position (behind on the group, hung elsewhere, or gone).
    """

    collective: str
    group: str
    ranks: tuple[int, ...]
    position: int
    source: str
    in_check: bool
    waits_for: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RankSummary:
    """What one rank did: its status and its own totals.

    ``status`` (:class:`.kinds.RankStatus`) is ``"ok"``, ``"error"`` (the target raised), ``"died"`` (the
    process ended without saying why; a rank file cut short), ``"timeout"``,
    ``"stopped"`` (ended by the launcher after another rank failed),
    ``"missing"`` (no rank file: ``audit merge`` expected it from the world
    size) or ``"unknown"`` (read from a TORCH_TRACE log, which does not say).  ``host``/``node_rank``/``local_rank``: where the rank ran, from its
    rank file's header (``""``/``None`` when unknown; for a missing rank the
    host is inferred from its node's other ranks, if any).  ``dynamo_graph_breaks``
    is ``sum(torch._dynamo.utils.counters["graph_break"].values())`` read on the
    rank at the end (``None`` when the rank never got there); ``dynamo_missed``
    the breaks of ``graph_breaks`` that counter did not count (torch 2.13 does not
    count data-dependent branches), so ``graph_breaks == dynamo_graph_breaks +
    dynamo_missed`` when the audit and Dynamo agree.  ``waiting``: for a rank the local audit's timeout found
    still running, the compiled collectives it waits in (empty elsewhere).  ``steps``: its counts per
    training step (NOTE [steps] in ``schema/events.py``; empty when its events carry no step).
    """

    rank: int
    status: RankStatus
    error: str
    graph_breaks: int
    frame_skips: int
    graphs: int
    recompiles: int
    compile_time_s: float
    dynamo_graph_breaks: int | None
    dynamo_unique_graphs: int | None
    log: str
    dynamo_missed: int = 0
    host: str = ""
    node_rank: int | None = None
    local_rank: int | None = None
    waiting: tuple[RankWait, ...] = ()
    steps: tuple[StepCounts, ...] = ()


@dataclasses.dataclass(frozen=True)
class NumericsMismatch:
    """One tensor that differs between the compiled and the eager step on one rank.

    ``kind`` (:class:`.kinds.MismatchKind`): ``"output"`` (a path into what ``step`` returned: ``"loss"``,
    ``"out[0]"``), ``"grad"`` (a parameter's gradient after ``backward``) or
    ``"param"`` (a parameter after the optimizer step), by parameter name;
    local shards for DTensors.  ``max_abs``/``max_rel``: the largest absolute
    and relative (to eager) error, ``None`` when not comparable (``detail``
    says why: type, placements, shape, dtype, missing).  ``index``: position
    in the comparison order (outputs, gradients, parameters).  ``step``: the training step (from 1) when
    the check compared several (NOTE [the audit drives the step]), else ``None``.
    """

    rank: int
    index: int
    kind: MismatchKind
    name: str
    detail: str
    max_abs: float | None
    max_rel: float | None
    step: int | None = None

    def __str__(self) -> str:
        err = (
            f"max abs error {self.max_abs:.3g}, max rel error {self.max_rel:.3g}"
            if self.max_abs is not None and self.max_rel is not None
            else self.detail
        )
        what = {"output": "output", "grad": "gradient of", "param": "parameter after the step"}.get(
            self.kind, self.kind
        )
        return f"{'' if self.step is None else f'step {self.step}: '}{what} {self.name} on rank {self.rank}: {err}"


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The numerics check (``--check-numerics``): compiled step vs eager step, from the same state, per rank.

    ``compared``: tensors compared per rank (outputs + gradients + parameters, of each of ``steps`` training steps);
    ``tolerances``: the target's own tolerances for some tensors (``Step.tolerances``), where they were used;
    ``ranks``: the ranks that finished the check; ``mismatches`` sorted by
    comparison order, then rank: ``mismatches[0]`` is the first tensor that differs.
    """

    compared: int
    ranks: tuple[int, ...]
    mismatches: tuple[NumericsMismatch, ...]
    steps: int = 1
    tolerances: tuple[str, ...] = ()

    @property
    def first(self) -> NumericsMismatch | None:
        return self.mismatches[0] if self.mismatches else None


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Everything the audit found; ``str(report)`` is the terminal report.

    ``plugin`` says whether dynamo-ext was installed on the ranks
    (``{"installed": bool, "version": str, "error": str}``, and ``"blocks"``: how it compiled the graphs,
    ``schema.events.BLOCKS_*``).  ``stock`` is the
    run without the plugin when ``--compare-stock`` was given.  ``numerics`` is
    the numerics check (``None`` when it did not run).  ``notes``: what the
    input could not say (a ``TORCH_TRACE`` directory has no exit statuses,
    numerics or plugin state: :mod:`..merge.trace_reader`).
    """

    __json_extra__: ClassVar[tuple[str, ...]] = ("totals", "steps")
    # Keys reports of schema version 1 may lack (``world_size`` defaults to the number of ranks on read).
    __json_defaults__: ClassVar[dict[str, Any]] = {
        "target": "",
        "backend": "",
        "torch_version": "",
        "plugin": {},
        "graphs": (),
        "recompiles": (),
        "ranks": (),
    }

    target: str
    world_size: int
    backend: str
    torch_version: str
    plugin: dict[str, Any]
    graph_breaks: tuple[GraphBreak, ...]
    graphs: tuple[Graph, ...]
    recompiles: tuple[Recompile, ...]
    ranks: tuple[RankSummary, ...]
    errors: tuple[str, ...] = ()
    stock: AuditReport | None = None
    numerics: Numerics | None = None
    comm: Comm | None = None
    notes: tuple[str, ...] = ()

    # ---- totals (what the CI gate compares) ------------------------------------
    @property
    def total_breaks(self) -> int:
        """Breaks (graph breaks + frame skips) on the rank with the most."""
        return max((r.graph_breaks + r.frame_skips for r in self.ranks), default=0)

    @property
    def total_recompiles(self) -> int:
        """Recompiles on the rank with the most."""
        return max((r.recompiles for r in self.ranks), default=0)

    @property
    def steps(self) -> tuple[StepCounts, ...]:
        """Per training step, the most any rank had of each count (empty when no rank's events carry a step)."""
        return worst_per_step(r.steps for r in self.ranks)

    @property
    def hang_risks(self) -> tuple[str, ...]:
        """One line per graph whose collective sequence differs between ranks (what ``--max-hang-risks`` counts)."""
        return tuple(
            f"graph {g.id}: collectives differ across ranks: "
            + "; ".join(f"rank {r}: [{', '.join(seq)}]" for r, seq in _distinct_seqs(g))
            for g in self.graphs
            if g.hang_risk
        )

    @property
    def failures(self) -> tuple[str, ...]:
        """What went wrong in this run, ranks that raised the same thing on one line.

        ``"ranks 0–3 raised RuntimeError: the compiled step differs from eager: ..."`` (a message's own
        ``"rank R: "`` prefix is dropped so that equal failures group); the launcher's other lines
        (a timeout, a rank that died without a word) follow as they are.  Empty when :attr:`ok`.
        """
        raised = [
            (r.rank, r.error.replace(f"rank {r.rank}: ", "", 1))
            for r in self.ranks
            if r.status == RankStatus.ERROR and r.error
        ]
        lines = [f"rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)} raised {msg}" for msg, rs in group_by(raised)]
        said = {r for r, _ in raised}
        for e in self.errors:
            head = e.split(" raised ", 1)[0]
            if not (head.startswith("rank ") and head[5:].isdigit() and int(head[5:]) in said):
                lines.append(e)
        return tuple(lines)

    @property
    def ok(self) -> bool:
        """Every rank finished and nothing went wrong in the launcher."""
        return not self.errors and all(r.status == RankStatus.OK for r in self.ranks)

    @property
    def totals(self) -> dict[str, Any]:
        """What the CI gate compares, on the rank with the most of each (the JSON's ``totals``)."""
        return {
            "graph_breaks": self.total_breaks,
            "recompiles": self.total_recompiles,
            "graphs": max((r.graphs for r in self.ranks), default=0),
            "hang_risks": list(self.hang_risks),
            "numerics_mismatches": None if self.numerics is None else len(self.numerics.mismatches),
            "comm_bytes_per_step": None if self.comm is None else self.comm.bytes_per_step,
        }

    def to_json(self) -> dict[str, Any]:
        """The documented JSON form (see docs/audit.md; schema: ``report.schema.json``)."""
        return {"schema_version": SCHEMA_VERSION, **codec.encode_fields(self)}

    def __str__(self) -> str:
        if not _text_renderer:
            raise RuntimeError(
                "no text renderer registered for AuditReport: import dynamo_ext.audit (it loads "
                "dynamo_ext.audit.render.text, which registers it)"
            )
        return _text_renderer[0](self)


def _distinct_seqs(g: Graph) -> list[tuple[str, tuple[str, ...]]]:
    """Ranks grouped by collective sequence (ranks lacking the graph show as ``[]`` when others have it)."""
    return [(format_ranks(rs), seq) for seq, rs in group_by(g.collective_sequence_by_rank)]
