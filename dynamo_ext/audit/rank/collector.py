"""Per-rank collection from Dynamo's own structured trace.

NOTE [audit signals]
Everything comes from ``torch._logging.trace_structured``, the stream tlparse
reads, through one ``logging.Handler`` on the ``torch.__trace`` logger:

- ``artifact dynamo_graph_break_reason``: Dynamo logs every graph break here,
  from inside the ``except`` block that caught the ``Unsupported``, so
  ``sys.exc_info()`` in the handler is the exception itself, with its
  ``gb_type``, message and ``real_stack``.  One event per increment of
  ``counters["graph_break"]``; the ones whose payload says "results in a skip"
  are frames Dynamo gave up on (a break in a loop, in a ``with`` block ...),
  which the counter does not count but the audit does.  Skips are only logged
  while the ``graph_breaks`` artifact logger is enabled, so :meth:`start`
  raises its level.
- ``dynamo_output_graph`` / ``aot_*_graph``: the graphs, for collectives (read from
  the ``GraphModule`` being logged, NOTE [one collective reader]; from the text
  when only the text is there: a ``TORCH_TRACE`` log, an AOT cache hit).
- ``artifact dynamo_ext_fusion``: one per fusion dynamo-ext's Inductor passes
  applied, keyed by the compile id like every artifact; the merge attaches it
  to the graph of that compile.
- ``compilation_metrics``: one per frame compile, with the op count, the
  compile time and, for a recompile, the failed guard in words (our guards
  put words there, see ``dynamo_ext/guards/reasons.py``).

Counting never derives breaks from graphs - 1.  The handler never raises into
Dynamo: a failure becomes an ``internal`` event.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ... import _compat
from ...fx import collectives as fx_collectives
from .comm import CommTracer
from .identity import is_distributed_cause, normalize_path, user_frame_index

TRACE_LOGGER = "torch.__trace"
GRAPH_BREAK_LOGGERS = ("torch._dynamo.convert_frame.__graph_breaks", "torch._dynamo.symbolic_convert.__graph_breaks")
_SKIP_PREFIX = "Graph break: torch.compile cannot properly resume"
_RESUME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_\d+$")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# dynamo_ext.inductor_lowerings.decisions.ARTIFACT_NAME, by name: the audit imports nothing of the lowerings.
FUSION_ARTIFACT = "dynamo_ext_fusion"
RECOMPILE_LIMIT_GB_TYPE = "Dynamo recompile limit exceeded"
_CID_PREFIX = re.compile(r"^\s*!?[\d/]+:\s*", re.M)
_USER_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)', re.M)
# Frames above Dynamo's callback that are not user code.
_DROP_ABOVE = (
    os.path.join(_TORCH_DIR, "_dynamo"),
    os.path.join(_TORCH_DIR, "nn", "modules", "module.py"),
    os.path.dirname(logging.__file__),
    *(os.path.join(os.path.dirname(__file__), f) for f in ("collect.py", "collector.py")),
    *(os.path.join(os.path.dirname(os.path.dirname(__file__)), f) for f in ("api.py", "collect.py")),
    "<frozen ",
)


def parse_message(msg: str) -> tuple[str, str, tuple[str, ...], str]:
    """(first line, explanation, hints, context) of Dynamo's ``format_graph_break_message`` text."""
    first = msg.strip().splitlines()[0] if msg.strip() else ""
    expl = re.search(r"^\s*Explanation: (.*?)(?=^\s*Hint: |^\s*Developer debug context: |\Z)", msg, re.S | re.M)
    ctx = re.search(r"^\s*Developer debug context: (.*?)(?=^\s*For more details|\Z)", msg, re.S | re.M)
    hints = tuple(
        " ".join(h.split())
        for h in re.findall(r"^\s*Hint: (.*?)(?=^\s*Hint: |^\s*Developer debug context: |^\s*$|\Z)", msg, re.S | re.M)
    )
    return (
        first,
        " ".join(expl.group(1).split()) if expl else "",
        hints,
        " ".join(ctx.group(1).split()) if ctx else "",
    )


