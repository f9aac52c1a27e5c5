"""Small questions about one FX node, asked by every module that reads graphs.

``val`` is the example value a node carries: ``meta["val"]`` (AOTAutograd's and
Inductor's graphs, and the nodes our passes make), else ``meta["example_value"]``
(Dynamo's output graph).
"""

from __future__ import annotations

import re
from typing import Any, TypeGuard

import torch
import torch.fx

from .. import _compat

__all__ = [
    "example_value",
    "is_call",
    "container_item",
    "is_invoke_subgraph",
    "sole_user",
    "static_contiguous",
    "static_layout",
    "static_shape",
    "tensor_bytes",
]


def example_value(node: Any) -> Any:
    """The example value of ``node`` (a ``FakeTensor``, a list of them, a SymInt ...); ``None`` for a non-node."""
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def is_call(node: Any, *targets: Any) -> TypeGuard[torch.fx.Node]:
    """Whether ``node`` is a ``call_function`` node calling one of ``targets``."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def is_invoke_subgraph(node: Any) -> bool:
    """Whether ``node`` calls the ``invoke_subgraph`` higher-order op (a region compiled once, called here)."""
    op = _compat.invoke_subgraph_op()
    return op is not None and is_call(node, op)


def sole_user(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one node that reads ``node``, ``None`` when there are none or several."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def static_shape(value: Any) -> bool:
    """Whether ``value`` is a tensor whose sizes are all plain ints (no SymInt)."""
    return isinstance(value, torch.Tensor) and all(isinstance(s, int) for s in value.shape)


def static_layout(value: Any) -> bool:
    """Whether ``value`` is a tensor whose sizes and strides are all plain ints (no SymInt)."""
    return static_shape(value) and all(isinstance(s, int) for s in value.stride())


def static_contiguous(value: Any) -> bool:
    """Whether ``value`` is a contiguous tensor whose sizes and strides are all plain ints."""
    return static_layout(value) and value.is_contiguous()


_CONTAINER_ITEM = re.compile(r"^(?P<container>.+?)(?:\[(?P<a>\d+)\]|\['(?P<c>\d+)'\]|\.(?P<b>\d+))$")


def container_item(node: torch.fx.Node) -> tuple[str, str, int] | None:
    """``(path, container path, index)`` of the outermost module in ``node``'s module stack that is an item of
    a container (``L['self'].layers[2]``, ``layers['2']`` of a ModuleDict, ``blocks.0``); None when there is none."""
    for path, _cls in (node.meta.get("nn_module_stack") or {}).values():
        if isinstance(path, str) and (m := _CONTAINER_ITEM.match(path)) is not None:
            return path, m.group("container"), int(m.group("a") or m.group("b") or m.group("c"))
    return None


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor, or the sum over a list/tuple of them; 0 for anything else.

    Symbolic sizes give a SymInt (the caller decides whether it may be one).
    """
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def traced_outputs(sub: torch.fx.GraphModule, fake_mode: Any) -> tuple[Any, ...] | None:
    """The outputs of a graph cut from a Dynamo graph (a block split's submodule), as Dynamo traced them, made
    fake tensors of ``fake_mode`` (the backend's); None (then run it on fake inputs) unless each is a tensor of
    static sizes that is no view and shares its storage with no other output and no input of the graph.

    NOTE [a submodule's outputs from the trace]: Dynamo computed its nodes' fake values by running the same
    ops (eager's strides); running the submodule again costs, per block, as much as that.  Dynamo hands the
    backend inputs of a fake mode of its own, so the outputs are converted (``from_tensor``), which keeps
    metadata but not aliasing with tensors converted otherwise: hence only outputs that alias nothing.
    """
    output = next(n for n in reversed(sub.graph.nodes) if n.op == "output")
    outs = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for a in output.args[0]]
    ins = [p.meta.get("example_value") for p in sub.graph.find_nodes(op="placeholder")]
    if not all(isinstance(v, torch.Tensor) and static_layout(v) and not v._is_view() for v in outs):
        return None
    storages = [_compat.storage_of(v) for v in outs]
    if any(s is None for s in storages) or len(set(storages)) < len(storages):
        return None
    if set(storages) & {_compat.storage_of(v) for v in ins if isinstance(v, torch.Tensor)}:
        return None
    return tuple(_compat.refake(fake_mode, v) for v in outs)
