"""The collectives of an FX graph: which nodes they are, on which group, moving what, waited where, from which line.

NOTE [one collective reader]
Every module that looks for collectives in a compiled graph reads them here:
the bucketing pass (``inductor_lowerings/bucketing.py``), the collective
check's fingerprint (``collective_check/fingerprint.py``), the audit's
communication report (``audit/comm.py``) and the audit's per-compile collective
sequence (``audit/collector.py``).  So a node the check compares is the node
the report lists and the pass merges, with the same group and the same user line.

A *collective* is a ``call_function`` node calling an op (an overload, or
the packet Dynamo's graphs call) of the c10d namespaces (:data:`NAMESPACES`) that is not a wait (:data:`WAITS`).  Point-to-
point ops (:data:`POINT_TO_POINT`) are collectives here; readers that compare
ranks leave them out (their peers differ per rank by design).  Its arguments
are bound to the op's schema, so readers find them by name whatever the
positional layout (``group_name`` is last for every functional collective, but
the legacy ops name their group ``tag``).

The text of a graph (all a ``TORCH_TRACE`` log or an AOT cache hit keeps) is
read by :func:`names_in_text`, the one place a graph is read as text.

NOTE [communication ops]
What a pass that moves nodes must keep in the order the program issues them
(:func:`is_communication`) is wider than what the readers above compare: every
collective and point-to-point op of the c10d namespaces, our own ops that
communicate (:data:`PLUGIN_COMMUNICATION_OPS`: a bucket, the fused all-reduce
kernels), the symmetric-memory ops (cross-rank barriers and copies, namespace
``symm_mem``) and a higher-order op whose body holds any of these.  A barrier
(``dist.barrier()`` traces to an all-reduce of a one-element zero tensor,
NOTE [barrier in a graph]) is one of them; :func:`is_barrier` tells it apart
from an all-reduce of data by where it was traced (the same on every rank),
and the bucketing pass leaves it alone.
Waits are not communication ops: moving a wait later never changes what a
peer sees.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from .. import _compat
from ..node_origin import group_name, stack_frames, user_frame
from .nodes import example_value, tensor_bytes

__all__ = [
    "BARRIER_POLYFILL",
    "COMMUNICATION_NAMESPACES",
    "NAMESPACES",
    "PLUGIN_COMMUNICATION_OPS",
    "POINT_TO_POINT",
    "TRAFFIC",
    "WAITS",
    "FxCollective",
    "collective_names",
    "communication_between",
    "is_barrier",
    "is_collective",
    "is_communication",
    "is_point_to_point",
    "is_wait",
    "iter_collectives",
    "names_in_text",
    "read",
    "tensor_dtype",
    "tensor_shape",
]

NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d"})
WAITS = frozenset({"wait_tensor", "wait"})
POINT_TO_POINT = frozenset({"isend", "irecv", "batch_p2p_ops", "send", "recv_", "recv_any_source_"})
# NOTE [communication ops]: this package's own ops that communicate (``dynamo_ext/inductor_lowerings``), by schema
# name, and the namespaces whose every op does.
PLUGIN_COMMUNICATION_OPS = frozenset(
    {"dynamo_ext::bucketed_collective", "dynamo_ext::one_shot_all_reduce_residual_rms_norm"}
)
COMMUNICATION_NAMESPACES = frozenset({"symm_mem"})

# Functional collective (op name without overload) -> traffic kind (what a ring algorithm moves for it).
TRAFFIC = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "isend": "p2p",
    "irecv": "p2p",
    "batch_p2p_ops": "p2p",
}

# Argument names, by role, across the functional, legacy functional and c10d schemas.
_GROUP_ARGS = ("group_name", "group", "process_group")
_LEGACY_GROUP_ARG = "tag"
_REDUCE_ARGS = frozenset({"reduce_op", "reduceOp", "op"})


def _schema(node: torch.fx.Node) -> Any:
    """The schema of the op ``node`` calls: an overload's (AOTAutograd's and Inductor's graphs), or a packet's
    ``default`` overload's (Dynamo's graphs call ``torch.ops._c10d_functional.all_reduce``); ``None`` otherwise."""
    if node.op != "call_function":
        return None
    schema = _compat.op_schema(node.target)
    if schema is None:
        schema = _compat.op_schema(getattr(node.target, "default", None))
    return schema


def _op_name(node: torch.fx.Node) -> tuple[str, str] | None:
    """``(namespace, name)`` of the c10d op ``node`` calls, ``None`` for any other node."""
    schema = _schema(node)
    if schema is None:
        return None
    namespace, _, name = schema.name.partition("::")
    return (namespace, name) if namespace in NAMESPACES else None


def is_wait(node: torch.fx.Node) -> bool:
    """Whether ``node`` waits for a collective (``_c10d_functional.wait_tensor``, ``c10d.wait``)."""
    found = _op_name(node)
    return found is not None and found[1] in WAITS


def is_collective(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a collective (NOTE [one collective reader]); waits are not, point-to-point ops are."""
    found = _op_name(node)
    return found is not None and found[1] not in WAITS


