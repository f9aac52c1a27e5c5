"""The ops of a run of FX nodes, compared to find repeated blocks (NOTE [blocks compiled once])."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["op_signature", "target_name"]


def target_name(target: Any) -> str:
    """A node's target as a dotted name (a string target as it is)."""
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', None) or getattr(target, '__name__', repr(type(target)))}"


def op_signature(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> tuple[Any, ...]:
    """The ops of ``nodes`` in order (op kind and target name, a body's own ops), not their shapes or
    constants: equal on every rank for the same code."""
    out: list[Any] = []
    for n in nodes:
        if n.op == "get_attr":
            attr = getattr(gm, str(n.target), None)
            if isinstance(attr, torch.fx.GraphModule):
                out.append(("body", op_signature(attr, list(attr.graph.nodes))))
            else:
                out.append(("get_attr",))
        else:
            out.append((n.op, target_name(n.target) if n.op != "placeholder" else ""))
    return tuple(out)
