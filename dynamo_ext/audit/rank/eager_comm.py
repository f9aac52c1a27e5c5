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
    FSDP2's hooks and explicit ``dist`` calls issue; DTensor issues functional collectives);
    ``outside_root``: the modules that ran while the root module did not (a loss calling the model's output
    projection itself): their counts are not in the root's.  What the communication report's count
    differences are explained with (:mod:`..merge.comm_explain`).  NOTE [collectives outside any module].
    """
    mode = _mode()
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
    parents = getattr(getattr(mode, "advanced_module_tracker", None), "module_parents_dict", None) or {}
    roots = {str(n) for n in parents if eager_module_path(str(n)) == "<root>"}
    into["outside_root"] = sorted(
        eager_module_path(str(n)) for n, ps in parents.items() if "." in str(n) and not roots & set(ps)
    )


# NOTE [collectives outside any module]
# CommDebugMode's module tracker names the module a collective belongs to by the module it entered last, and
# backward ends in the first module (the embedding): a collective the step issues after ``backward()``
# (gradient clipping's norms) is counted in that module's forward.  So a collective issued while no module runs
# (the tracker's ``parents`` is only ``"Global"``) and outside the backward is counted in ``"Global"`` alone:
# outside any module, where it is.
def _mode() -> Any:
    from torch.distributed.tensor.debug import CommDebugMode

    class _OutsideModules(CommDebugMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            tracker = getattr(self, "advanced_module_tracker", None)
            if tracker is None or getattr(tracker, "parents", None) != {"Global"} or tracker.is_bw:
                return super().__torch_dispatch__(func, types, args, kwargs)
            name, tracker.name = tracker.name, "Global"
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                tracker.name = name

    return _OutsideModules()


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