def is_point_to_point(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a point-to-point op (``isend``, ``irecv``, ``batch_p2p_ops``, c10d's ``send`` ...)."""
    found = _op_name(node)
    return found is not None and found[1] in POINT_TO_POINT


_ALL_REDUCES = frozenset({"all_reduce", "all_reduce_", "allreduce_"})
# Where ``dist.barrier()`` traces to (the plugin's polyfill, NOTE [barrier in a graph]): file and function.
BARRIER_POLYFILL = (
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "variables", "c10d", "rooted.py"),
    "barrier",
)


def is_barrier(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a barrier: the all-reduce ``dist.barrier()`` traces to (NOTE [communication ops]).

    Told by the innermost frame of its stack trace (the polyfill, :data:`BARRIER_POLYFILL`), which every rank
    that called ``dist.barrier()`` there shares; not by its input, which may be a constant on some ranks only
    (a loss the first pipeline stage leaves at zero).
    """
    found = _op_name(node)
    if found is None or found[1] not in _ALL_REDUCES:
        return False
    frames = stack_frames(node.meta.get("stack_trace"))
    return bool(frames) and (os.path.abspath(frames[-1][0]), frames[-1][2]) == BARRIER_POLYFILL


def is_communication(node: torch.fx.Node) -> bool:
    """Whether ``node`` communicates with other ranks (NOTE [communication ops]): a collective (point-to-point and
    barriers included), one of :data:`PLUGIN_COMMUNICATION_OPS`, a symmetric-memory op, or a higher-order op
    whose body holds one.  Waits are not."""
    if node.op != "call_function":
        return False
    schema = _schema(node)
    if schema is not None:
        namespace, _, name = schema.name.partition("::")
        if namespace in NAMESPACES:
            return name not in WAITS
        return namespace in COMMUNICATION_NAMESPACES or schema.name in PLUGIN_COMMUNICATION_OPS
    if not _compat.is_higher_order_op(node.target):
        return False
    owner = node.graph.owning_module
    return owner is not None and any(is_communication(n) for sub in _subgraphs(owner, node) for n in sub.graph.nodes)


def communication_between(
    first: torch.fx.Node, last: torch.fx.Node, *, skip: torch.fx.Node | None = None
) -> str | None:
    """The name of the first communication op strictly between ``first`` and ``last`` in graph order (other than
    ``skip``), or None: what moving ``first`` to ``last`` would move it across (NOTE [communication ops])."""
    node = first.next
    while node is not last and node.op != "output":
        if node is not skip and is_communication(node):
            return node.name
        node = node.next
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class FxCollective:
    """One collective node of an FX graph, with its arguments bound by name.

    Attributes:
        node: the collective's node.
        namespace: the op's namespace (``_c10d_functional``).
        name: the op's name without overload (``all_reduce``).
        arguments: the op's arguments by schema name, keyword arguments included, in schema order.
        group: the process group's name (``""`` when the node names none).
        reduce_op: the reduce op (``"sum"``, ...) or ``""``.
    """

    node: torch.fx.Node
    namespace: str
    name: str
    arguments: dict[str, Any]
    group: str
    reduce_op: str

    @property
    def op(self) -> str:
        """``namespace.name`` (``_c10d_functional.all_reduce``)."""
        return f"{self.namespace}.{self.name}"

    @property
    def kind(self) -> str | None:
        """Traffic kind (:data:`TRAFFIC`: ``all_reduce``, ``p2p`` ...); ``None`` for an op it does not list."""
        return TRAFFIC.get(self.name) if self.namespace != "c10d" else None

    @property
    def point_to_point(self) -> bool:
        """Whether the op's peers are chosen per rank (``isend``, ``irecv``, ``batch_p2p_ops`` ...)."""
        return self.name in POINT_TO_POINT

    @functools.cached_property
    def ranks(self) -> tuple[int, ...]:
        """The group's global ranks, sorted; ``()`` when no live group of this process has that name."""
        return _compat.group_ranks(self.group)

    @property
    def input(self) -> Any:
        """The example value of the first argument (the tensor, or list of tensors, sent); ``None`` without one."""
        first = self.node.args[0] if self.node.args else None
        if isinstance(first, (list, tuple)):
            return [example_value(a) for a in first]
        return example_value(first)

    @property
    def output(self) -> Any:
        """The example value of the node's result."""
        return example_value(self.node)

    @property
    def bytes_in(self) -> int:
        """Bytes of :attr:`input` on this rank (a SymInt for symbolic sizes)."""
        return tensor_bytes(self.input)

    @property
    def bytes_out(self) -> int:
        """Bytes of :attr:`output` on this rank (a SymInt for symbolic sizes)."""
        return tensor_bytes(self.output)

    @property
    def waits(self) -> list[torch.fx.Node]:
        """The waits on the result, through ``getitem`` for collectives that return several tensors."""
        out = []
        for user in self.node.users:
            readers = list(user.users) if user.target is operator.getitem else [user]
            out += [r for r in readers if is_wait(r)]
        return out

    @property
    def stack_trace(self) -> str:
        """``meta["stack_trace"]`` of the node (``""`` without one)."""
        return self.node.meta.get("stack_trace") or ""

    @property
    def user_frame(self) -> tuple[str, int, str, str] | None:
        """``(file, line, function, source)`` of the user's line that issued it (:func:`node_origin.user_frame`)."""
        return user_frame(self.stack_trace)


def read(node: torch.fx.Node) -> FxCollective | None:
    """``node`` as a collective (NOTE [one collective reader]), ``None`` when it is not one (waits included)."""
    found = _op_name(node)
    if found is None or found[1] in WAITS:
        return None
    bound: dict[str, Any] = dict(zip((a.name for a in _schema(node).arguments), node.args))
    bound.update(node.kwargs)
    return FxCollective(node, found[0], found[1], bound, _group(bound), _reduce_op(bound))


def _group(bound: dict[str, Any]) -> str:
    """The group an op's bound arguments name: by its name (or object), else the legacy ``tag``."""
    for arg_name in (*_GROUP_ARGS, _LEGACY_GROUP_ARG):
        value = bound.get(arg_name)
        if value is not None and not isinstance(value, (torch.fx.Node, list, tuple)):
            name = group_name(value)
            if name:
                return name
    return ""


def _reduce_op(bound: dict[str, Any]) -> str:
    reduce_op = ""
    for arg_name, value in bound.items():
        if arg_name in _REDUCE_ARGS and isinstance(value, str):
            reduce_op = value
    return reduce_op


def _subgraphs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Iterator[torch.fx.GraphModule]:
    """Graph modules a higher-order op node calls (its ``get_attr`` arguments)."""
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            sub = getattr(gm, str(arg.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                yield sub


def iter_collectives(gm: torch.fx.GraphModule, *, into_subgraphs: bool = False) -> Iterator[FxCollective]:
    """The collectives of ``gm`` in graph order.

    ``into_subgraphs``: also those of the subgraphs a higher-order op calls, where it calls them.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        found = read(node)
        if found is not None:
            yield found
        elif into_subgraphs and _compat.op_schema(node.target) is None:
            for sub in _subgraphs(gm, node):
                yield from iter_collectives(sub, into_subgraphs=True)


def collective_names(gm: torch.fx.GraphModule) -> list[str]:
    """Names (``all_reduce``) of the collectives of ``gm`` in graph order, waits and c10d's own ops left out.

    What :func:`names_in_text` reads from the graph's text, read from the graph
    itself: the functional collectives, and the ``torch.distributed`` functions
    a Dynamo graph calls as functions.
    """
    out = []
    for node in gm.graph.nodes:
        found = read(node) if node.op == "call_function" else None
        if found is not None and found.namespace != "c10d":
            out.append(found.name)
        elif found is None and node.op == "call_function" and _distributed_function(node.target):
            out.append(node.target.__name__)
    return out


def _distributed_function(target: Any) -> bool:
    """A ``torch.distributed`` Python function kept as a call in a Dynamo graph, other than a wait or a query."""
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None)
    return module.startswith("torch.distributed.") and isinstance(name, str) and name not in _TEXT_NOT_COLLECTIVES


# A functional collective in a printed graph: ``torch.ops._c10d_functional.all_reduce.default(...)``, or a
# ``torch.distributed`` function Dynamo kept as a call.
_TEXT_COLLECTIVE = re.compile(r"(?:_c10d_functional(?:_autograd)?|c10d_functional|torch\.distributed\.\w+)\.(\w+)")
_TEXT_NOT_COLLECTIVES = frozenset({*WAITS, "default", "get_rank", "get_world_size"})


def names_in_text(graph_text: str | None) -> list[str]:
    """Collective names in the order a printed FX graph issues them, for graphs only known as text.

    Only node lines count: the ``# File: ..., code: ...`` comments FX prints
    above them quote the user's source, which names the collective again.
    """
    out = []
    for line in (graph_text or "").splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            out += [n for n in _TEXT_COLLECTIVE.findall(line.split("=", 1)[1]) if n not in _TEXT_NOT_COLLECTIVES]
    return out


def tensor_shape(value: Any) -> list[Any]:
    """JSON-able shape of a tensor (symbolic sizes as text), or a list of shapes for a list of tensors."""
    if isinstance(value, torch.Tensor):
        return [int(s) if isinstance(s, int) else str(s) for s in value.shape]
    if isinstance(value, (list, tuple)):
        return [tensor_shape(v) for v in value]
    return []


def tensor_dtype(value: Any) -> str:
    """``"float32"`` for a tensor (the first one of a list); ``""`` for anything else."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    if isinstance(value, (list, tuple)) and value:
        return tensor_dtype(value[0])
    return ""
