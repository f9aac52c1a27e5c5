"""The audit's data: frozen records, merged across ranks, and their JSON form.

A rank's collector (:mod:`..rank.collector`) writes plain event dicts; :mod:`..merge`
turns the events of every rank into one :class:`AuditReport`.  The JSON form
(:meth:`AuditReport.to_json`) is the stable schema documented in
``docs/audit.md``; :func:`report_from_json` reads it back (for ``diff`` and
``--baseline``).  ``str(report)`` is the terminal report without colour.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# Bump on an incompatible change of the JSON layout; adding keys is compatible.
SCHEMA_VERSION = 1


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
    ``--baseline`` and ``audit diff`` compare.  ``kind`` is ``"graph_break"``
    (Dynamo split the frame; counted in ``counters["graph_break"]``) or
    ``"frame_skip"`` (Dynamo gave up on the whole frame and runs it eagerly;
    at least one occurrence did).
    ``gb_type`` is the innermost cause; ``wrapper`` the gb_type Dynamo wrapped
    it in, if any (``"graph break in loop"``: the cause made a frame skip).
    """

    id: str
    kind: str
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
        from .ranges import format_ranks

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

    @property
    def op_count(self) -> int:
        return max((n for _, n in self.op_count_by_rank), default=0)


@dataclasses.dataclass(frozen=True)
class Recompile:
    """One recompile reason (the failed guard, in words), merged over ranks."""

    id: str
    function: str
    file: str
    line: int
    reason: str
    ranks: tuple[int, ...]
    count_by_rank: tuple[tuple[int, int], ...]
    hang_risk: bool
    divergent: bool = False

    @property
    def count(self) -> int:
        return sum(n for _, n in self.count_by_rank)


@dataclasses.dataclass(frozen=True)
class RankSummary:
    """What one rank did: its status and its own totals.

    ``status`` is ``"ok"``, ``"error"`` (the target raised), ``"died"`` (the
    process ended without saying why; a rank file cut short), ``"timeout"``,
    ``"stopped"`` (ended by the launcher after another rank failed) or
    ``"missing"`` (no rank file: ``audit merge`` expected it from the world
    size).  ``host``/``node_rank``/``local_rank``: where the rank ran, from its
    rank file's header (``""``/``None`` when unknown; for a missing rank the
    host is inferred from its node's other ranks, if any).  ``dynamo_graph_breaks``
    is ``sum(torch._dynamo.utils.counters["graph_break"].values())`` read on the
    rank at the end (``None`` when the rank never got there); ``dynamo_missed``
    the breaks of ``graph_breaks`` that counter did not count (torch 2.13 does not
    count data-dependent branches), so ``graph_breaks == dynamo_graph_breaks +
    dynamo_missed`` when the audit and Dynamo agree.
    """

    rank: int
    status: str
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


