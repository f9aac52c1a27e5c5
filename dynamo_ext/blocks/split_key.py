"""What a submodule of the block split is keyed by: two submodules with equal keys share one compile
(NOTE [blocks compiled once] in :mod:`.split`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .. import _compat
from ..fx.ops import target_name
from .symbols import canonical_names, input_symbols, size_key, symbol_facts

_VALUE_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _constant_key(value: Any, names: dict[Any, Any] | None = None) -> Any:
    """A value of a node's arguments as a key: by value for plain data, placements and device meshes, a symbolic
    one by its expression (its symbols renamed by ``names``), by identity otherwise (a function, a process
    group, a module: equal only when the same object)."""
    if isinstance(value, torch.fx.Node):
        raise AssertionError("nodes are keyed by position")
    if isinstance(value, _VALUE_TYPES):
        return (type(value).__name__, value)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_constant_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _constant_key(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _constant_key((value.start, value.stop, value.step)))
    if isinstance(value, torch._ops.OpOverload | torch._ops.OpOverloadPacket | torch._ops.HigherOrderOperator):
        return ("op", str(value))
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        key = size_key(value, names)
        return ("symbolic", id(value)) if key is None else key  # an unbacked value: equal only to itself
    if _compat.is_placement(value):
        return ("placement", repr(value))
    if _compat.is_device_mesh(value):
        return ("mesh", value)
    return ("object", type(value).__qualname__, id(value))


def _function_key(fn: Any) -> Any:
    """A call target as a key: a closure by its code, defaults and the objects its cells hold (compiled
    autograd makes one ``call_aot_bwd_prologue`` closure per AOTAutograd backward it copies, over the same
    compiled function's prologue), any other callable by identity."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return id(fn)
    try:
        held = tuple(id(c.cell_contents) for c in cells)
    except ValueError:  # an empty cell
        return id(fn)
    return (id(code), held, id(fn.__defaults__), id(fn.__kwdefaults__), id(fn.__globals__))


def _tensor_key(value: Any, names: dict[Any, Any] | None = None) -> Any:
    if not isinstance(value, torch.Tensor):
        return _constant_key(value, names)
    shape = tuple(size_key(s, names) for s in value.shape)
    stride = tuple(size_key(s, names) for s in value.stride())
    offset = size_key(value.storage_offset(), names)
    if None in (*shape, *stride, offset):
        return ("symbolic", id(value))  # an unbacked size: this input is its own, the submodule compiled alone
    spec = _compat.dtensor_spec_key(value)
    return (
        type(value).__qualname__,
        shape,
        stride,
        offset if spec is None else None,
        value.dtype,
        value.device,
        value.requires_grad and torch.is_grad_enabled(),  # AOTAutograd differentiates only under grad mode
        spec,
    )


def _graph_key(gm: torch.fx.GraphModule, *, output: bool = True) -> tuple[Any, ...]:
    index: dict[torch.fx.Node, int] = {}
    out: list[Any] = []

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return ("node", index[a])
        if isinstance(a, list | tuple):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        return _constant_key(a)

    for n in gm.graph.nodes:
        index[n] = len(index)
        if n.op == "output" and not output:
            break
        if n.op in ("get_attr", "call_module"):
            sub = gm.get_submodule(str(n.target)) if n.op == "call_module" else getattr(gm, str(n.target))
            if isinstance(sub, torch.fx.GraphModule):
                target = ("graph", _graph_key(sub))
            elif isinstance(sub, torch.Tensor):
                target = ("tensor", id(sub))
            else:
                target = ("object", id(sub))
        elif n.op == "placeholder":
            target = None
        else:
            target = (
                ("fn", _function_key(n.target), target_name(n.target)) if callable(n.target) else ("name", n.target)
            )
        out.append((n.op, target, arg(n.args), arg(n.kwargs)))
    return tuple(out)


def ops_key(gm: torch.fx.GraphModule) -> tuple[Any, ...]:
    """A graph's nodes as a key (ops, targets, constants, bodies), what it returns left out: equal for two
    submodules that compute the same values in the same way, whatever their inputs."""
    return _graph_key(gm, output=False)


def structural_key(gm: torch.fx.GraphModule, inputs: list[Any]) -> tuple[Any, ...]:
    """What a compiled submodule depends on: its graph (ops, targets, constants, bodies) and its inputs'
    metadata (type, shape, stride, dtype, device, ``requires_grad``, a DTensor's mesh and placements) and which
    of them share storage.  Two submodules with equal keys compute the same function of their inputs.

    Size symbols are named by their order among the inputs, with their value ranges (NOTE [blocks that
    differ only in their size symbols]): two keys may be equal for inputs with other symbols, which
    :func:`compile_blocks` shares only after :func:`.symbols.carry_guards`."""
    storages: dict[Any, int] = {}
    alias: list[Any] = []
    for x in inputs:
        if not isinstance(x, torch.Tensor):
            alias.append(None)
            continue
        try:
            storage = _compat.local_tensor_of(x).untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # no storage (a sparse or nested tensor): its own
            storage = ("own", id(x))
        alias.append(storages.setdefault(storage, len(storages)))
    symbols = input_symbols(inputs)
    names = canonical_names(symbols)
    return (
        _graph_key(gm),
        tuple(_tensor_key(x, names) for x in inputs),
        tuple(alias),
        symbol_facts(inputs, symbols),
    )
