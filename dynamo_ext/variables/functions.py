"""Function handlers: a ``torch.distributed`` callable traced as a Python polyfill.

``register_polyfill(fn, impl)`` makes Dynamo, whenever it meets ``fn`` (a
global, an attribute of ``torch.distributed``, a value made during tracing),
trace ``impl`` instead: ``impl`` is ordinary Python written with functional
collectives, which Dynamo inlines.  ``impl`` must take the same arguments as
``fn``; when ``fn`` is reached as a bound method (``obj.method`` where
``type(obj).method is fn``), ``impl`` receives ``obj`` first.  This is the idea of ``torch.compiler.substitute_in_graph``, kept in
our own table so ``uninstall()`` removes it and the handler sees the call's
arguments before inlining (to raise a clear graph break).

A ``check(args, kwargs)`` callback, when given, runs first on the trackers and
may call :func:`dynamo_ext.graph_breaks.graph_break`.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from .. import _compat, graph_breaks
from . import registry

Check = Callable[[Any, list[Any], dict[str, Any]], None]


Handler = Callable[[Any, list[Any], dict[str, Any]], Any]


class HandledFunctionVariable(_compat.VariableTracker):
    """A call to ``fn`` that Dynamo traces as ``handler(tx, args, kwargs) -> VariableTracker``."""

    def __init__(self, fn: Callable[..., Any], handler: Handler, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fn = fn
        self.handler = handler
        self.bound_self: Any = None  # the tracker of ``self`` when fn was reached as a bound method

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self.fn, '__qualname__', self.fn)})"

    def python_type(self) -> type:
        return type(self.fn)

    def as_python_constant(self) -> Any:
        return self.fn

    def is_python_constant(self) -> bool:
        return True

    def call_function(self, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if self.bound_self is not None:
            args = [self.bound_self, *args]
        return self.handler(tx, args, kwargs)

    def reconstruct(self, codegen: Any) -> None:
        if self.source is not None:
            codegen(self.source)
        else:
            name = codegen.tx.output.install_global_by_id("dynamo_ext_fn", self.fn)
            codegen.append_output(codegen.create_load_global(name, add=True))


def register_handler(fn: Callable[..., Any], handler: Handler) -> None:
    """Trace calls of ``fn`` with ``handler``.  Raises ``ValueError`` if ``fn`` has one already."""

    def build(tx: Any, value: Any, source: Any) -> HandledFunctionVariable:
        vt = HandledFunctionVariable(fn, handler, source=source)
        if isinstance(value, types.MethodType):
            self_source = None if source is None else _compat.AttrSource(source, "__self__")
            vt.bound_self = build_variable(tx, value.__self__, self_source)
        return vt

    registry.register_variable(fn, build, match="identity")


def register_polyfill(fn: Callable[..., Any], impl: Callable[..., Any], *, check: Check | None = None) -> None:
    """Trace ``impl`` wherever Dynamo meets ``fn``.  Raises ``ValueError`` if ``fn`` has one already."""

    def handler(tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if check is not None:
            check(tx, args, kwargs)
        return _compat.user_function_variable(impl).call_function(tx, args, kwargs)

    register_handler(fn, handler)


def build_variable(tx: Any, value: Any, source: Any) -> Any:
    """A tracker for ``value``: from its source when it has one (guarded), else sourceless."""
    if source is None:
        return _compat.SourcelessBuilder.create(tx, value)
    return _compat.VariableBuilder(tx, source)(value)


def register_graph_break(fn: Callable[..., Any], kind: graph_breaks.GraphBreakType, *, hint: str = "") -> None:
    """Make every call of ``fn`` a graph break of ``kind`` that names the call."""
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}"

    def check(tx: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
        graph_breaks.graph_break(kind, f"{name}(...)", extra_hints=(hint,) if hint else ())

    register_handler(fn, lambda tx, args, kwargs: check(tx, args, kwargs))


def fold_call(fn: Callable[..., Any], tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Evaluate ``fn`` at trace time on constant arguments; wrap the result (sourceless)."""
    from .base import const_args, raise_user_error, wrap_constant

    consts = const_args(args, kwargs)
    if consts is None:
        graph_breaks.graph_break(
            graph_breaks.NON_CONSTANT_ARGUMENT,
            f"{getattr(fn, '__qualname__', fn)}(args={args}, kwargs={kwargs})",
        )
    try:
        result = fn(*consts[0], **consts[1])
    except Exception as e:
        raise_user_error(tx, e)
    return wrap_constant(tx, result)


def register_constant_fold(fn: Callable[..., Any]) -> None:
    """Evaluate calls of ``fn`` at trace time (arguments must be constants or distributed objects).

    For functions whose result depends only on state fixed at trace time
    (``get_rank``, ``get_process_group_ranks``): their group argument is
    guarded by identity, so the folded value is exact.
    """
    register_handler(fn, lambda tx, args, kwargs: fold_call(fn, tx, args, kwargs))
