"""The rank-file format: one JSON object per line, each an event of one :class:`EventKind`.

NOTE [rank-file format]
A rank writes ``rank<R>.jsonl`` (:mod:`..rank.collect`): first the ``start`` header, which carries
``format_version`` (:data:`FORMAT_VERSION`), then what the collector saw, last ``end``.  Each line's
``"ev"`` names its kind; the other keys are the fields of that kind's record below (plus ``time``, the
Unix time the rank recorded it).  Readers go through :func:`parse_event`, which gives the typed record:
unknown keys are ignored (a newer writer may add keys without a new version), a missing required key or
an unknown kind is a :class:`ValueError`.  Bump :data:`FORMAT_VERSION` when a change would make an older
reader misread a file (a key changes meaning or type, a required key appears); the merge refuses files
of another version (:func:`check_format_version`) instead of guessing.

NOTE [steps]
``break``, ``compile``, ``fusion`` and ``comm_graph`` events carry the training step they happened in
(``step``, from 1; 0: before the first, while the target was built), and ``end`` the number of steps the
rank started (``steps``).  A target the audit drives (``make_step()``, :mod:`..rank.steps`) has its steps
numbered by the audit; a target that runs its own loop, by its optimizer steps (the first ``optimizer.step()``
ends step 1).  Both keys are optional: files without them read as they did (no per-step report).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ..model import codec
from ..model.kinds import BreakKind, StrEnum

# Version 1: the first versioned format (compile events carry their collective sequences).
FORMAT_VERSION = 1


class EventKind(StrEnum):
    """The ``"ev"`` of a rank-file line."""

    START = "start"  # the header: where the rank runs, versions, the target
    BREAK = "break"  # a graph break or frame skip
    COMPILE = "compile"  # one frame compile (with or without a graph)
    FUSION = "fusion"  # a fusion dynamo-ext's Inductor passes applied
    COMM_GRAPH = "comm_graph"  # the collectives of one AOT graph (the communication report)
    NUMERICS = "numerics"  # the compiled-vs-eager check
    ERROR = "error"  # the target (or the audit) raised
    INTERNAL = "internal"  # the collector failed on something; the report lists it
    STACK = "stack"  # where the main thread is (SIGUSR1)
    END = "end"  # the rank finished: its exit status and Dynamo's counters


# ``Start.plugin["blocks"]``: how the plugin compiled the graphs it traced (NOTE [the audit compiles each block]
# in ``rank/blocks.py``); the report prints it as it is.
BLOCKS_EACH_FOR_AUDIT = (
    "graphs with repeated blocks cut at them as a run cuts them, every block compiled for the audit: "
    "a run compiles identical blocks once, faster than the compile times here"
)
BLOCKS_WHOLE_BY_USER = "each graph compiled whole (dynamo_ext.config.compile_blocks_once off)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Start:
    """The header: the rank's place in the job (:func:`..rank.target.rank_identity`), versions and target.

    ``plugin``: ``{"installed": bool, "version": str, "error": str}``, and ``"blocks"`` (one of the
    ``BLOCKS_*`` texts) when the plugin is installed.
    """

    KIND: ClassVar[EventKind] = EventKind.START
    format_version: int | None = None  # None: written before rank files had a version
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    host: str | None = None
    launcher: str = ""
    pid: int | None = None
    torch_version: str = ""
    plugin: dict[str, Any] = dataclasses.field(default_factory=dict)
    target: str = ""
    time: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Break:
    """One graph break or frame skip; ``stack`` frames are ``(file, line, function, source)``, outermost first."""

    KIND: ClassVar[EventKind] = EventKind.BREAK
    kind: BreakKind
    gb_type: str
    stack: tuple[tuple[str, int, str, str], ...]
    distributed: bool
    wrapper: str = ""
    reason: str = ""
    explanation: str = ""
    hints: tuple[str, ...] = ()
    context: str = ""
    user_index: int | None = None  # the user's frame in ``stack``; None: the innermost
    abs_file: str | None = None  # the user frame's file as the rank saw it (for the snippet); None: ``stack``'s
    phase: str = "forward"
    compile_id: str = ""
    step: int | None = None  # NOTE [steps]
    time: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compile:
    """One frame compile; collectives of its forward (or Dynamo) graph and its backward graph, counted and in order."""

    KIND: ClassVar[EventKind] = EventKind.COMPILE
    compile_id: str
    function: str
    file: str
    line: int
    code_name: str = ""
    op_count: int = 0
    has_graph: bool = False
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    backward_collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    collective_sequence: tuple[str, ...] = ()
    backward_collective_sequence: tuple[str, ...] = ()
    time_s: float = 0.0
    recompile_reason: str | None = None
    fail_type: str | None = None
    fail_reason: str | None = None
    phase: str = "forward"
    step: int | None = None  # NOTE [steps]
    time: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fusion:
    """One applied fusion, keyed by its graph's compile id (``after_compile``: logged after that frame's compile)."""

    KIND: ClassVar[EventKind] = EventKind.FUSION
    compile_id: str
    fusion: str
    kernel: str = ""
    group_name: str = ""
    nbytes: int = 0
    node: str = ""
    phase: str = "forward"
    after_compile: bool = False
    step: int | None = None  # NOTE [steps]
    time: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommGraph:
    """The collectives of one AOT graph, one dict per collective (NOTE [communication report] in ``rank/comm.py``)."""

    KIND: ClassVar[EventKind] = EventKind.COMM_GRAPH
    compile_id: str
    graph: str  # forward, backward or compiled_autograd
    aot_id: int | None = None
    inlined_aot_ids: tuple[int, ...] = ()
    collectives: tuple[dict[str, Any], ...] = ()
    missing: str = ""  # why the graph was not analysed ("" when it was)
    step: int | None = None  # NOTE [steps]
    time: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Numerics:
    """The numerics check of one rank (``rank/numerics.py``); ``eager_comm``: the eager step's collective counts."""

    KIND: ClassVar[EventKind] = EventKind.NUMERICS
    compared: int
    mismatches: tuple[dict[str, Any], ...]
    eager_comm: dict[str, Any] | None = None
    steps: int | None = None  # training steps compared (NOTE [the audit drives the step]); None: one
    tolerances: tuple[str, ...] = ()  # the target's own (Step.tolerances), in words, where they were used
    time: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Error:
    """The target raised (``type`` ``Terminated``: the launcher stopped the rank with SIGTERM)."""

    KIND: ClassVar[EventKind] = EventKind.ERROR
    message: str
    type: str = ""
    traceback: str = ""
    time: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Internal:
    """The audit itself failed on something; the report lists it among its errors."""

    KIND: ClassVar[EventKind] = EventKind.INTERNAL
    message: str
    time: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stack:
    """Where the main thread is (NOTE [where each rank waits] in ``collective_check/stream.py``).

    ``waiting``: the compiled collectives the rank waits in, or waits to enter in the collective check's wait
    (NOTE [the collective a rank waits in] in ``rank/waits.py``): ``group``, ``ranks``, ``position``,
    ``collective``, ``source``, ``in_check``.
    """

    KIND: ClassVar[EventKind] = EventKind.STACK
    stack: tuple[tuple[str, int, str, str], ...]
    user_index: int = 0
    in_distributed: bool = False
    collectives: tuple[dict[str, Any], ...] = ()
    in_compiled_collective: bool = False
    waiting: tuple[dict[str, Any], ...] = ()
    time: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class End:
    """The rank finished: the exit status it returns and Dynamo's counters (their change during the run).

    ``steps``: the training steps the rank started (NOTE [steps]); ``None`` when it did not count them.
    """

    KIND: ClassVar[EventKind] = EventKind.END
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    status: int = 0
    steps: int | None = None
    time: float | None = None


