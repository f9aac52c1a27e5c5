"""The communication report, rank side: every collective of every compiled graph, with what it moves and why.

NOTE [communication report]
The collector (:mod:`.collector`) hands this module the FX graphs Dynamo and
AOTAutograd log on the structured trace (``dynamo_output_graph``,
``aot_forward_graph``, ``aot_backward_graph``, ``aot_inference_graph``), as
``GraphModule`` objects with their node meta (``_compat.graph_module_being_logged``;
nothing is recompiled and no backend is wrapped).  For each AOT graph, the graph
that runs, every functional collective (``_c10d_functional.*``) becomes one
record:

- op, process group (name, size, ranks) and the mesh axis name of that group,
  read from the ``DeviceMesh`` of any DTensor the rank's Dynamo graphs hold;
- bytes in and out (``meta["val"]``), and bytes each rank sends and receives
  under the ring algorithm (all-gather: ``(n-1)*in``; reduce-scatter and
  all-to-all: ``(n-1)/n*in``; all-reduce: ``2(n-1)/n*in``; broadcast: ``in``;
  point-to-point: the tensors sent and received);
- the time ``torch._inductor.comm_analysis`` estimates for it on NCCL (its
  analytical model; bandwidths from ``DYNAMO_EXT_AUDIT_INTRA_NODE_BW`` /
  ``DYNAMO_EXT_AUDIT_INTER_NODE_BW`` in GB/s, else its defaults; ``None`` for
  what it does not model, such as broadcast);
- ``overlap_ops``: compute ops between the collective and its ``wait_tensor``
  in graph order (0: nothing can overlap it);
- the user line (the deepest frame of ``meta["stack_trace"]`` outside torch and
  dynamo-ext), the module path (``nn_module_stack``; for backward nodes
  AOTAutograd's ``fwd_nn_module_stack``, else the forward node with the same
  stack) and who issued it: ``fsdp`` (FSDP2's all-gather / reduce-scatter),
  ``dtensor`` (DTensor inserted it: sharding propagation, ``redistribute``,
  ``from_local``'s backward), ``explicit`` (a collective the user called);
- for ``dtensor`` collectives, the placements before and after (from the
  Dynamo graph's ``redistribute`` node with the same stack when there is one,
  else implied by the collective on that mesh axis) and an alternative
  placement that avoids or shrinks it; the alternative is a heuristic
  (``alternative_basis``), never checked by re-running sharding propagation.

Compiled autograd's graph is traced again by Dynamo and AOTAutograd (compile
ids ``!N/...``); its AOT graph carries no stack traces, so its collectives take
their attribution from its Dynamo graph's collectives, zipped in order when the
two sequences agree.  When compiled autograd inlines an AOT backward
(``aotN_`` node names), that AOT backward graph never runs by itself:
``inlined_aot_ids`` lets the merge leave it out of the totals.
"""

from __future__ import annotations

import logging
import operator
import os
import re
from typing import Any

import torch

from ... import _compat
from ...fx import collectives as fx_collectives
from ...fx.collectives import TRAFFIC, FxCollective, tensor_dtype, tensor_shape
from ...fx.nodes import example_value, tensor_bytes
from ...node_origin import stack_frames, user_frame
from ...variables.fsdp import sources as fsdp_sources
from .identity import normalize_path
from .module_names import fully_qualified_names, without_closures
from .placements import alternative, implied_placements

log = logging.getLogger(__name__)

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
# The plugin's traced FSDP2 hooks (``variables/fsdp/``) issue FSDP2's collectives in a compiled graph.
_PLUGIN_FSDP_DIR = os.path.join(_PKG_DIR, "variables", "fsdp") + os.sep
_INLINED = re.compile(r"^aot(\d+)_")
_ROOT_KEY = re.compile(r"^L\['[^']*'\]\.?")
# Dynamo spells a submodule it reached through ``__getattr__``'s dict lookup as ``.__dict__['_modules']['name']``.
_MODULES_DICT = re.compile(r"\.?__dict__\['_modules'\]\['([^']*)'\]")
# torch's checkpoint_wrapper holds the wrapped module under this name; its state_dict FQNs drop it, and so do we.
_CHECKPOINT_WRAPPED = "._checkpoint_wrapped_module"