def collectives_in(graph: str | list[str] | None) -> dict[str, int]:
    """Collective op names and counts of a graph: its sequence (:func:`collective_sequence`) counted."""
    out: dict[str, int] = {}
    for name in collective_sequence(graph):
        out[name] = out.get(name, 0) + 1
    return out


def collective_sequence(graph: str | list[str] | None) -> list[str]:
    """Collective op names in the order a graph issues them (what ranks must agree on).

    ``graph``: the names already read from the ``GraphModule``
    (:func:`dynamo_ext.fx.collectives.collective_names`), or a printed FX graph,
    read by :func:`dynamo_ext.fx.collectives.names_in_text`.
    """
    if isinstance(graph, list):
        return list(graph)
    return fx_collectives.names_in_text(graph)


def _graph_collectives(gm: Any, text: str) -> list[str]:
    """The collective sequence of a logged graph: from its ``GraphModule`` when there is one, else its text."""
    if isinstance(gm, torch.fx.GraphModule):
        try:
            return fx_collectives.collective_names(gm)
        except Exception:  # a graph the reader cannot read: its text still names the collectives
            logging.getLogger(__name__).warning("collectives read from the graph's text", exc_info=True)
    return fx_collectives.names_in_text(text)


def _frames(summaries: Any) -> list[list[Any]]:
    return [[fs.filename, fs.lineno or 0, fs.name, (fs.line or "").strip()] for fs in summaries or ()]


def _collapse_resume(frames: list[list[Any]]) -> list[list[Any]]:
    """Name resume functions after their original function and drop the caller they stand in for."""
    out: list[list[Any]] = []
    for f in frames:
        m = _RESUME.match(f[2])
        if m:
            f = [f[0], f[1], m.group(1), f[3]]
            if out and out[-1][0] == f[0] and out[-1][2] == f[2]:
                out.pop()
        out.append(f)
    return out


def _stack_above_dynamo() -> list[list[Any]]:
    stack = traceback.extract_stack()
    out = []
    for fs in stack:
        if fs.filename.endswith(os.path.join("_dynamo", "convert_frame.py")):
            break
        if not fs.filename.startswith(_DROP_ABOVE):
            out.append(fs)
    return _frames(out)


def _phase(metadata: dict[str, Any] | None = None, compile_id: str = "") -> str:
    if compile_id.startswith("!") or (metadata or {}).get("compiled_autograd_id") is not None:
        return "backward"
    return "backward" if _compat.in_autograd_backward() else "forward"


def _compile_key(md: dict[str, Any]) -> str:
    ca = md.get("compiled_autograd_id")
    frame = f"{md.get('frame_id')}/{md.get('frame_compile_id')}"
    return frame if ca is None else f"!{ca}/{frame}"


