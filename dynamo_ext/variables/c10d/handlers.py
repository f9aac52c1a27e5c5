"""c10d handlers: ``torch.distributed`` calls traced as functional collectives.

``register()`` (called by ``variables.install``) makes Dynamo trace, in place
of each ``torch.distributed`` collective, a polyfill with the same signature
written with ``torch.ops._c10d_functional`` ops:

- ``collectives``: all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
  all_to_all_single, all_gather, reduce_scatter, all_to_all (and their aliases);
- ``rooted``: broadcast, reduce, scatter, gather, barrier;
- ``p2p``: isend, irecv, send, recv, batch_isend_irecv;
- ``nn_functional``: ``torch.distributed.nn.functional`` with eager's autograd;
- ``breaks``: a named graph break for every call that cannot be traced;
- ``reduce_op``: ``ReduceOp`` members as constants.

``async_op=True`` returns a :class:`~.work.FunctionalWork` (NOTE [async
collectives in graphs]).  Before inlining a polyfill, a check on the call's
trackers turns what no functional op can express into a graph break that
names the call: a reduce op without a functional name (``PREMUL_SUM``), or a
rank, group or ``async_op`` that depends on tensor data.  A polyfill is
registered only when this torch build has the functional ops it uses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ... import _compat, graph_breaks
from ..base import const_args
from ..functions import register_graph_break, register_polyfill
from . import args as c10d_args
from . import breaks, collectives, nn_functional, p2p, reduce_op, rooted
from .args import REDUCE_OPS, reduce_op_name

# Arguments a trace must know as constants (they choose ops, ranks and groups).
CONSTANT_ARGS = frozenset(
    "op group async_op src dst group_src group_dst peer group_peer tag device_ids timeout".split()
)
# Arguments with no functional counterpart unless None: name -> why.
UNSUPPORTED_ARGS = {"timeout": "a per-call timeout cannot be honoured in a graph (the group's timeout applies)"}
_VALID_OPS = ", ".join(f"ReduceOp.{op.name}" for op in REDUCE_OPS)

# (torch.distributed name, polyfill, functional ops it needs)
POLYFILLS: tuple[tuple[str, Callable[..., Any], tuple[str, ...]], ...] = (
    ("all_reduce", collectives.all_reduce, ("all_reduce",)),
    ("all_gather_into_tensor", collectives.all_gather_into_tensor, ("all_gather_into_tensor",)),
    ("all_gather_single", collectives.all_gather_into_tensor, ("all_gather_into_tensor",)),
    ("_all_gather_base", collectives.all_gather_into_tensor, ("all_gather_into_tensor",)),
    ("reduce_scatter_tensor", collectives.reduce_scatter_tensor, ("reduce_scatter_tensor",)),
    ("reduce_scatter_single", collectives.reduce_scatter_tensor, ("reduce_scatter_tensor",)),
    ("_reduce_scatter_base", collectives.reduce_scatter_tensor, ("reduce_scatter_tensor",)),
    ("all_to_all_single", collectives.all_to_all_single, ("all_to_all_single",)),
    ("all_gather", collectives.all_gather, ("all_gather_into_tensor",)),
    ("reduce_scatter", collectives.reduce_scatter, ("reduce_scatter_tensor",)),
    ("all_to_all", collectives.all_to_all, ("all_to_all_single",)),
    ("all_reduce_coalesced", collectives.all_reduce_coalesced, ("all_reduce_coalesced",)),
    ("broadcast", rooted.broadcast, ("broadcast",)),
    ("reduce", rooted.reduce, ("all_reduce",)),
    ("scatter", rooted.scatter, ("all_to_all_single",)),
    ("gather", rooted.gather, ("all_to_all_single",)),
    ("barrier", rooted.barrier, ("all_reduce",)),
)


def make_check(fn: Callable[..., Any], call: str) -> Callable[[Any, list[Any], dict[str, Any]], None]:
    """The pre-inlining check of a c10d polyfill: constant ranks/groups/flags and a functional reduce op."""
    sig = inspect.signature(fn)
    # ``op`` is a reduce op where its default is one (P2POp's ``op`` is isend/irecv).
    op_param = sig.parameters.get("op")
    takes_reduce_op = op_param is not None and reduce_op_name(op_param.default) is not None

    def check(tx: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return  # inlining the polyfill raises the TypeError eager raises
        op = bound.arguments.get("op") if takes_reduce_op else None
        if op is not None:
            value = const_args([op], {})
            if value is None or reduce_op_name(value[0][0]) is None:
                graph_breaks.graph_break(
                    graph_breaks.UNSUPPORTED_COLLECTIVE_ARGS,
                    f"{call}(op={op.as_python_constant() if value else op.python_type().__name__ + ' instance'}): "
                    "this reduce op has no functional collective (PREMUL_SUM and custom ops have none)",
                    extra_hints=(f"Functional collectives take {_VALID_OPS}.",),
                )
        for name, why in UNSUPPORTED_ARGS.items():
            vt = bound.arguments.get(name)
            if vt is not None and not (vt.is_python_constant() and vt.as_python_constant() is None):
                graph_breaks.graph_break(graph_breaks.UNSUPPORTED_COLLECTIVE_ARGS, f"{call}({name}=...): {why}")
        for name, vt in bound.arguments.items():
            if name in CONSTANT_ARGS and const_args([vt], {}) is None:
                graph_breaks.graph_break(graph_breaks.NON_CONSTANT_ARGUMENT, f"{call}({name}={vt})")

    return check


def register_c10d(
    label: str,
    fn: Callable[..., Any] | None,
    impl: Callable[..., Any],
    ops: tuple[str, ...],
    seen: set[int],
    *,
    unavailable: graph_breaks.GraphBreakType = breaks.UNTRACEABLE_COLLECTIVE,
) -> None:
    """Polyfill ``fn`` (``label`` names it) with ``impl`` when the build has the functional ``ops``.

    Without them the call is a graph break of kind ``unavailable`` naming the missing ops.
    """
    if fn is None or id(fn) in seen:
        return
    seen.add(id(fn))
    missing = [op for op in ops if not _compat.has_functional_op(op)]
    if missing:
        hint = f"This torch build lacks torch.ops._c10d_functional.{{{', '.join(missing)}}}."
        register_graph_break(fn, unavailable, hint=hint)
        return
    register_polyfill(fn, impl, check=make_check(fn, label))


def register() -> None:
    """Register every c10d polyfill, graph break and trace-time helper."""
    c10d_args.register()
    breaks.register()
    reduce_op.register()
    seen: set[int] = set()
    for name, impl, ops in POLYFILLS:
        fn = _compat.optional_attr("torch.distributed", name)
        register_c10d(f"dist.{name}", fn, impl, ops, seen)
    for name, impl, ops in p2p.POLYFILLS:
        fn = _compat.optional_attr("torch.distributed", name)
        register_c10d(f"dist.{name}", fn, impl, ops, seen, unavailable=graph_breaks.P2P_UNAVAILABLE)
    for name, impl, ops in nn_functional.POLYFILLS:
        fn = _compat.optional_attr("torch.distributed.nn.functional", name)
        register_c10d(f"torch.distributed.nn.functional.{name}", fn, impl, ops, seen)
