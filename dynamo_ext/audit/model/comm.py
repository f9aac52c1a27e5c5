"""The communication report's records: every collective of every compiled graph, per-module totals, count checks.

Part of :class:`.records.AuditReport` (its ``comm``); see docs/audit.md, "Communication".
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of one compiled graph, merged over the ranks that issue it (see docs/audit.md, "Communication").

    ``graph``: the graph's identity (:class:`.records.Graph` ``id``); ``graph_kind``:
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
    inlined; it never runs by itself and is left out of every total.  ``step``:
    the training step its graph was compiled in (``None``: not known); graphs
    compiled after the first step are left out of the totals (see :class:`Comm`).
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
    step: int | None = None

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
    (phase, kind), FSDP2's traced collectives counted once per FSDP
    group and phase as eager FSDP2 issues them (the like-with-like count);
    ``eager_counts``: ``CommDebugMode``'s counts of the eager step, mapped to
    the same kinds (``None``: the numerics check did not run); ``count_differences``: where
    the two differ, and why (:class:`CountDifference`).  ``missing``: graphs
    with collectives that were not analysed (the report and its totals are
    incomplete; ``--comm-budget`` then fails).  When the steps are known (NOTE [steps]), the totals and
    counts are those of the first step that compiled a graph: graphs compiled in a later step (a recompile)
    replace or add to its graphs, so they are listed in ``later_steps`` (one line per graph: its step,
    identity and collectives) and counted in no total.
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
    later_steps: tuple[str, ...] = ()
