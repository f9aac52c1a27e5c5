"""Making nodes in a post-grad graph: what the lowering passes (bucketing, the RMSNorm fusion) share.

A node a pass makes carries what Inductor and the audit read from the node it
stands for: the example value (computed under the graph's fake mode), the
``original_aten`` op, and the origin's stack trace, module stack and sequence
number (so the audit and the collective check name the user's line for it).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from .. import _compat
from ..fx.nodes import example_value

__all__ = ["call", "getitems"]

_ORIGIN_META = ("stack_trace", "nn_module_stack", "seq_nr")


def call(graph: torch.fx.Graph, target: Any, args: tuple[Any, ...], origin: torch.fx.Node) -> torch.fx.Node:
    """A new ``call_function`` node ``target(*args)`` at the graph's insertion point, with ``meta`` filled in.

    ``meta["val"]`` is ``target`` run on the arguments' example values (nodes
    anywhere in ``args``, lists included) under their fake mode; ``origin`` gives
    the node its stack trace, module stack and ``seq_nr``.
    """
    node = graph.call_function(target, args)
    vals = pytree.tree_map_only(torch.fx.Node, example_value, args)
    mode = _compat.detect_fake_mode([v for v in pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*vals)
    node.meta["original_aten"] = target if isinstance(target, torch._ops.OpOverload) else None
    for key in _ORIGIN_META:
        if key in origin.meta:
            node.meta[key] = origin.meta[key]
    return node


def getitems(graph: torch.fx.Graph, node: torch.fx.Node, n: int) -> list[torch.fx.Node]:
    """``node[0] .. node[n - 1]`` as ``getitem`` nodes of a multi-output ``node``, with their values."""
    out = []
    for i in range(n):
        item = graph.call_function(operator.getitem, (node, i))
        item.meta["val"] = node.meta["val"][i]
        item.meta["original_aten"] = node.meta["original_aten"]
        out.append(item)
    return out