# TRAFFIC (functional collective -> traffic kind) lives with the reader; the merge reads it from here.
__all__ = ["TRAFFIC", "CommTracer", "module_path", "origin", "p2p_bytes", "traffic_bytes"]
INTRA_BW_ENV = "DYNAMO_EXT_AUDIT_INTRA_NODE_BW"
INTER_BW_ENV = "DYNAMO_EXT_AUDIT_INTER_NODE_BW"


def traffic_bytes(kind: str, bytes_in: int, group_size: int) -> tuple[int, int]:
    """(sent, received) bytes per rank of a ring collective moving ``bytes_in`` input bytes per rank."""
    n = max(group_size, 1)
    if n == 1:
        return 0, 0
    if kind == "all_gather":
        b = (n - 1) * bytes_in
    elif kind in ("reduce_scatter", "all_to_all"):
        b = (n - 1) * bytes_in // n
    elif kind == "all_reduce":
        b = 2 * (n - 1) * bytes_in // n
    else:  # broadcast: each rank receives (and but one forward) the whole buffer
        b = bytes_in
    return b, b


def p2p_bytes(coll: FxCollective) -> tuple[int, int]:
    """(sent, received) bytes of a point-to-point op: ``isend``, ``irecv``, ``batch_p2p_ops`` (by its op list)."""
    if coll.name == "isend":
        return coll.bytes_in, 0
    if coll.name == "irecv":
        return 0, coll.bytes_out
    ops, tensors = coll.node.args[0], coll.node.args[3]
    assert isinstance(ops, (list, tuple)) and isinstance(tensors, (list, tuple)), coll.node.format_node()
    sent = sum(tensor_bytes(example_value(t)) for op, t in zip(ops, tensors) if "send" in str(op))
    return sent, sum(tensor_bytes(example_value(t)) for op, t in zip(ops, tensors) if "recv" in str(op))


def origin(stack_trace: str | None) -> str:
    """``fsdp``, ``dtensor`` or ``explicit``: who put the collective there, by the frames of its stack.

    :class:`CommTracer` also calls it ``dtensor`` when its line makes a DTensor in a Dynamo graph.
    """
    files = [f for f, *_ in stack_frames(stack_trace)]
    if any(os.sep + os.path.join("distributed", "fsdp") + os.sep in f for f in files) or any(
        f.startswith(_PLUGIN_FSDP_DIR) or (f.startswith(_PKG_DIR) and f.endswith("fsdp.py")) for f in files
    ):
        return "fsdp"
    if any(os.sep + os.path.join("distributed", "tensor") + os.sep in f for f in files):
        return "dtensor"
    return "explicit"


def module_path(node: torch.fx.Node, names: dict[str, str] | None = None) -> str | None:
    """The innermost module of ``nn_module_stack`` (or AOT's ``fwd_nn_module_stack``), root-relative; ``None``.

    ``names``: Dynamo's paths named by identity (NOTE [module names by identity] in :mod:`.module_names`);
    a path not there is read as it is spelled.
    """
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    raw = str(list(stack.values())[-1][0])
    if names and raw in names:
        return names[raw]
    # A module the traced FSDP2 hooks reached first (NOTE [modules reached through an FSDP2 state]).
    resolved = fsdp_sources.module_path_through_state(raw)
    path = _MODULES_DICT.sub(r".\1", resolved if resolved is not None else _ROOT_KEY.sub("", raw))
    return without_closures(path.replace(_CHECKPOINT_WRAPPED, "")).lstrip(".") or "<root>"


def _placements(val: Any) -> str:
    pl = getattr(val, "placements", None)
    return "(" + ", ".join(map(str, pl)) + ")" if pl is not None else ""


