"""Compiled autograd and the autograd engine: is a backward running, is it compiled, how it calls hooks."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from .dynamo import current_compile_id
from .probes import optional_attr

__all__ = [
    "compiled_autograd",
    "compiled_autograd_accumulate_grad_with_grad_arg",
    "compiled_autograd_enabled",
    "compiled_autograd_hooks",
    "compiled_autograd_module",
    "compiled_by_dynamo",
    "compiling_compiled_autograd_graph",
    "in_autograd_backward",
    "in_compiled_autograd_region",
    "is_aot_backward_prologue",
    "kept_node_meta_fields",
    "retraced_from",
    "tensor_hooks",
]


def in_autograd_backward() -> bool:
    """Whether an autograd node is running now (``torch._C._current_autograd_node``)."""
    try:
        return torch._C._current_autograd_node() is not None
    except (AttributeError, RuntimeError):
        return False


def compiled_autograd(compiler: Any) -> Any:
    """Context manager tracing the backward with compiled autograd (``compiled_autograd._enable``).

    Private in 2.11 to 2.15; torchtitan's training loop uses the same entry point.
    """
    from torch._dynamo import compiled_autograd as ca

    return ca._enable(compiler)


def in_compiled_autograd_region() -> bool:
    """Whether a compiled-autograd graph is running now (``compiled_autograd.in_compiled_autograd_region``)."""
    from torch._dynamo import compiled_autograd as ca

    return bool(getattr(ca, "in_compiled_autograd_region", False))


def compiled_autograd_enabled() -> bool:
    """Whether compiled autograd is on while Dynamo traces (``compiled_autograd.compiled_autograd_enabled``)."""
    from torch._dynamo import compiled_autograd as ca

    return bool(getattr(ca, "compiled_autograd_enabled", False))


def compiling_compiled_autograd_graph() -> bool:
    """Whether Dynamo is compiling a compiled-autograd backward graph now.

    Read from the current compile id's ``compiled_autograd_id`` (set for compiled-autograd graphs on 2.11 to 2.15).
    """
    return getattr(current_compile_id(), "compiled_autograd_id", None) is not None


def compiled_autograd_hooks(output_graph: Any) -> Any:
    """The ``hooks`` argument of the compiled-autograd graph whose frame ``output_graph`` traces (its root
    instruction translator's ``f_locals``); None when there is none."""
    tx = getattr(output_graph, "root_tx", None)
    return (getattr(tx, "f_locals", None) or {}).get("hooks")


@functools.cache
def compiled_autograd_accumulate_grad_with_grad_arg() -> Any:
    """Compiled autograd's ``call_accumulate_grad(variable, grad, has_post_hooks)``, ``None`` where its form differs.

    Compiled autograd's graph calls it for every leaf (``torch/_dynamo/external_utils.py``); on 2.11 and
    2.12 it runs the C++ functional ``AccumulateGrad`` op; 2.14+ take ``variable_grad`` and return the
    new ``.grad`` instead.
    """
    fn = optional_attr("torch._dynamo.external_utils", "call_accumulate_grad")
    if fn is None:
        return None
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return fn if params == ["variable", "grad", "has_post_hooks"] else None


def compiled_autograd_module() -> Any:
    """``torch._dynamo.compiled_autograd`` where it reads an AOTAutograd backward through a module-level
    ``extract_bw_module(CompiledFunction)`` (what compiled autograd inlines into its graph, 2.11 to 2.15); else
    None."""
    from torch._dynamo import compiled_autograd as ca

    return ca if callable(getattr(ca, "extract_bw_module", None)) else None


def tensor_hooks(t: Any) -> tuple[dict[int, Any], dict[int, Any]]:
    """``(register_hook hooks, register_post_accumulate_grad_hook hooks)`` of tensor ``t``, by handle id.

    ``Tensor._backward_hooks`` / ``Tensor._post_accumulate_grad_hooks`` (2.11 to 2.15; None when empty).
    """
    return dict(getattr(t, "_backward_hooks", None) or {}), dict(getattr(t, "_post_accumulate_grad_hooks", None) or {})


def is_aot_backward_prologue(target: Any) -> bool:
    """Whether ``target`` is the prologue compiled autograd calls before each AOTAutograd backward it copies into
    its graph (``proxy_call_aot_backward``'s ``call_aot_bwd_prologue``, 2.13; probed by its qualified name, so a
    release that names it otherwise reads False and its backward graph is compiled whole)."""
    return getattr(target, "__module__", None) == "torch._dynamo.compiled_autograd" and str(
        getattr(target, "__qualname__", "")
    ).endswith("proxy_call_aot_backward.<locals>.call_aot_bwd_prologue")


def compiled_by_dynamo(compiled: Any, module: Any) -> bool:
    """Whether ``compiled`` is Dynamo's ``OptimizedModule`` of ``module`` itself, compiling (what
    ``torch.compile(backend=...)(module)`` returns; ``torch._dynamo.eval_frame.OptimizedModule``, 2.11 to 2.15)."""
    from torch._dynamo.eval_frame import OptimizedModule

    from .dynamo import is_compiling_context

    return (
        isinstance(compiled, OptimizedModule)
        and compiled._orig_mod is module
        and is_compiling_context(getattr(compiled, "dynamo_ctx", None))
    )


def kept_node_meta_fields() -> tuple[str, ...]:
    """The node metadata fields a trace copies from the node it retraces (``torch.fx.proxy._COPY_META_FIELDS``:
    Dynamo's ``_maybe_preserve_original_meta`` copies these, and ``stack_trace``; 2.11 to 2.15)."""
    from torch.fx import proxy

    return tuple(getattr(proxy, "_COPY_META_FIELDS", ()))


def retraced_from(gm: Any) -> None:
    """Tell Dynamo that ``gm``'s current ``forward`` code was generated from ``gm``'s graph, as ``torch.compile(gm)``
    does for the code it is given (``torch._dynamo.code_context``'s ``orig_graphmodule``, 2.11 to 2.15): Dynamo then
    copies each original node's metadata onto the nodes it traces from that code."""
    import weakref

    from torch._dynamo.code_context import code_context

    code_context.get_context(gm.forward.__code__)["orig_graphmodule"] = weakref.ref(gm)
