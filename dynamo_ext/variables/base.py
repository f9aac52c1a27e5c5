"""``DistributedObjectVariable``: the common base of our trackers.

A process group, a mesh or a placement is fixed for the life of a compiled
frame: the compiled code depends on it only through values that are constant
for that object (rank, sizes, layout, dim names).  So a tracker holds the real
object, answers attributes and pure methods by calling them at trace time, and
relies on the object's guard (``dynamo_ext/guards/``) to recompile when the
object changes.  In a graph, the object appears as a constant argument, as
torch 2.11's own distributed trackers did.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar

from .. import _compat, graph_breaks

VariableTracker = _compat.VariableTracker


_NO_VALUE = object()


def _value_of(vt: Any) -> Any:
    """The Python value a tracker stands for when it is known at trace time."""
    if isinstance(vt, DistributedObjectVariable):
        return vt.value
    if isinstance(vt, VariableTracker) and vt.is_python_constant():
        return vt.as_python_constant()
    return _NO_VALUE


_LITERALS = (type(None), bool, int, float, str)
# Dunders call_method answers itself (torch 2.11's polyfilled == calls a.__eq__(b)).
_COMPARE_DUNDERS = frozenset({"__eq__", "__ne__", "__hash__"})


def is_literal(x: Any) -> bool:
    """Whether ``x`` is plain immutable data (None, numbers, strings, tuples/lists of them, dtypes, devices)."""
    import torch

    if isinstance(x, _LITERALS + (torch.dtype, torch.device)):
        return True
    return isinstance(x, tuple | list) and all(is_literal(v) for v in x)


def _python_method(obj: Any, name: str) -> Any:
    """The plain Python function behind ``obj.name`` when it is a regular method, else ``None``."""
    import types

    if name.startswith("__"):
        return None
    fn = getattr(type(obj), name, None)
    return fn if isinstance(fn, types.FunctionType) else None


def const_args(args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]] | None:
    """Python values of ``args``/``kwargs`` when all are constants, else ``None``."""
    pos = [_value_of(a) for a in args]
    kw = {k: _value_of(v) for k, v in kwargs.items()}
    if any(v is _NO_VALUE for v in pos) or any(v is _NO_VALUE for v in kw.values()):
        return None
    return pos, kw


def wrap_constant(tx: Any, value: Any) -> Any:
    """A sourceless tracker for a value computed at trace time (goes through our registry)."""
    return _compat.SourcelessBuilder.create(tx, value)


class DistributedObjectVariable(VariableTracker):
    """A distributed object that is constant for the compiled frame.

    Subclasses list what may be evaluated at trace time: ``CONSTANT_ATTRS``
    (attributes) and ``PURE_METHODS`` (methods that neither communicate nor
    mutate and whose result depends only on the object and the arguments).
    Anything else is a graph break that names the attribute.
    """

    CONSTANT_ATTRS: ClassVar[frozenset[str]] = frozenset()
    PURE_METHODS: ClassVar[frozenset[str]] = frozenset()
    KIND: ClassVar[str] = "distributed object"

    def __init__(self, value: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.value = value
        self._stock_vt: Any = None

    def __repr__(self) -> str:
        try:
            return f"{type(self).__name__}({self.value!r})"
        except Exception:  # noqa: BLE001  (a repr must not fail while Dynamo reports an error)
            return f"{type(self).__name__}(<{type(self.value).__qualname__}>)"

    # ---- constant protocol -------------------------------------------------
    def python_type(self) -> type:
        return type(self.value)

    def as_python_constant(self) -> Any:
        return self.value

    def is_python_constant(self) -> bool:
        # Meshes and groups are reference objects: stock code must put them into
        # graphs through as_proxy (see NOTE [distributed objects in graphs]),
        # not bake them in as literals.  Placements (values) override this.
        return self.IS_VALUE

    IS_VALUE: ClassVar[bool] = False

    def guard_as_python_constant(self) -> Any:
        return self.value

    def as_proxy(self) -> Any:
        # NOTE [distributed objects in graphs]
        # When stock code puts the object itself into a graph (torch 2.12+ pass
        # meshes to from_local/redistribute as opaque graph inputs), use the
        # representation stock Dynamo would have built; where stock reads the
        # object as a Python constant instead (2.11 closes over it), this is
        # never called.
        if self._stock_vt is None:
            from .registry import stock_variable

            tx = _compat.current_tx()
            source = self.source
            if source is None and not self.IS_VALUE:
                # Made during tracing (mesh["tp"], init_device_mesh(...)): stock
                # builds reference objects only from a source, so give it one.
                name = tx.output.install_global_by_id("dynamo_ext_obj", self.value)
                source = _compat.GlobalSource(name)
            self._stock_vt = stock_variable(tx, self.value, source)
        return self._stock_vt.as_proxy()

    def is_hashable(self) -> bool:
        return type(self.value).__hash__ is not None

    def hash_impl(self, tx: Any) -> tuple[int, bool]:
        return hash(self.value), False

    def get_python_hash(self) -> int:
        return hash(self.value)

    def is_python_hashable(self) -> bool:
        return self.is_hashable()

    def is_python_equal(self, other: object) -> bool:
        other_value = _value_of(other)
        return other_value is not _NO_VALUE and self.value == other_value

    def richcompare_impl(self, tx: Any, other: Any, op: str) -> Any:
        # Dynamo names the op "__eq__" (2.13+) or "==" depending on the release.
        ops = {"==": operator.eq, "!=": operator.ne, "__eq__": operator.eq, "__ne__": operator.ne}
        other_value = _value_of(other)
        if op in ops and other_value is not _NO_VALUE:
            return _compat.ConstantVariable.create(ops[op](self.value, other_value))
        return _compat.ConstantVariable.create(NotImplemented)

    def reconstruct(self, codegen: Any) -> None:
        if self.source is not None:
            codegen(self.source)
            return
        # Made during tracing (e.g. mesh["tp"]): load the very object from a global.
        name = codegen.tx.output.install_global_by_id("dynamo_ext_obj", self.value)
        codegen.append_output(codegen.create_load_global(name, add=True))

    # ---- attributes and methods ----------------------------------------------
    def const_getattr(self, tx: Any, name: str) -> Any:
        if name in self.CONSTANT_ATTRS:
            return getattr(self.value, name)
        raise NotImplementedError(name)

    def var_getattr(self, tx: Any, name: str) -> Any:
        if name in self.CONSTANT_ATTRS:
            return wrap_constant(tx, getattr(self.value, name))
        if name in self.PURE_METHODS or name in _COMPARE_DUNDERS or _python_method(self.value, name) is not None:
            return _compat.GetAttrVariable(self, name)
        if name == "__class__":
            return wrap_constant(tx, type(self.value))
        try:
            attr = getattr(self.value, name)
        except AttributeError as e:  # what eager raises
            raise_user_error(tx, e)
        if is_literal(attr):
            # Plain data on a guarded object (e.g. a mesh's group names) is constant too.
            return wrap_constant(tx, attr)
        self._unsupported(name)

    # torch 2.14+ renamed the tracker protocol after CPython's type slots.
    def tp_getattro_impl(self, tx: Any, name: str) -> Any:
        return self.var_getattr(tx, name)

    def tp_richcompare_impl(self, tx: Any, other: Any, op: str) -> Any:
        return self.richcompare_impl(tx, other, op)

    def nb_bool_impl(self, tx: Any) -> Any:
        return _compat.ConstantVariable.create(bool(self.value))

    bool_impl = nb_bool_impl  # torch 2.12 and 2.13

    def call_obj_hasattr(self, tx: Any, name: str) -> Any:
        # Attributes of a guarded object do not change while its guard holds.
        return _compat.ConstantVariable.create(hasattr(self.value, name))

    def call_method(self, tx: Any, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if name in ("__eq__", "__ne__") and len(args) == 1:
            return self.richcompare_impl(tx, args[0], name)
        if name == "__hash__" and not args and self.is_hashable():
            return _compat.ConstantVariable.create(hash(self.value))
        if name in self.PURE_METHODS:
            return self.call_pure_method(tx, name, args, kwargs)
        fn = _python_method(self.value, name)
        if fn is not None:
            # Any other Python-level method: inline its code with self as this tracker.
            return _compat.user_function_variable(fn).call_function(tx, [self, *args], kwargs)
        if not name.startswith("__"):
            self._unsupported(name)
        return super().call_method(tx, name, args, kwargs)

    def _unsupported(self, name: str) -> None:
        graph_breaks.graph_break(
            graph_breaks.UNSUPPORTED_ATTRIBUTE,
            f"{type(self.value).__qualname__}.{name}",
            extra_hints=(f"Supported on a {self.KIND}: {sorted(self.CONSTANT_ATTRS | self.PURE_METHODS)}",),
        )

    def call_pure_method(self, tx: Any, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Evaluate ``self.value.<name>(*args)`` at trace time; arguments must be constants."""
        consts = const_args(args, kwargs)
        if consts is None:
            graph_breaks.graph_break(
                graph_breaks.NON_CONSTANT_ARGUMENT,
                f"{type(self.value).__qualname__}.{name}(args={args}, kwargs={kwargs})",
            )
        try:
            result = getattr(self.value, name)(*consts[0], **consts[1])
        except Exception as e:  # the user's error, raised as eager raises it
            raise_user_error(tx, e)
        return wrap_constant(tx, result)

    def mp_subscript_impl(self, tx: Any, key: Any) -> Any:
        if "__getitem__" in self.PURE_METHODS:
            return self.call_pure_method(tx, "__getitem__", [key], {})
        return super().mp_subscript_impl(tx, key)


def raise_user_error(tx: Any, exc: Exception) -> None:
    """Re-raise ``exc`` (raised by the real object at trace time) as the user's exception.

    An "observed" exception is one Dynamo treats as raised by user code: a
    ``try`` in the compiled function can catch it, and uncaught it reaches the
    caller with its type and message, as in eager (not as an internal error).
    """
    _compat.raise_observed_exception(type(exc), tx, args=[str(exc)])
