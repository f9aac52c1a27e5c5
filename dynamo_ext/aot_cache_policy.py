"""AOTAutograd's cache for graphs that hold dynamo-ext's own ``autograd.Function`` calls.

NOTE [our autograd functions in AOTAutograd's cache]
AOTAutograd's cache (``AOTAutogradCache``) bypasses every graph that calls a
custom ``autograd.Function`` (Dynamo's ``autograd_function_apply``
higher-order op) unless ``torch._functorch.config.autograd_cache_allow_custom_autograd_functions``
is on: a user's Function may hide state the cache key does not see.  The
plugin traces FSDP2's parameter all-gather (``variables/fsdp/reduce.py``,
``FSDPAllGather``) and ``torch.distributed.nn.functional`` as Functions of its
own, so every FSDP2 graph would be compiled anew on each restart.

Our Functions keep no hidden state: Dynamo traces both their forward and their
backward into subgraphs of the graph (``fwd_body``, ``bwd_body``) with every
Python value (group name, world size, factors) baked in as a constant, and the
cache key covers those subgraphs' code.  So while AOTAutograd compiles a graph
whose every ``autograd_function_apply`` is ours (the call and every node of its
bodies that has a stack trace trace back to dynamo-ext's code; Dynamo's own
grad-mode switches have none), the switch is
on for that compile only; a graph that also calls a user's Function is left to
torch's default.  The switch is part of the cache key (AOTAutograd saves its
config there), so the same graph makes the same decision on a restart.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from . import _compat
from ._patching import Patcher
from .node_origin import stack_frames

log = logging.getLogger(__name__)

_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _traces_to_us(stack_trace: str | None) -> bool:
    """Whether the deepest frame outside torch of ``stack_trace`` is dynamo-ext's (not a bundled example's)."""
    frames = [f for f in stack_frames(stack_trace) if not f[0].startswith(_TORCH_DIR)]
    if not frames:
        return False
    path = frames[-1][0]
    return path.startswith(_PKG_DIR) and not os.path.basename(path).startswith("example_")


def _body(gm: Any, arg: Any) -> Any:
    return getattr(gm, str(arg.target), None) if getattr(arg, "op", None) == "get_attr" else None


def _ours(gm: Any, node: Any) -> bool:
    if not _traces_to_us(node.meta.get("stack_trace")):
        return False
    bodies = [_body(gm, a) for a in node.args[:2]]
    if any(b is None or not hasattr(b, "graph") for b in bodies):
        return False
    for body in bodies:
        for n in body.graph.nodes:
            trace = n.meta.get("stack_trace")
            # nodes without a trace are Dynamo's own (the grad-mode switches around a body)
            if n.op == "call_function" and trace and not _traces_to_us(trace):
                return False
    return True


def only_our_autograd_functions(gm: Any) -> bool:
    """Whether ``gm`` (a Dynamo graph, or a wrapper with ``.gm``) calls custom ``autograd.Function``s and every
    one of them is dynamo-ext's (NOTE [our autograd functions in AOTAutograd's cache])."""
    gm = getattr(gm, "gm", gm)
    modules = gm.modules() if callable(getattr(gm, "modules", None)) else ()
    found = False
    for module in modules:
        graph = getattr(module, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.op == "call_function" and _compat.is_autograd_function_apply(node.target):
                if not _ours(module, node):
                    return False
                found = True
    return found


def _allowing(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def aot_module_simplified(mod: Any, *args: Any, **kwargs: Any) -> Any:
        if _compat.custom_autograd_function_switch_on() or not only_our_autograd_functions(mod):
            return original(mod, *args, **kwargs)
        log.debug("AOTAutograd cache allowed for this graph: its custom autograd.Functions are dynamo-ext's")
        with _compat.cache_custom_autograd_functions():
            return original(mod, *args, **kwargs)

    return aot_module_simplified


def install(patches: Patcher) -> None:
    """Let AOTAutograd's cache serve graphs whose custom Functions are ours (NOTE [our autograd functions in
    AOTAutograd's cache]); nothing when torch has no such switch."""
    if not _compat.has_custom_autograd_function_switch():
        return
    owner = _compat.aot_backend_module()
    patches.setattr(owner, "aot_module_simplified", _allowing(owner.aot_module_simplified))