class Collector(logging.Handler):
    """Collects one rank's breaks, graphs and recompiles as event dicts.

    ``sink(event)`` receives each event as it happens (the CLI writes them to a
    file so a rank that dies leaves what it saw); ``events`` keeps them too.
    Files in events are relative to ``root`` (the target's root, see
    :func:`.identity.normalize_path`; default: the working directory).
    """

    def __init__(self, sink: Callable[[dict[str, Any]], None] | None = None, *, root: str | None = None) -> None:
        super().__init__(level=logging.DEBUG)
        self.root = root
        self.events: list[dict[str, Any]] = []
        self._sink = sink
        self._graphs: dict[str, dict[str, list[str]]] = {}
        self._compiled: set[str] = set()  # compile ids whose compile event was recorded (and not reused since)
        self._lock_events = threading.Lock()
        self._saved_levels: list[tuple[logging.Logger, int]] = []
        self._break_excs: list[Any] = []
        self.comm = CommTracer(root=root)
        self.step: int | None = None  # the training step events are stamped with (NOTE [steps] in schema/events.py)

    # ---- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """Attach to the structured trace and enable graph-break logging (see NOTE [audit signals])."""
        trace = logging.getLogger(TRACE_LOGGER)
        trace.addHandler(self)
        self._saved_levels = [(trace, trace.level)]
        trace.setLevel(logging.DEBUG)
        for name in GRAPH_BREAK_LOGGERS:
            lg = logging.getLogger(name)
            self._saved_levels.append((lg, lg.level))
            if not lg.isEnabledFor(logging.DEBUG):
                lg.setLevel(logging.DEBUG)
                lg.addHandler(_QUIET)
                lg.propagate = False

    def stop(self) -> None:
        """Detach; restore logger levels."""
        logging.getLogger(TRACE_LOGGER).removeHandler(self)
        for lg, level in self._saved_levels:
            lg.setLevel(level)
            if _QUIET in lg.handlers:
                lg.removeHandler(_QUIET)
                lg.propagate = True
        self._saved_levels = []

    def dynamo_missed(self) -> int:
        """Graph breaks seen here that Dynamo's ``counters["graph_break"]`` did not count.

        Dynamo moves an ``Unsupported`` to the ``graph_break`` counter after logging
        it (``exc.category``); on 2.13 the data-dependent-branch path never does.
        Call after the compile finished.
        """
        return sum(1 for exc in self._break_excs if getattr(exc, "category", "graph_break") != "graph_break")

    def record(self, event: dict[str, Any]) -> None:
        """Keep ``event`` (stamped with :attr:`step`, if it is a compile's) and pass it to the sink."""
        event.setdefault("time", time.time())
        if self.step is not None and event.get("ev") in ("break", "compile", "fusion", "comm_graph"):
            event.setdefault("step", self.step)
        with self._lock_events:
            self.events.append(event)
            if self._sink is not None:
                self._sink(event)

    # ---- logging.Handler --------------------------------------------------------
    def emit(self, record: logging.LogRecord) -> None:
        md = getattr(record, "metadata", None)
        if not isinstance(md, dict) or not md:
            return
        name = next(iter(md))
        try:
            if name == "artifact" and md["artifact"].get("name") == "dynamo_graph_break_reason":
                self._on_break(md, getattr(record, "payload", "") or "")
            elif name == "artifact" and md["artifact"].get("name") == FUSION_ARTIFACT:
                self._on_fusion(md, getattr(record, "payload", "") or "")
            elif name == "dynamo_output_graph":
                gm, aot_id = _compat.graph_module_being_logged(name)
                text = getattr(record, "payload", "") or ""
                # a new Dynamo graph: its AOT graphs follow (several when its blocks are compiled one by one)
                self._graphs[_compile_key(md)] = {"dynamo": _graph_collectives(gm, text)}
                self._compiled.discard(_compile_key(md))  # ids repeat after torch._dynamo.reset()
                self._on_graph_module(name, md, gm, aot_id, "")
            elif name in ("aot_forward_graph", "aot_inference_graph", "aot_backward_graph"):
                gm, aot_id = _compat.graph_module_being_logged(name)
                text = getattr(record, "payload", "") or ""
                side = "backward" if name == "aot_backward_graph" else "forward"
                # NOTE [the audit compiles each block]: one AOT graph per block, in the order they run
                self._graphs.setdefault(_compile_key(md), {}).setdefault(side, []).extend(_graph_collectives(gm, text))
                self._on_graph_module(name, md, gm, aot_id, text)
            elif name == "compilation_metrics":
                self._on_metrics(md["compilation_metrics"])
        except Exception as e:  # never break the user's compile
            self.record({"ev": "internal", "message": f"audit collector failed on {name}: {type(e).__name__}: {e}"})

    # ---- events ---------------------------------------------------------------
    def _on_graph_module(self, name: str, md: dict[str, Any], gm: Any, aot_id: int | None, text: str) -> None:
        """The communication report's hook (NOTE [communication report] in :mod:`.comm`).

        ``gm``, ``aot_id``: what ``_compat.graph_module_being_logged(name)`` found
        (``None`` when only ``text`` was logged).  A failure of the analysis is a
        ``comm_graph`` event with ``missing`` set (the report says it is
        incomplete), not an audit error.
        """
        try:
            event = self.comm.on_graph(name, _compile_key(md), gm, aot_id, text)
        except Exception as e:
            logging.getLogger(__name__).warning("communication report: %s not analysed", name, exc_info=True)
            event = {
                "ev": "comm_graph",
                "compile_id": _compile_key(md),
                "graph": name,
                "aot_id": aot_id,
                "inlined_aot_ids": [],
                "collectives": [],
                "missing": f"{name}: analysis failed: {type(e).__name__}: {e}",
            }
        if event is not None:
            self.record(event)

    def _on_fusion(self, md: dict[str, Any], payload: str) -> None:
        """One applied fusion (the JSON payload of ``decisions.applied``), keyed by the compile id of its graph.

        A forward graph's fusions come before that frame's ``compile`` event, a
        lazily compiled backward's after it: ``after_compile`` says which (the
        merge attaches the fusion to the next, or the last, compile of that id).
        """
        p = json.loads(payload)
        cid = _compile_key(md) if md.get("frame_id") is not None else str(p.get("compile_id") or "")
        after = cid in self._compiled
        self.record(
            {
                "ev": "fusion",
                "compile_id": cid,
                "fusion": str(p["fusion"]),
                "kernel": str(p.get("kernel") or ""),
                "group_name": str(p.get("group_name") or ""),
                "nbytes": int(p.get("nbytes") or 0),
                "node": str(p.get("node") or ""),
                "phase": "backward" if after else _phase(md, cid),
                "after_compile": after,
            }
        )

    def _on_break(self, md: dict[str, Any], payload: str) -> None:
        # Not sys.exc_info(): on 2.13 a data-dependent branch is logged outside any except.
        exc = _compat.graph_break_being_logged()
        skipped = payload.startswith(_SKIP_PREFIX) or bool(getattr(exc, "skip_frame", False))
        kind = "frame_skip" if skipped else "graph_break"
        if kind == "graph_break":
            self._break_excs.append(exc)
        # A wrapper such as "graph break in loop" is raised `from` the break that
        # caused it: the identity and the fix belong to the innermost cause.
        wrapper = getattr(exc, "gb_type", None) or ""
        cause = exc
        while isinstance(inner := getattr(cause, "__cause__", None), Exception) and getattr(inner, "gb_type", None):
            cause = inner
        msg = getattr(cause, "msg", None) or (str(cause) if cause is not None else payload)
        # unimplemented(from_exc=<Unsupported>) keeps the cause only as the head of the message.
        msg, _, _ = msg.partition("\n\n*** While handling this graph break, another graph break occurred")
        first, explanation, hints, context = parse_message(msg)
        gb_type = (first if cause is exc and wrapper and first != wrapper else None) or getattr(cause, "gb_type", None)
        gb_type = gb_type or first or type(exc).__name__
        wrapper = wrapper if wrapper and wrapper != gb_type else ""
        real = getattr(cause, "real_stack", None) or getattr(exc, "real_stack", None)
        stack = _collapse_resume(_stack_above_dynamo() + _frames(real))
        if not stack:
            m = re.search(r"in user code at (.+):(\d+)", payload)
            stack = [[m.group(1), int(m.group(2)), "<unknown>", ""]] if m else [["<unknown>", 0, "<unknown>", ""]]
        files = [f[0] for f in stack]
        idx = user_frame_index(files)
        abs_file = os.path.abspath(stack[idx][0]) if not stack[idx][0].startswith("<") else stack[idx][0]
        self.record(
            {
                "ev": "break",
                "kind": kind,
                "gb_type": gb_type,
                "wrapper": wrapper,
                "reason": first,
                "explanation": explanation,
                "hints": list(hints),
                "context": context,
                "stack": [[normalize_path(f[0], root=self.root), f[1], f[2], f[3]] for f in stack],
                "user_index": idx,
                "abs_file": abs_file,
                "distributed": is_distributed_cause(gb_type, files, f"{msg}\n{context}"),
                "phase": _phase(md),
                "compile_id": _compile_key(md),
            }
        )

    def _on_metrics(self, m: dict[str, Any]) -> None:
        cid = str(m.get("compile_id") or "")
        graphs = self._graphs.pop(cid, {})
        self._compiled.add(cid)
        if str(m.get("fail_reason") or "").startswith(RECOMPILE_LIMIT_GB_TYPE):
            self._on_recompile_limit(m, cid)
        has_graph = "dynamo" in graphs or bool(m.get("graph_op_count"))
        # AOTAutograd's forward (or inference) graph is what runs; Dynamo's graph when there is none (backend="eager").
        forward = graphs["forward"] if "forward" in graphs else graphs.get("dynamo")
        self.record(
            {
                "ev": "compile",
                "compile_id": cid,
                "function": _RESUME.sub(r"\1", str(m.get("co_name") or "")),
                "code_name": str(m.get("co_name") or ""),
                "file": normalize_path(str(m.get("co_filename") or ""), root=self.root),
                "line": int(m.get("co_firstlineno") or 0),
                "op_count": int(m.get("graph_op_count") or 0),
                "has_graph": has_graph,
                "collectives": collectives_in(forward),
                "backward_collectives": collectives_in(graphs.get("backward")),
                "collective_sequence": collective_sequence(forward),
                "backward_collective_sequence": collective_sequence(graphs.get("backward")),
                "time_s": float(m.get("entire_frame_compile_time_s") or 0.0),
                "recompile_reason": m.get("recompile_reason"),
                "fail_type": m.get("fail_type"),
                "fail_reason": m.get("fail_reason"),
                "phase": _phase(None, cid),
            }
        )

    def _on_recompile_limit(self, m: dict[str, Any], cid: str) -> None:
        """Dynamo gave up compiling a frame (it runs eagerly from now on): a frame skip at the guarded line.

        Dynamo logs no graph-break artifact for it, only ``compilation_metrics``
        with ``fail_reason``; the user line is the last frame of the failed
        guard's "User stack trace" (the line whose value keeps changing), else
        the first line of the code object.
        """
        msg = str(m.get("fail_reason") or "")
        first, explanation, hints, context = parse_message(msg)
        reason = _CID_PREFIX.sub("", str(m.get("recompile_reason") or "")).strip()
        frames = [[f, int(n), fn, ""] for f, n, fn in _USER_FRAME.findall(reason)]
        if not frames and m.get("co_filename"):
            frames = [[str(m["co_filename"]), int(m.get("co_firstlineno") or 0), str(m.get("co_name") or ""), ""]]
        frames = frames or [["<unknown>", 0, "<unknown>", ""]]
        for f in frames:
            if not f[0].startswith("<"):
                import linecache

                f[3] = linecache.getline(f[0], f[1]).strip()
        files = [f[0] for f in frames]
        idx = user_frame_index(files)
        self.record(
            {
                "ev": "break",
                "kind": "frame_skip",
                "gb_type": first or RECOMPILE_LIMIT_GB_TYPE,
                "wrapper": "",
                "reason": (reason.splitlines() or [first])[0].split("#")[0].strip(),
                "explanation": explanation,
                "hints": list(hints),
                "context": context,
                "stack": [[normalize_path(f[0], root=self.root), f[1], _RESUME.sub(r"\1", f[2]), f[3]] for f in frames],
                "user_index": idx,
                "abs_file": frames[idx][0],
                "distributed": is_distributed_cause(first, files, f"{msg}\n{reason}"),
                "phase": _phase(None, cid),
                "compile_id": cid,
            }
        )


_QUIET = logging.NullHandler()  # swallows the graph-break log lines enabled only to get Dynamo to emit skips


def dynamo_counters() -> dict[str, int]:
    """The totals of ``torch._dynamo.utils.counters`` the audit cross-checks against."""
    counters = _compat.dynamo_counters()
    return {
        "graph_break": int(sum(counters["graph_break"].values())),
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "calls_captured": int(counters["stats"].get("calls_captured", 0)),
    }


class JsonlSink:
    """Appends events to a file, one JSON object per line, flushed each time."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115  (closed in close())

    def __call__(self, event: dict[str, Any]) -> None:
        self._f.write(json.dumps(event, default=str) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
