"""The eager step's collectives, counted on each rank with ``CommDebugMode`` (what the merged count is checked against).

NOTE [like-with-like collective counts] in :mod:`..merge.comm` says how the two counts are compared;
:func:`count_eager` fills the ``eager_comm`` of a rank's ``numerics`` event.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from .comm import TRAFFIC

# CommDebugMode's c10d op names -> traffic kind.
EAGER_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "broadcast_": "broadcast",
    **TRAFFIC,
}


def eager_kind(op_name: str) -> str:
    """Traffic kind of a ``CommDebugMode`` key (``"c10d._allgather_base_"`` -> ``"all_gather"``); else the name."""
    short = op_name.rsplit(".", 1)[-1]
    return EAGER_KINDS.get(short, short)


def eager_module_path(name: str) -> str:
    """``CommDebugMode``'s module name as the report's module path.

    ``"Transformer.layers.0._checkpoint_wrapped_module.attention"`` -> ``"layers.0.attention"``
    (the root's class name and activation checkpointing's wrapper dropped, as
    :func:`.comm.module_path` does); the root -> ``"<root>"``; ``"Global"`` (the whole step) stays.
    """
    if name == "Global":
        return name
    parts = [p for p in name.split(".")[1:] if p != "_checkpoint_wrapped_module"]
    return ".".join(parts) or "<root>"


@contextlib.contextmanager
def count_eager(into: dict[str, Any]) -> Iterator[None]:
    """Count the collectives run inside, per phase and kind, with ``CommDebugMode``; fills ``into`` on exit.

    ``into`` becomes ``{"forward": {kind: n}, "backward": {kind: n}, "modules": {path: {phase: {kind: n}}},
    "modules_c10d": ...}`` (phases as ``CommDebugMode``'s module tracker sees them).  ``modules``: per
    module path (:func:`eager_module_path`), the collectives issued while that module or one inside it
    ran (``CommDebugMode.comm_module_counts``: a module's count includes its submodules'), ``"Global"``
    the whole step; ``modules_c10d``: the same for c10d's own ops only (``c10d._allgather_base_``: what
    FSDP2's hooks and explicit ``dist`` calls issue; DTensor issues functional collectives).  What the
    communication report's count differences are explained with (:mod:`..merge.comm_explain`).
    """
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        yield
    modules: dict[str, dict[str, dict[str, int]]] = {}
    c10d: dict[str, dict[str, dict[str, int]]] = {}
    # A wrapper and the module it wraps share a path; the wrapper (the shorter name) counts both: it wins.
    for name, phases in sorted(mode.comm_module_counts.items(), key=lambda kv: len(str(kv[0]))):
        path = eager_module_path(str(name))
        if path in modules:
            continue
        for into_modules, only_c10d in ((modules, False), (c10d, True)):
            per_phase = {}
            for phase in ("forward", "backward"):
                per: dict[str, int] = defaultdict(int)
                for op, n in phases.get(phase, {}).items():
                    if not only_c10d or str(op).startswith("c10d."):
                        per[eager_kind(str(op))] += int(n)
                per_phase[phase] = dict(per)
            into_modules[path] = per_phase
    glob = modules.get("Global", {})
    for phase in ("forward", "backward"):
        into[phase] = glob.get(phase, {})
    into["modules"] = modules
    into["modules_c10d"] = c10d


def eager_counted_step(spec: Any) -> tuple[Any, dict[str, Any]]:
    """``spec`` (a :class:`.numerics.Step`) whose eager ``step(False)`` is counted by :func:`count_eager`."""
    counts: dict[str, Any] = {}
    inner = spec.step

    def step(compiled: bool) -> Any:
        if compiled:
            return inner(True)
        with count_eager(counts):
            return inner(False)

    return dataclasses.replace(spec, step=step), counts