Event = Start | Break | Compile | Fusion | CommGraph | Numerics | Error | Internal | Stack | End
EVENT_TYPES: dict[EventKind, type] = {
    cls.KIND: cls for cls in (Start, Break, Compile, Fusion, CommGraph, Numerics, Error, Internal, Stack, End)
}


def parse_event(data: Any) -> Event:
    """The typed record of one rank-file line (already parsed from JSON), or ``data`` itself if already typed.

    Raises:
        ValueError: ``data`` is not an object with a known ``"ev"``, or lacks a key its kind requires (the
            message names the kind and the key).
    """
    if isinstance(data, tuple(EVENT_TYPES.values())):
        return data
    if not isinstance(data, dict) or "ev" not in data:
        raise ValueError(f"not a rank-file event (an object with an 'ev' key): {str(data)[:80]!r}")
    try:
        kind = EventKind(data["ev"])
    except ValueError:
        raise ValueError(
            f"unknown event kind {data['ev']!r}; the kinds are {', '.join(k.value for k in EventKind)}"
        ) from None
    return codec.decode(EVENT_TYPES[kind], data)


def to_dict(event: Event) -> dict[str, Any]:
    """``event`` as the JSON object of its rank-file line (``"ev"`` first; no ``time`` when it has none, so that
    the collector stamps it when it records the event)."""
    out = {"ev": event.KIND.value, **codec.encode_fields(event)}
    if out["time"] is None:
        del out["time"]
    return out


class RankFileVersionError(ValueError):
    """A rank file of a format version this dynamo-ext does not read."""


def check_format_version(header: Start, path: str) -> None:
    """Raise :class:`RankFileVersionError` unless ``header`` (the ``start`` line of ``path``) is :data:`FORMAT_VERSION`.

    Raises:
        RankFileVersionError: the message names the file, its version and the one this dynamo-ext reads.
    """
    if header.format_version == FORMAT_VERSION:
        return
    seen = (
        "no format version (written by a dynamo-ext from before rank files had one)"
        if header.format_version is None
        else f"format version {header.format_version}"
    )
    raise RankFileVersionError(
        f"{path}: rank file of {seen}; this dynamo-ext reads format version {FORMAT_VERSION}. "
        "Collect and merge with the same dynamo-ext release (re-run the job, or merge with the release that wrote it)"
    )
