"""The graph-break types dynamo-ext raises, with stable ids.

Every break goes through :func:`graph_break`, which calls Dynamo's
``unimplemented(gb_type=, context=, explanation=, hints=)`` (the same keywords
on torch 2.11 to 2.15).  The ``gb_type`` strings start with ``dynamo_ext:`` so
the audit and the docs can key on them; never change an existing one.
"""

from __future__ import annotations

import dataclasses
from typing import NoReturn


@dataclasses.dataclass(frozen=True)
class GraphBreakType:
    """A kind of graph break: a stable id, what it means and how to fix it."""

    gb_type: str
    explanation: str
    hints: tuple[str, ...]


MOVE_OUT = "Move this call out of the torch.compile'd function (or behind torch.compiler.disable)."
SEE_DOCS = "See docs/tracing.md, 'What does not trace', in the dynamo-ext repository."

OBJECT_COLLECTIVE = GraphBreakType(
    "dynamo_ext: object collective",
    "Object collectives pickle arbitrary Python objects and exchange their sizes in "
    "a first round of communication; neither can be expressed as tensor ops in a graph.",
    (MOVE_OUT, "Send tensors instead and use the tensor collective (all_gather_into_tensor, broadcast)."),
)
UNTRACEABLE_COLLECTIVE = GraphBreakType(
    "dynamo_ext: collective without a functional counterpart",
    "This torch.distributed call has no functional collective counterpart: it reports "
    "per-rank host state, enforces a host-side timeout or returns a non-tensor handle, "
    "none of which can be recorded in a graph.",
    (MOVE_OUT, SEE_DOCS),
)
GROUP_CREATION = GraphBreakType(
    "dynamo_ext: process group creation",
    "Creating a process group is a collective rendezvous with side effects on the "
    "global c10d state; it cannot be recorded in a graph.",
    (MOVE_OUT, "Create groups and meshes once before compiling, and pass them in or close over them."),
)
UNSUPPORTED_COLLECTIVE_ARGS = GraphBreakType(
    "dynamo_ext: unsupported collective arguments",
    "This torch.distributed call has an argument combination without a functional collective counterpart.",
    (SEE_DOCS,),
)
NON_CONSTANT_ARGUMENT = GraphBreakType(
    "dynamo_ext: non-constant distributed argument",
    "This distributed call needs an argument that is fixed at trace time (a mesh "
    "shape, a rank, a placement) but got a value that depends on tensor data.",
    ("Pass a Python constant, or compute the value outside the compiled function.",),
)
UNSUPPORTED_ATTRIBUTE = GraphBreakType(
    "dynamo_ext: unsupported attribute of a distributed object",
    "dynamo-ext does not model this attribute or method of a distributed object.",
    ("Read it outside the compiled function and pass the result in.", SEE_DOCS),
)
FSDP_LAYOUT = GraphBreakType(
    "dynamo_ext: unsupported FSDP2 layout",
    "dynamo-ext traces FSDP2's forward hooks for parameters sharded on dim 0 "
    "(plain, or FSDP over TP); this module's parameters are laid out otherwise.",
    ("Use fully_shard's default shard placement, or compile the inner blocks only.",),
)
FSDP_UNTRACED = GraphBreakType(
    "dynamo_ext: FSDP2 setting not traced",
    "dynamo-ext traces FSDP2's gradient reduction (reduce-scatter, divide factor, reduce dtype) "
    "into the graph only where eager FSDP2 reduces gradients that way; with this setting FSDP2's "
    "own hooks run eagerly instead, so gradients are exactly eager's.",
    (
        "Compile the inner blocks only, or drop the setting named in the context while compiling.",
        "Do not use compiled autograd for this backward: FSDP2's eager hooks do not run under it.",
    ),
)
P2P_UNAVAILABLE = GraphBreakType(
    "dynamo_ext: point-to-point ops unavailable",
    "This torch release has no functional point-to-point collectives to trace isend/irecv/batch_isend_irecv into.",
    ("Upgrade torch, or run the point-to-point exchange outside the compiled function.",),
)
MODULE_BACKWARD_HOOK = GraphBreakType(
    "dynamo_ext: module backward hook without compiled autograd",
    "dynamo-ext runs module full backward hooks from a compiled graph by putting identity points "
    "on the module's positional input tensors and output tensors; this call has arguments or "
    "results it cannot put them on (a tensor subclass such as DTensor, a tuple subclass).",
    (
        "Enable compiled autograd, which traces module backward hooks into the backward graph: "
        "set torch._dynamo.config.compiled_autograd = True before calling torch.compile.",
        SEE_DOCS,
    ),
)

ALL: tuple[GraphBreakType, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, GraphBreakType))


def graph_break(kind: GraphBreakType, context: str, *, extra_hints: tuple[str, ...] = ()) -> NoReturn:
    """Raise Dynamo's ``Unsupported`` for ``kind``; ``context`` names the call and its arguments."""
    from . import _compat

    _compat.unimplemented(
        gb_type=kind.gb_type,
        context=context,
        explanation=kind.explanation,
        hints=[*kind.hints, *extra_hints],
    )
