"""Graph breaks for ``torch.distributed`` calls that cannot become graph ops.

Each break names the call, says why it cannot be traced (the explanation of
its :class:`~dynamo_ext.graph_breaks.GraphBreakType`) and gives a hint.  Under
``fullgraph=False`` Dynamo then runs the original call eagerly, so behaviour
is exactly eager's.

:func:`unsupported` is the break a polyfill raises from inside its body when
an argument combination has no faithful functional translation (an uneven
``all_gather`` list, a ``barrier`` timeout): Dynamo meets it while inlining
the polyfill and breaks at the user's call.
"""

from __future__ import annotations

from typing import Any, NoReturn

from ... import _compat, graph_breaks
from ...graph_breaks import GROUP_CREATION, OBJECT_COLLECTIVE, UNTRACEABLE_COLLECTIVE, GraphBreakType
from ..functions import register_graph_break, register_polyfill

_CREATE_FIRST = "Create process groups once, before the compiled function, and pass them in."

# (module, name, kind, hint); probed, so a function missing from a release is skipped.
NON_TRACEABLE = (
    ("torch.distributed", "all_gather_object", OBJECT_COLLECTIVE, ""),
    ("torch.distributed", "broadcast_object_list", OBJECT_COLLECTIVE, ""),
    ("torch.distributed", "gather_object", OBJECT_COLLECTIVE, ""),
    ("torch.distributed", "scatter_object_list", OBJECT_COLLECTIVE, ""),
    ("torch.distributed", "send_object_list", OBJECT_COLLECTIVE, ""),
    ("torch.distributed", "recv_object_list", OBJECT_COLLECTIVE, ""),
    ("torch.distributed", "init_process_group", GROUP_CREATION, _CREATE_FIRST),
    ("torch.distributed", "destroy_process_group", GROUP_CREATION, "Destroy groups after the compiled function."),
    ("torch.distributed", "new_group", GROUP_CREATION, _CREATE_FIRST),
    ("torch.distributed", "new_subgroups", GROUP_CREATION, _CREATE_FIRST),
    ("torch.distributed", "new_subgroups_by_enumeration", GROUP_CREATION, _CREATE_FIRST),
    ("torch.distributed", "split_group", GROUP_CREATION, _CREATE_FIRST),
    ("torch.distributed", "monitored_barrier", UNTRACEABLE_COLLECTIVE, "dist.barrier() traces; it has no timeout."),
    ("torch.distributed", "breakpoint", UNTRACEABLE_COLLECTIVE, "Call it outside the compiled function."),
)


def unsupported(call: str, why: str) -> NoReturn:
    """Traced: a graph break naming ``call`` and ``why`` (constants).  Run eagerly: ``RuntimeError``."""
    raise RuntimeError(f"{call}: {why}")


def untraceable(call: str, why: str) -> NoReturn:
    """Like :func:`unsupported`, with the kind :data:`UNTRACEABLE_COLLECTIVE`."""
    raise RuntimeError(f"{call}: {why}")


def _break_check(kind: GraphBreakType) -> Any:
    def check(tx: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
        vts = [*args, *kwargs.values()]
        text = [vt.as_python_constant() if vt.is_python_constant() else repr(vt) for vt in vts]
        graph_breaks.graph_break(kind, ": ".join(str(t) for t in text))

    return check


def register() -> None:
    """Register the graph break of every non-traceable call, and the two in-body breaks."""
    for module, name, kind, hint in NON_TRACEABLE:
        fn = _compat.optional_attr(module, name)
        if fn is not None:
            register_graph_break(fn, kind, hint=hint)
    register_polyfill(unsupported, unsupported, check=_break_check(graph_breaks.UNSUPPORTED_COLLECTIVE_ARGS))
    register_polyfill(untraceable, untraceable, check=_break_check(UNTRACEABLE_COLLECTIVE))