@dataclasses.dataclass(frozen=True)
class NumericsMismatch:
    """One tensor that differs between the compiled and the eager step on one rank.

    ``kind``: ``"output"`` (a path into what ``step`` returned: ``"loss"``,
    ``"out[0]"``), ``"grad"`` (a parameter's gradient after ``backward``) or
    ``"param"`` (a parameter after the optimizer step), by parameter name;
    local shards for DTensors.  ``max_abs``/``max_rel``: the largest absolute
    and relative (to eager) error, ``None`` when not comparable (``detail``
    says why: type, placements, shape, dtype, missing).  ``index``: position
    in the comparison order (outputs, gradients, parameters).
    """

    rank: int
    index: int
    kind: str
    name: str
    detail: str
    max_abs: float | None
    max_rel: float | None

    def __str__(self) -> str:
        err = (
            f"max abs error {self.max_abs:.3g}, max rel error {self.max_rel:.3g}"
            if self.max_abs is not None and self.max_rel is not None
            else self.detail
        )
        what = {"output": "output", "grad": "gradient of", "param": "parameter after the step"}.get(
            self.kind, self.kind
        )
        return f"{what} {self.name} on rank {self.rank}: {err}"


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The numerics check (``--check-numerics``): compiled step vs eager step, from the same state, per rank.

    ``compared``: tensors compared per rank (outputs + gradients + parameters);
    ``ranks``: the ranks that finished the check; ``mismatches`` sorted by
    comparison order, then rank: ``mismatches[0]`` is the first tensor that differs.
    """

    compared: int
    ranks: tuple[int, ...]
    mismatches: tuple[NumericsMismatch, ...]

    @property
    def first(self) -> NumericsMismatch | None:
        return self.mismatches[0] if self.mismatches else None


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of one compiled graph, merged over the ranks that issue it (see docs/audit.md, "Communication").

    ``graph``: the graph's identity (:class:`Graph` ``id``); ``graph_kind``:
    ``"forward"`` / ``"backward"`` (AOTAutograd's) or ``"compiled_autograd"``;
    ``index``: position among the graph's collectives.  ``op``: the functional
    collective, ``kind`` its traffic class (``all_gather``, ``reduce_scatter``,
    ``all_reduce``, ``all_to_all``, ``broadcast``).  ``group`` (process-group
    name), ``group_size``, ``group_ranks``, ``mesh_axis`` (the mesh dimension
    name of that group, ``""`` when no mesh has it).  Bytes are per rank:
    ``bytes_in``/``bytes_out`` the collective's input and output,
    ``sent``/``received`` what a ring algorithm moves (worst rank;
    ``sent_by_rank`` for each).  ``est_ms``: ``torch._inductor.comm_analysis``'s
    NCCL estimate (``None``: it could not estimate).  ``overlap_ops``: compute
    ops between the collective and its wait in graph order (``None``: no wait in
    the graph).  ``file``/``line``/``function``/``source``: the user line;
    ``module``: the module path.  ``origin``: ``fsdp``, ``dtensor``, ``explicit``
    or ``unknown``.  DTensor collectives: ``placements_before``/``after`` on
    ``mesh_axis`` (``placements_basis``: ``graph`` when read from the Dynamo
    graph's ``redistribute``, else implied by the collective) and
    ``alternative`` (``alternative_basis`` ``"heuristic"``: a suggestion, not
    verified).  ``inlined``: an AOT backward graph that compiled autograd
    inlined; it never runs by itself and is left out of every total.
    """

    graph: str
    graph_kind: str
    phase: str
    index: int
    op: str
    kind: str
    group: str
    group_size: int
    group_ranks: tuple[int, ...]
    mesh_axis: str
    dtype: str
    shape_in: str
    shape_out: str
    bytes_in: int
    bytes_out: int
    sent: int
    received: int
    est_ms: float | None
    overlap_ops: int | None
    file: str
    line: int
    function: str
    source: str
    module: str
    origin: str
    placements_before: str
    placements_after: str
    placements_basis: str
    alternative: str
    alternative_basis: str
    ranks: tuple[int, ...]
    sent_by_rank: tuple[tuple[int, int], ...]
    inlined: bool = False

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}" if self.file else "-"


@dataclasses.dataclass(frozen=True)
class ModuleComm:
    """Collectives of one module in one phase (inlined graphs left out); bytes sent per rank (worst rank)."""

    module: str
    phase: str
    count: int
    sent: int
    est_ms: float


@dataclasses.dataclass(frozen=True)
class CountDifference:
    """Where the compiled collective count of one (phase, kind) differs from eager ``CommDebugMode``'s, and why.

    ``compiled``/``eager``: the two counts; ``reasons``: one line per module (or the root's own, or
    outside any module) whose counts differ, with its cause in words (NOTE [count differences] in
    ``audit/comm_explain.py``); ``unexplained``: what no reason covers (``""`` when every difference
    has one; else the report says MISMATCH).
    """

    phase: str
    kind: str
    compiled: int
    eager: int
    reasons: tuple[str, ...]
    unexplained: str = ""


