"""Torch's logs and structured trace: what a log handler can read of the graph break or graph being logged."""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = [
    "emit_structured_artifact",
    "frame_being_compiled",
    "graph_break_being_logged",
    "graph_module_being_logged",
]

# Dynamo methods that log a graph break with the exception in a local named ``exc``
# (torch 2.11-2.15: ``InstructionTranslatorBase.log_graph_break``); on 2.13 the
# data-dependent-branch path (``jump_graph_break``) calls it outside any ``except``.
_GRAPH_BREAK_LOGGERS = frozenset({"log_graph_break"})


def graph_break_being_logged() -> BaseException | None:
    """The exception Dynamo is logging as a graph break right now, from inside a log handler.

    Read from the locals of Dynamo's ``log_graph_break`` frame on the current
    stack (exact, whether or not an ``except`` block is active), else from
    ``sys.exc_info()`` (the skip paths in ``convert_frame`` log inside their
    ``except``).  ``None`` when neither has one.
    """
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _GRAPH_BREAK_LOGGERS and "_dynamo" in frame.f_code.co_filename:
            exc = frame.f_locals.get("exc")
            if isinstance(exc, BaseException):
                return exc
        frame = frame.f_back
    return sys.exc_info()[1]


# Structured-trace event -> the local of the frame that logged it holding the GraphModule.
_LOGGED_GRAPH_LOCALS = {
    "dynamo_output_graph": ("gm",),
    "aot_forward_graph": ("fw_module",),
    "aot_inference_graph": ("fw_module",),
    "aot_backward_graph": ("bw_module",),
}


def graph_module_being_logged(trace_name: str) -> tuple[Any, int | None]:
    """The ``GraphModule`` (and AOTAutograd's ``aot_id``) whose text ``trace_structured(trace_name)`` is logging.

    Called from a log handler on ``torch.__trace``: read from the locals of the
    frame that called ``trace_structured`` (Dynamo's ``compile_and_call_fx_graph``:
    ``gm``; AOTAutograd's ``_log_fw_bw_graphs``: ``fw_module``/``bw_module``;
    ``aot_dispatch_base_graph``: ``fw_module``), so the graph is seen exactly as
    logged and nothing is recompiled.  ``(None, None)`` when that frame or local
    is not there (a cache hit logs only text; another torch release names them
    differently).
    """
    import sys

    names = _LOGGED_GRAPH_LOCALS.get(trace_name, ())
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "trace_structured":
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    if caller is None:
        return None, None
    loc = caller.f_locals
    gm = next((loc[n] for n in names if isinstance(loc.get(n), torch.fx.GraphModule)), None)
    aot_id = getattr(loc.get("aot_config"), "aot_id", None)
    return gm, aot_id if isinstance(aot_id, int) else None


def frame_being_compiled() -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The locals and globals of the frame Dynamo compiles right now (what its sources ``L[...]``/``G[...]``
    name), from inside a log handler on its graph: the root ``InstructionTranslator``'s ``f_locals`` and
    ``f_globals`` (torch 2.11-2.15); ``None`` outside a compile."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    root = getattr(getattr(tx, "output", None), "root_tx", None)
    f_locals, f_globals = getattr(root, "f_locals", None), getattr(root, "f_globals", None)
    if not isinstance(f_locals, dict) or not isinstance(f_globals, dict):
        return None
    return f_locals, f_globals


def emit_structured_artifact(name: str, payload: dict[str, Any]) -> None:
    """``torch._logging.trace_structured("artifact", ...)`` with a JSON payload (tlparse, the audit)."""
    import json

    trace_structured = importlib.import_module("torch._logging").trace_structured
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=lambda: json.dumps(payload, sort_keys=True),
    )
