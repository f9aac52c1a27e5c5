"""The closed sets of words the report uses: a rank's status, a break's kind, a numerics mismatch's kind.

Each is a ``str`` enum: it compares, hashes, formats and serialises as its value (``RankStatus.OK == "ok"``,
``f"{RankStatus.OK}"`` is ``"ok"``, ``json.dumps`` writes ``"ok"``), so JSON reports and rank files are unchanged.
"""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """A ``str`` enum whose ``str()`` and ``format()`` are its value (``enum.StrEnum`` needs Python 3.11)."""

    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__


class RankStatus(StrEnum):
    """What became of one rank (:class:`.records.RankSummary` ``status``)."""

    OK = "ok"  # finished
    ERROR = "error"  # the target raised (or exited non-zero)
    DIED = "died"  # ended without saying why: a rank file cut short
    TIMEOUT = "timeout"  # still running when the launcher's --timeout ran out
    STOPPED = "stopped"  # ended by the launcher after another rank failed
    MISSING = "missing"  # no rank file: ``audit merge`` expected it from the world size
    UNKNOWN = "unknown"  # a TORCH_TRACE log does not say whether the rank finished


# Statuses that mean the rank's findings are incomplete.
INCOMPLETE = (RankStatus.ERROR, RankStatus.DIED, RankStatus.TIMEOUT, RankStatus.STOPPED, RankStatus.MISSING)


class BreakKind(StrEnum):
    """How Dynamo handled a break (:class:`.records.GraphBreak` ``kind``)."""

    GRAPH_BREAK = "graph_break"  # Dynamo split the frame; counted in counters["graph_break"]
    FRAME_SKIP = "frame_skip"  # Dynamo gave up on the whole frame and runs it eagerly


class MismatchKind(StrEnum):
    """What a numerics mismatch compares (:class:`.records.NumericsMismatch` ``kind``)."""

    OUTPUT = "output"  # a path into what the step returned
    GRAD = "grad"  # a parameter's gradient after backward
    PARAM = "param"  # a parameter after the optimizer step
