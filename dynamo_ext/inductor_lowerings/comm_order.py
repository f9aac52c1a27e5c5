"""Communication kept in program order under every Inductor scheduling pass: ordering dependencies.

NOTE [communication order under Inductor's passes]
Inductor's scheduler reorders nodes after our post-grad passes: the peak-memory
reordering and fusion (every release), ``simple_overlap`` (on by default since
2.14: ``torch._inductor.config.aten_distributed_optimizations.enable_simple_overlap``),
``reorder_for_compute_comm_overlap`` and the FX-level overlap scheduling and
bucketing passes (on request).  They keep data dependencies, and
``simple_overlap`` keeps the order of the collectives it recognises
(``ir._CollectiveKernel``) among themselves, but nothing orders a collective
against communication that lowers as a plain fallback kernel:
``dynamo_ext::bucketed_collective`` (a bucket, which issues and waits inside)
is one, so ``simple_overlap`` hoists a later ``isend`` or all-reduce above it
(pytorch#189454: ranks that issue their communication in different orders
wait for each other forever), and the memory reordering may put a bucket
between a ``recv`` and a ``send`` on one rank and after both on another.

So in a graph that holds such an op, or a point-to-point op (whose peers pair
sends and receives by their order), :func:`keep_communication_order` adds
ordering-only dependencies with Inductor's own ``control_deps`` higher-order op
(``preserve_node_ordering``, what its overlap scheduling inserts to hold its
order), which the scheduler records as dependencies every pass keeps:

* each communication op (NOTE [communication ops]) after the one before it in
  the graph: every rank issues its communication in its program's order;
* each wait after the last communication op before it: a wait never moves
  earlier than the program put it (a ``recv`` waited before the ``send`` that
  followed it would hang a symmetric exchange).

Dependencies that the data flow already implies are not added.  The passes
keep every freedom that cannot change what a peer sees: collectives still move
earlier across compute and across the waits of earlier collectives, and waits
later.  Graphs without such ops (stock collectives only) are left to Inductor.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx

from .. import _compat
from ..fx import collectives as fx_collectives
from . import options
from .registry import package_sources

log = logging.getLogger(__name__)

__all__ = ["CommunicationOrderPass", "keep_communication_order", "needs_ordering", "ordering_dependencies"]


def _fallback_communication(node: torch.fx.Node) -> bool:
    """Communication Inductor does not lower as a collective it recognises: our bucket, symmetric-memory ops."""
    if not fx_collectives.is_communication(node) or fx_collectives.is_collective(node):
        return False
    schema = _compat.op_schema(node.target)
    return schema is None or schema.name != "dynamo_ext::one_shot_all_reduce_residual_rms_norm"  # a collective kernel


def needs_ordering(graph: torch.fx.Graph) -> str | None:
    """Why ``graph`` needs ordering dependencies (NOTE [communication order under Inductor's passes]), or None."""
    for node in graph.nodes:
        if fx_collectives.is_point_to_point(node):
            return f"point-to-point op {node.name}"
        if _fallback_communication(node):
            return f"communication op {node.name} that Inductor schedules as a plain kernel"
    return None


def _ancestor(node: torch.fx.Node, dep: torch.fx.Node, pos: dict[torch.fx.Node, int]) -> bool:
    """Whether ``dep`` reaches ``node`` through the data flow (walks back no further than ``dep``'s position)."""
    stack, seen = [node], {node}
    while stack:
        for a in stack.pop().all_input_nodes:
            if a is dep:
                return True
            if a not in seen and pos[a] > pos[dep]:
                seen.add(a)
                stack.append(a)
    return False


def _wrappable(node: torch.fx.Node) -> bool:
    """An op overload call ``control_deps`` can wrap (not a higher-order op with a body)."""
    return _compat.op_schema(node.target) is not None


_WRITES_ITS_INPUT = frozenset({"irecv", "recv_", "recv_any_source_", "batch_p2p_ops"})


def _writes_its_input(node: torch.fx.Node) -> bool:
    """A receive: Inductor lowers it to write into its input and return that buffer."""
    schema = _compat.op_schema(node.target)
    return schema is not None and schema.name.partition("::")[2] in _WRITES_ITS_INPUT


def ordering_dependencies(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """``{node: [dependency]}``: the ordering dependencies the data flow does not imply, in graph order.

    NOTE [communication order under Inductor's passes].  A receive that another
    op is ordered after is wrapped too (on its own input where it needs nothing
    else): it writes into its input and returns it, and ``control_deps`` orders
    after the op itself only for the ops it wraps, after the buffer otherwise.
    """
    pos = {n: i for i, n in enumerate(graph.nodes)}
    deps: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    last: torch.fx.Node | None = None
    for node in graph.nodes:
        communicates = fx_collectives.is_communication(node)
        if not communicates and not fx_collectives.is_wait(node):
            continue
        if last is not None and not _ancestor(node, last, pos):
            if _wrappable(node):
                deps[node] = [last]
            else:
                log.debug("%s holds communication in its body: not ordered after %s", node.name, last.name)
            if _writes_its_input(last) and last not in deps and last.all_input_nodes:
                deps[last] = [last.all_input_nodes[0]]
        if communicates:
            last = node
    return dict(sorted(deps.items(), key=lambda item: pos[item[0]]))


def keep_communication_order(graph: torch.fx.Graph) -> int:
    """Add the ordering dependencies where ``graph`` needs them; return how many nodes now carry them.

    NOTE [communication order under Inductor's passes].  Logged at INFO with the
    reason (the first op that needs it); where this Inductor has no
    ``control_deps``, a WARNING says the order is not guaranteed.
    """
    if not options.keep_communication_order:
        return 0
    reason = needs_ordering(graph)
    if reason is None:
        return 0
    preserve = _compat.preserve_node_ordering()
    if preserve is None:
        log.warning(
            "this Inductor has no control_deps (torch._inductor.fx_passes.control_dependencies); the graph holds %s "
            "and its communication order under Inductor's scheduling passes is not guaranteed",
            reason,
        )
        return 0
    deps = ordering_dependencies(graph)
    if not deps:
        return 0
    preserve(graph, deps)
    graph.lint()
    log.info(
        "communication kept in program order: %d ordering dependencies (the graph holds %s; simple_overlap %s)",
        len(deps),
        reason,
        {None: "absent", True: "on", False: "off"}[_compat.simple_overlap_enabled()],
    )
    return len(deps)


class CommunicationOrderPass(_compat.custom_graph_pass_base()):  # type: ignore[misc]
    """Post-grad pass adding the ordering dependencies (NOTE [communication order under Inductor's passes])."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        keep_communication_order(graph)

    def uuid(self) -> Any:
        return _compat.hash_for_files(  # NOTE [pass identity covers the lowerings]
            package_sources(), extra=options.get_hash().hex()
        )