class CommTracer:
    """Per-rank state of the communication report: the mesh axis of each group, Dynamo graphs awaiting their AOT graph.

    :meth:`on_graph` is called by the collector for each logged graph and returns
    the ``comm_graph`` event of an AOT graph (``None`` for a Dynamo graph, which
    it only remembers).  ``root`` as in :class:`.collector.Collector`.
    """

    def __init__(self, root: str | None = None) -> None:
        self.root = root
        self.group_axis: dict[str, str] = {}
        self._dynamo: dict[str, torch.fx.GraphModule] = {}
        self._module_of_stack: dict[str, str] = {}
        self._meshes_seen: set[int] = set()
        self._dtensor_stacks: set[str] = set()
        self._aot_backward: dict[int, dict[str, torch.fx.Node]] = {}
        # NOTE [module names by identity]: Dynamo's module paths -> names, per compile and of every compile
        self.root_module: torch.nn.Module | None = None
        self._names_of: dict[str, dict[str, str]] = {}
        self._names: dict[str, str] = {}

    def on_graph(
        self, trace_name: str, compile_key: str, gm: Any, aot_id: int | None, text: str = ""
    ) -> dict[str, Any] | None:
        """Remember a Dynamo graph, or analyse an AOT graph into a ``comm_graph`` event.

        An AOT graph logged without its ``GraphModule`` (a cache hit logs only
        text) whose text ``text`` names collectives gives an event with
        ``missing`` set: the report says it is incomplete.
        """
        if not isinstance(gm, torch.fx.GraphModule):
            if trace_name != "dynamo_output_graph" and fx_collectives.names_in_text(text):
                return {
                    "ev": "comm_graph",
                    "compile_id": compile_key,
                    "graph": _graph_kind(trace_name, compile_key),
                    "aot_id": aot_id,
                    "inlined_aot_ids": [],
                    "collectives": [],
                    "missing": f"{trace_name} logged without its graph (a cache hit?): its collectives are not analysed",
                }
            return None
        if trace_name == "dynamo_output_graph":
            self._learn(gm, compile_key)
            # Compiles are sequential: a frame's AOT graphs follow its Dynamo graph; keep only the latest.
            self._dynamo = {compile_key: gm}
            return None
        if trace_name == "aot_backward_graph" and aot_id is not None:
            self._aot_backward[aot_id] = {n.name: n for n in gm.graph.nodes}
        ca = compile_key.startswith("!")
        graph = _graph_kind(trace_name, compile_key)
        dynamo_gm = self._dynamo.get(compile_key)
        names = {**self._names, **self._names_of.get(compile_key, {})}
        colls = self.analyse(
            gm, phase="backward" if graph != "forward" else "forward", dynamo_gm=dynamo_gm, names=names
        )
        inlined = sorted(
            {
                int(m.group(1))
                for n in (dynamo_gm.graph.nodes if ca and dynamo_gm is not None else ())
                if (m := _INLINED.match(n.name))
            }
        )
        return {
            "ev": "comm_graph",
            "compile_id": compile_key,
            "graph": graph,
            "aot_id": aot_id,
            "inlined_aot_ids": inlined,
            "collectives": colls,
        }

    def _learn(self, gm: torch.fx.GraphModule, compile_key: str = "") -> None:
        """Mesh axis names of the groups of every DTensor in ``gm`` and of every mesh a compiled frame used
        (``variables.device_mesh.traced_meshes``: a collective on ``mesh.get_group()`` with no DTensor of that
        mesh in the graph); the names of its modules (NOTE [module names by identity]); module paths of its
        stack traces."""
        from ...variables.device_mesh import traced_meshes

        scopes = _compat.frame_being_compiled()
        if scopes is not None:
            paths = {
                str(v[0])
                for n in gm.graph.nodes
                for v in (n.meta.get("nn_module_stack") or {}).values()
                if isinstance(v, tuple) and v
            }
            names = fully_qualified_names(sorted(paths), *scopes, root=self.root_module)
            self._names_of[compile_key] = names
            for raw, name in names.items():
                self._names.setdefault(raw, name)

        for mesh in traced_meshes():
            if id(mesh) not in self._meshes_seen:
                self._meshes_seen.add(id(mesh))
                self._learn_mesh(mesh)
        for n in gm.graph.nodes:
            val = n.meta.get("example_value")
            mesh = getattr(val, "device_mesh", None)
            if mesh is not None and id(mesh) not in self._meshes_seen:
                self._meshes_seen.add(id(mesh))
                self._learn_mesh(mesh)
            st, mod = n.meta.get("stack_trace"), module_path(n, self._names_of.get(compile_key))
            if st and mesh is not None:
                self._dtensor_stacks.add(st)
            if st and mod:
                # One stack, several modules (a loop over blocks): the common path, "*" where they differ.
                self._module_of_stack[st] = _common_path(self._module_of_stack.get(st, mod), mod)

    def _learn_mesh(self, mesh: Any) -> None:
        for m in (mesh, _compat.root_mesh(mesh)):
            names = getattr(m, "mesh_dim_names", None) or ()
            for i, name in enumerate(names):
                try:
                    self.group_axis.setdefault(m.get_group(i).group_name, name)
                except Exception:  # a mesh without that group here: nothing to learn
                    log.debug("no group for mesh axis %s of %s", name, m)

    def _backward_source(self, node: torch.fx.Node) -> torch.fx.Node:
        """The AOT backward graph's node that compiled autograd copied as ``aot<N>_<name>`` (it has the meta), else ``node``."""
        m = _INLINED.match(node.name)
        found = self._aot_backward.get(int(m.group(1)), {}).get(node.name[m.end() :]) if m else None
        return found if found is not None and found.meta.get("stack_trace") else node

    def analyse(
        self,
        gm: torch.fx.GraphModule,
        *,
        phase: str,
        dynamo_gm: torch.fx.GraphModule | None = None,
        names: dict[str, str] | None = None,
    ) -> list:
        """One record per collective of ``gm`` in graph order (see NOTE [communication report]); ``names``:
        Dynamo's module paths named by identity (:func:`module_path`)."""
        nodes = list(gm.graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        donors = _attribution_donors(gm, dynamo_gm)
        redistributes = _redistributes(dynamo_gm)
        out = []
        for coll in fx_collectives.iter_collectives(gm):  # NOTE [one collective reader]
            kind = coll.kind
            if kind is None:
                continue
            n, op, group = coll.node, coll.name, coll.group
            meta_node = self._backward_source(donors.get(n, n))
            ranks = list(coll.ranks)
            size = len(ranks)
            bytes_in, bytes_out = coll.bytes_in, coll.bytes_out
            sent, received = p2p_bytes(coll) if kind == "p2p" else traffic_bytes(kind, bytes_in, size)
            est = _compat.estimate_collective_ms(
                n, intra_bw=_env_float(INTRA_BW_ENV), inter_bw=_env_float(INTER_BW_ENV)
            )
            if est == 0 and size > 1 and bytes_in + bytes_out > 0:
                est = None  # comm_analysis does not model this kind (it returns 0)
            st = meta_node.meta.get("stack_trace") or ""
            frame = user_frame(st)
            who = origin(st) if st else "unknown"
            if who == "explicit" and st in self._dtensor_stacks:
                who = "dtensor"  # a DTensor op or redistribute on that line (Dynamo traced DTensor's own code)
            before, after, basis = "", "", ""
            if who == "dtensor":
                if st in redistributes:
                    before, after = redistributes[st]
                    basis = "graph"
                else:
                    before, after = implied_placements(kind)
                    basis = "implied by the collective"
            mod = module_path(meta_node, names) or self._module_of_stack.get(st) or ""
            out.append(
                {
                    "index": len(out),
                    "node": n.name,
                    "op": op,
                    "kind": kind,
                    "group": group,
                    "group_size": size,
                    "group_ranks": ranks,
                    "mesh_axis": self.group_axis.get(group, ""),
                    "dtype": tensor_dtype(coll.output),
                    "shape_in": tensor_shape(coll.input),
                    "shape_out": tensor_shape(coll.output),
                    "bytes_in": bytes_in,
                    "bytes_out": bytes_out,
                    "sent": sent,
                    "received": received,
                    "est_ms": est,
                    "overlap_ops": _overlap_ops(coll, nodes, position),
                    "file": normalize_path(frame[0], root=self.root) if frame else "",
                    "line": frame[1] if frame else 0,
                    "function": frame[2] if frame else "",
                    "source": frame[3] if frame else "",
                    "module": mod,
                    "origin": who,
                    "placements_before": before,
                    "placements_after": after,
                    "placements_basis": basis,
                    "alternative": alternative(kind, phase, st) if who == "dtensor" else "",
                    "alternative_basis": "heuristic" if who == "dtensor" else "",
                }
            )
        return out


def _graph_kind(trace_name: str, compile_key: str) -> str:
    if compile_key.startswith("!"):
        return "compiled_autograd"
    return "backward" if trace_name == "aot_backward_graph" else "forward"


def _common_path(a: str, b: str) -> str:
    """``layers.0.wq`` and ``layers.1.wq`` -> ``layers.*.wq``; different depths -> their common prefix."""
    if a == b:
        return a
    pa, pb = a.split("."), b.split(".")
    if len(pa) != len(pb):
        common = []
        for x, y in zip(pa, pb):
            if x != y:
                break
            common.append(x)
        return ".".join(common) + ".*" if common else "*"
    return ".".join(x if x == y else "*" for x, y in zip(pa, pb))


def _env_float(name: str) -> float | None:
    v = os.environ.get(name)
    try:
        return float(v) if v else None
    except ValueError:
        log.warning("%s=%r is not a number (GB/s); using comm_analysis's default", name, v)
        return None


def _overlap_ops(coll: FxCollective, nodes: list, position: dict) -> int | None:
    """Compute ops between a collective and the first wait of its result, in graph order; ``None``: no wait."""
    waits = coll.waits
    if not waits:
        return None
    end = min(position[w] for w in waits)
    return sum(
        1
        for m in nodes[position[coll.node] + 1 : end]
        if m.op == "call_function"
        and not fx_collectives.is_collective(m)
        and not fx_collectives.is_wait(m)
        and m.target is not operator.getitem
    )


def _attribution_donors(gm: torch.fx.GraphModule, dynamo_gm: torch.fx.GraphModule | None) -> dict:
    """Collectives of ``gm`` without a stack trace -> the Dynamo graph's collective in the same place.

    Only when both graphs issue the same ops on the same groups in the same
    order (compiled autograd's AOT graph retraces its Dynamo graph); else nothing.
    """
    if dynamo_gm is None:
        return {}
    mine = [c for c in fx_collectives.iter_collectives(gm) if c.kind]
    if all(c.stack_trace for c in mine):
        return {}
    theirs = [c for c in fx_collectives.iter_collectives(dynamo_gm) if c.kind]
    if [(c.name, c.group) for c in mine] != [(c.name, c.group) for c in theirs]:
        log.debug("AOT and Dynamo collectives differ; no attribution for this graph")
        return {}
    return {a.node: b.node for a, b in zip(mine, theirs)}


def _redistributes(dynamo_gm: torch.fx.GraphModule | None) -> dict[str, tuple[str, str]]:
    """Stack trace -> (placements before, after) of each ``redistribute`` call in a Dynamo graph."""
    out: dict[str, tuple[str, str]] = {}
    for n in dynamo_gm.graph.nodes if dynamo_gm is not None else ():
        if n.op == "call_method" and n.target == "redistribute" and n.args:
            src = n.args[0].meta.get("example_value") if isinstance(n.args[0], torch.fx.Node) else None
            st = n.meta.get("stack_trace")
            if st:
                out.setdefault(st, (_placements(src), _placements(n.meta.get("example_value"))))
    return out