@dataclasses.dataclass(frozen=True)
class Comm:
    """The communication report: every collective of every compiled graph, and totals.

    ``bytes_per_step``: bytes one rank sends in one step (worst rank), each
    compiled graph counted once (a graph that runs k times per step moves k
    times that); what ``--comm-budget`` compares.  ``counts``: collectives per
    (phase, kind), FSDP2's per-parameter collectives counted once per FSDP
    group and phase as eager FSDP2 issues them (the like-with-like count);
    ``eager_counts``: ``CommDebugMode``'s counts of the eager step, mapped to
    the same kinds (``None``: the numerics check did not run); ``count_differences``: where
    the two differ, and why (:class:`CountDifference`).  ``missing``: graphs
    with collectives that were not analysed (the report and its totals are
    incomplete; ``--comm-budget`` then fails).
    """

    collectives: tuple[Collective, ...]
    modules: tuple[ModuleComm, ...]
    bytes_per_step: int
    bytes_by_rank: tuple[tuple[int, int], ...]
    est_ms_per_step: float
    counts: tuple[tuple[str, str, int], ...]
    eager_counts: tuple[tuple[str, str, int], ...] | None = None
    missing: tuple[str, ...] = ()
    count_differences: tuple[CountDifference, ...] = ()


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Everything the audit found; ``str(report)`` is the terminal report.

    ``plugin`` says whether dynamo-ext was installed on the ranks
    (``{"installed": bool, "version": str, "error": str}``).  ``stock`` is the
    run without the plugin when ``--compare-stock`` was given.  ``numerics`` is
    the numerics check (``None`` when it did not run).  ``notes``: what the
    input could not say (a ``TORCH_TRACE`` directory has no exit statuses,
    numerics or plugin state: :mod:`..merge.trace_reader`).
    """

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
        from .ranges import format_ranks, group_by

        raised = [
            (r.rank, r.error.replace(f"rank {r.rank}: ", "", 1)) for r in self.ranks if r.status == "error" and r.error
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
        return not self.errors and all(r.status == "ok" for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        """The documented JSON form (see docs/audit.md)."""
        return _to_plain(self)

    def __str__(self) -> str:
        from ..render.text import render_text

        return render_text(self)


def _distinct_seqs(g: Graph) -> list[tuple[str, tuple[str, ...]]]:
    """Ranks grouped by collective sequence (ranks lacking the graph show as ``[]`` when others have it)."""
    from .ranges import format_ranks, group_by

    return [(format_ranks(rs), seq) for seq, rs in group_by(g.collective_sequence_by_rank)]


def _to_plain(report: AuditReport) -> dict[str, Any]:
    def conv(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            d = {f.name: conv(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            if isinstance(obj, (GraphBreak, Recompile)):
                d["count"] = obj.count
            if isinstance(obj, Graph):
                d["op_count"] = obj.op_count
            return d
        if isinstance(obj, (tuple, list)):
            return [conv(x) for x in obj]
        if isinstance(obj, dict):
            return {str(k): conv(v) for k, v in obj.items()}
        return obj

    out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
    out.update(conv(dataclasses.replace(report, stock=None)))
    out["stock"] = None if report.stock is None else _to_plain(report.stock)
    out["totals"] = {
        "graph_breaks": report.total_breaks,
        "recompiles": report.total_recompiles,
        "graphs": max((r.graphs for r in report.ranks), default=0),
        "hang_risks": list(report.hang_risks),
        "numerics_mismatches": None if report.numerics is None else len(report.numerics.mismatches),
        "comm_bytes_per_step": None if report.comm is None else report.comm.bytes_per_step,
    }
    return out


def _pairs(x: Any) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in x)


def report_from_json(data: dict[str, Any]) -> AuditReport:
    """Read back :meth:`AuditReport.to_json` output.

    Raises:
        ValueError: ``data`` is not an audit report or has a newer schema version.
    """
    if not isinstance(data, dict) or "graph_breaks" not in data:
        raise ValueError("not a dynamo-ext audit report: expected a JSON object with a 'graph_breaks' key")
    version = data.get("schema_version", 1)
    if version > SCHEMA_VERSION:
        raise ValueError(
            f"audit report schema_version {version} is newer than this dynamo-ext reads ({SCHEMA_VERSION})"
        )

    def frames(xs: list[dict[str, Any]]) -> tuple[Frame, ...]:
        return tuple(Frame(**x) for x in xs)

    breaks = tuple(
        GraphBreak(
            **{
                "wrapper": "",
                **{k: v for k, v in b.items() if k != "count"},
                "hints": tuple(b["hints"]),
                "ranks": tuple(b["ranks"]),
                "count_by_rank": _pairs(b["count_by_rank"]),
                "stack": frames(b["stack"]),
                "snippet": tuple((int(n), s) for n, s in b["snippet"]),
            }
        )
        for b in data["graph_breaks"]
    )
    graphs = tuple(
        Graph(
            **{
                **{k: v for k, v in g.items() if k != "op_count"},
                "ranks": tuple(g["ranks"]),
                "op_count_by_rank": _pairs(g["op_count_by_rank"]),
                "collectives": tuple((a, int(b)) for a, b in g["collectives"]),
                "backward_collectives": tuple((a, int(b)) for a, b in g["backward_collectives"]),
                "collective_sequence_by_rank": tuple(
                    (int(r), tuple(seq)) for r, seq in g.get("collective_sequence_by_rank", ())
                ),
                "fusions": tuple(Fusion(**{**f, "ranks": tuple(f["ranks"])}) for f in g.get("fusions", ())),
            }
        )
        for g in data.get("graphs", [])
    )
    recompiles = tuple(
        Recompile(
            **{
                **{k: v for k, v in r.items() if k != "count"},
                "ranks": tuple(r["ranks"]),
                "count_by_rank": _pairs(r["count_by_rank"]),
            }
        )
        for r in data.get("recompiles", [])
    )
    ranks = tuple(RankSummary(**r) for r in data.get("ranks", []))
    stock = data.get("stock")
    num = data.get("numerics")
    numerics = (
        None
        if num is None
        else Numerics(
            compared=int(num["compared"]),
            ranks=tuple(num["ranks"]),
            mismatches=tuple(NumericsMismatch(**m) for m in num["mismatches"]),
        )
    )
    return AuditReport(
        comm=_comm_from_json(data.get("comm")),
        target=data.get("target", ""),
        world_size=data.get("world_size", len(ranks)),
        backend=data.get("backend", ""),
        torch_version=data.get("torch_version", ""),
        plugin=dict(data.get("plugin", {})),
        graph_breaks=breaks,
        graphs=graphs,
        recompiles=recompiles,
        ranks=ranks,
        errors=tuple(data.get("errors", [])),
        stock=None if stock is None else report_from_json(stock),
        numerics=numerics,
        notes=tuple(data.get("notes", ())),
    )


def _comm_from_json(c: dict[str, Any] | None) -> Comm | None:
    if c is None:
        return None

    def triples(xs: Any) -> tuple[tuple[str, str, int], ...]:
        return tuple((str(a), str(b), int(n)) for a, b, n in xs)

    return Comm(
        collectives=tuple(
            Collective(
                **{
                    **x,
                    "group_ranks": tuple(x["group_ranks"]),
                    "ranks": tuple(x["ranks"]),
                    "sent_by_rank": _pairs(x["sent_by_rank"]),
                }
            )
            for x in c["collectives"]
        ),
        modules=tuple(ModuleComm(**m) for m in c["modules"]),
        bytes_per_step=int(c["bytes_per_step"]),
        bytes_by_rank=_pairs(c["bytes_by_rank"]),
        est_ms_per_step=float(c["est_ms_per_step"]),
        counts=triples(c["counts"]),
        eager_counts=None if c.get("eager_counts") is None else triples(c["eager_counts"]),
        missing=tuple(c.get("missing", ())),
        count_differences=tuple(
            CountDifference(**{**d, "reasons": tuple(d["reasons"])}) for d in c.get("count_differences", ())
        ),
    )


def load_report(path: str) -> AuditReport:
    """Read a JSON report written by ``--json``.

    Raises:
        ValueError: the file is not valid JSON or not an audit report.
        FileNotFoundError: no such file.
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    return report_from_json(data)
