"""What each fusion pass decided, per candidate: a log line, a structured artifact, a record.

Every candidate (an all-reduce the pass looked at) gets one ``DEBUG`` line on the
pass module's logger saying which fusion applied or the first condition that failed,
and every applied fusion also an ``INFO`` line, a ``dynamo_ext_fusion`` artifact in
torch's structured trace (``torch._logging.trace_structured``, read by tlparse and
by the audit's collector, keyed like every artifact by the compile id) and a
:class:`FusionRecord` in :func:`applied_fusions` (this process, newest last).
The loggers sit under ``dynamo_ext``, so ``TORCH_LOGS="+dynamo_ext"`` or
``logging.getLogger("dynamo_ext").setLevel(logging.DEBUG)`` shows them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

from .. import _compat

ARTIFACT_NAME = "dynamo_ext_fusion"
_MAX_RECORDS = 4096


@dataclasses.dataclass(frozen=True)
class FusionRecord:
    """One applied fusion.

    ``fusion``: the pass's name (``"residual_rms_norm"``); ``kernel``: what runs
    (``"one_shot"`` / ``"two_shot"`` Triton kernel, or ``"epilogue"``: the collective
    stays stock, the add + norm are fused); ``compile_id``: Dynamo's compile id of the
    graph (``"0/0"``; empty outside a compile); ``node``: the collective's FX name.
    """

    fusion: str
    kernel: str
    group_name: str
    nbytes: int
    compile_id: str
    node: str

    def __str__(self) -> str:
        where = f"[{self.compile_id}] " if self.compile_id else ""
        return f"{where}{self.fusion} ({self.kernel}) on group {self.group_name}, {self.nbytes} bytes at {self.node}"


_RECORDS: collections.deque[FusionRecord] = collections.deque(maxlen=_MAX_RECORDS)


def applied_fusions(*, clear: bool = False) -> list[FusionRecord]:
    """Fusions applied in this process so far (at most the last 4096), oldest first; ``clear`` empties the list."""
    out = list(_RECORDS)
    if clear:
        _RECORDS.clear()
    return out


def _compile_id() -> str:
    value = _compat.current_compile_id()
    return "" if value is None else str(value)


def applied(log: logging.Logger, *, fusion: str, kernel: str, group_name: str, nbytes: int, node: str) -> FusionRecord:
    """Record and log one applied fusion (INFO line, structured artifact, :func:`applied_fusions`)."""
    record = FusionRecord(fusion, kernel, group_name, nbytes, _compile_id(), node)
    _RECORDS.append(record)
    log.info("applied %s", record)
    _compat.emit_structured_artifact(ARTIFACT_NAME, dataclasses.asdict(record))
    return record


def not_applied(log: logging.Logger, *, fusion: str, node: str, reason: str, detail: Any = None) -> None:
    """Log (DEBUG) why ``fusion`` was not applied at ``node``: the first condition that failed."""
    if log.isEnabledFor(logging.DEBUG):
        suffix = "" if detail is None else f" ({detail})"
        log.debug("%s not applied at %s: %s%s", fusion, node, reason, suffix)
