"""The Python state a traced training step depends on: snapshots, guards, and refusals.

NOTE [Python state of a traced step]
``make_fx`` runs the step's Python code once and keeps only the tensor ops, so
every Python value the step reads becomes a constant of the graph: a module
attribute the forward reads (``self.temperature``), an optimizer's
hyperparameters (``lr``), the hooks registered on parameters and modules.
Such state is guarded: :func:`snapshot` records, before a trace, every plain
value (numbers, strings, ``None``, dtypes, devices, enums, and tuples, lists
and dicts of them) in each module's ``__dict__``, each optimizer's param
groups, and the ids of the hooks on modules and parameters; the snapshot is
part of the cache key, so a call that finds any of it changed traces again (as
stock ``torch.compile`` recompiles on a failed guard).  Non-plain attributes
(an arbitrary object) are not guarded; they are logged at debug level.

Python state the step *changes* while it is traced (an LR scheduler's
``step()`` inside the step, a counter on a module) would change once, at
trace time, and never on later calls that run the graph: :func:`refuse_changes`
compares the snapshots before and after the trace and raises a ``ValueError``
naming each change.

Hooks registered with ``register_hook`` on a parameter run inside the traced
backward on the local gradient before it is accumulated, as they run under
DDP before its all-reduce (:func:`pre_hooks`).  Hooks registered with
``register_post_accumulate_grad_hook`` would run on the local accumulated
gradient at a point with no DDP counterpart (optimizer-in-backward): they are
refused (:func:`refuse_post_accumulate_hooks`).

A value read from a tensor into Python (``.item()``: ``aten._local_scalar_dense``
in the graph) would be the first call's value forever: refused
(:func:`refuse_local_scalars`), naming the optimizer when it is an optimizer's
step count (Adam and AdamW on CPU).
"""

from __future__ import annotations

import enum
import gc
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from .. import _compat

log = logging.getLogger(__name__)

_SKIP = object()
_SCALARS = frozenset({type(None), bool, int, float, str})
_MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# nn.Module bookkeeping that holds no Python value the graph reads (tensors and submodules are inputs or walked).
_MODULE_NOT_STATE = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)


def _plain(value: Any, tensors: bool = False) -> Any:
    """A hashable, comparable form of a plain value, or ``_SKIP`` for anything else (tensors too, unless ``tensors``)."""
    if type(value) in _SCALARS or isinstance(value, bool | int | float | complex | str | bytes | enum.Enum):
        return repr(value)  # repr: 1 and True differ, nan equals nan
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, tuple | list):
        items = [_plain(v, tensors) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else (type(value).__name__, tuple(items))
    if isinstance(value, set | frozenset):
        items = [_plain(v, tensors) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else ("set", tuple(sorted(items, key=repr)))
    if isinstance(value, dict):
        items = [(_plain(k), _plain(v, tensors)) for k, v in value.items()]
        return _SKIP if any(_SKIP in kv for kv in items) else ("dict", tuple(items))
    if isinstance(value, torch.Tensor) and tensors:
        return repr(value)  # a tensor hyperparameter (lr as a tensor): its value is baked too
    return _SKIP


def snapshot(
    modules: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor]
) -> tuple[tuple[tuple[Any, ...], Any], ...]:
    """``(what, value)`` for every plain value the traced step may depend on (NOTE [Python state of a traced step]).

    ``what`` is a tuple that :func:`describe` turns into words for messages, e.g.
    ``"attribute 'temperature' of module 0 (Net)"`` (formatted only then: this runs at every call).
    """
    out: list[tuple[tuple[Any, ...], Any]] = []
    debug = log.isEnabledFor(logging.DEBUG)
    skipped: list[str] = []
    for i, top in enumerate(modules):
        kind = type(top).__name__
        for name, m in top.named_modules(remove_duplicate=False):
            for k, v in vars(m).items():
                if k in _MODULE_NOT_STATE:
                    continue
                if k in _MODULE_HOOK_DICTS:
                    out.append((("hooks", i, kind, name, k), tuple(v)))  # hook handle ids
                    continue
                value = _plain(v)
                if value is _SKIP:
                    if debug and not k.startswith("_"):
                        skipped.append(f"{_where(i, kind, name)}.{k} ({type(v).__name__})")
                    continue
                out.append((("attribute", i, kind, name, k), value))
    for i, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            for k, v in group.items():
                if k != "params":
                    out.append((("group", i, type(opt).__name__, g, k), _plain(v, True)))
    for j, p in enumerate(params):
        pre, post = _compat.tensor_hooks(p)
        if pre or post:
            out.append((("param hooks", j, tuple(p.shape)), (tuple(pre), tuple(post))))
    if skipped:
        log.debug("data_parallel: not guarded (not plain values): %s", ", ".join(skipped))
    return tuple(out)


def _where(i: int, kind: str, name: str) -> str:
    return f"module {i} ({kind}){'.' + name if name else ''}"


def describe(what: tuple[Any, ...]) -> str:
    """A snapshot entry's ``what`` in words."""
    kind = what[0]
    if kind == "attribute":
        return f"attribute {what[4]!r} of {_where(*what[1:4])}"
    if kind == "hooks":
        return f"{what[4]} of {_where(*what[1:4])}"
    if kind == "group":
        return f"{what[4]!r} of param group {what[3]} of optimizer {what[1]} ({what[2]})"
    if kind == "param hooks":
        return f"hooks of parameter {what[1]} (shape {what[2]})"
    return f"attribute {what[3]!r} of LR scheduler {what[1]} ({what[2]})"


def schedulers(optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
    """The LR schedulers (``torch.optim.lr_scheduler.LRScheduler``) attached to ``optimizers``, wherever they live.

    Found through the garbage collector's referrers of the optimizers (a scheduler holds its optimizer), since
    a step function reaches its scheduler through a closure or a global, not through its arguments.
    """
    if not optimizers:
        return []
    from torch.optim.lr_scheduler import LRScheduler

    ids = {id(o) for o in optimizers}
    found: dict[int, Any] = {}
    holders = gc.get_referrers(*optimizers)
    dicts = [r for r in holders if isinstance(r, dict)]
    for r in [*holders, *(gc.get_referrers(*dicts) if dicts else [])]:
        if isinstance(r, LRScheduler) and id(getattr(r, "optimizer", None)) in ids:
            found[id(r)] = r
    return list(found.values())


def scheduler_snapshot(found: Sequence[Any]) -> tuple[tuple[tuple[Any, ...], Any], ...]:
    """``(what, value)`` for the plain attributes of each scheduler of :func:`schedulers` (its epoch, step count)."""
    out = []
    for i, sched in enumerate(found):
        for k, v in vars(sched).items():
            value = _plain(v)
            if value is not _SKIP:
                out.append((("scheduler", i, type(sched).__name__, k), value))
    return tuple(out)


def changes(before: Sequence[tuple[tuple[Any, ...], Any]], after: Sequence[tuple[tuple[Any, ...], Any]]) -> list[str]:
    """What differs between two snapshots, one line each (``what: old -> new``)."""
    old, new = dict(before), dict(after)
    lines = []
    for what in dict.fromkeys([*old, *new]):
        if old.get(what, _SKIP) != new.get(what, _SKIP):
            lines.append(f"{describe(what)}: {_show(old.get(what, _SKIP))} -> {_show(new.get(what, _SKIP))}")
    return lines


def _show(value: Any) -> str:
    if value is _SKIP:
        return "(absent)"
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], tuple):
        return f"{value[0]} {tuple(_show(v) for v in value[1])}"
    return value if isinstance(value, str) else repr(value)


def refuse_changes(before: Sequence[tuple[tuple[Any, ...], Any]], after: Sequence[tuple[tuple[Any, ...], Any]]) -> None:
    """Raise if tracing the step changed Python state (see NOTE [Python state of a traced step]).

    Raises:
        ValueError: naming each changed value, old and new.
    """
    diff = changes(before, after)
    if diff:
        raise ValueError(
            "the step changed Python state while data_parallel traced it:\n  "
            + "\n  ".join(diff[:8])
            + "\ndata_parallel runs the step's Python code once, to trace it; later calls run the traced graph, "
            "so this change would happen once instead of at every step (an LR scheduler's step() inside the step "
            "function, a counter kept on a module). Make the change outside the step function, between calls "
            "(e.g. scheduler.step() after step(...)): a changed hyperparameter or module attribute is guarded, "
            "the step is traced again for the new value."
        )


def refuse_post_accumulate_hooks(params: Sequence[torch.Tensor]) -> None:
    """Raise if a parameter has a ``register_post_accumulate_grad_hook`` hook.

    Raises:
        ValueError: naming the parameter's index and shape.
    """
    for j, p in enumerate(params):
        if _compat.tensor_hooks(p)[1]:
            raise ValueError(
                f"parameter {j} (shape {tuple(p.shape)}) has a hook registered with "
                "register_post_accumulate_grad_hook; data_parallel does not run such hooks (they would see the "
                "local gradient, which DDP averages at that point). Do that work in the step function after "
                "loss.backward() (it reads the averaged .grad there), or use register_hook, which data_parallel "
                "runs on the local gradient as DDP does."
            )


def pre_hooks(p: torch.Tensor) -> list[Any]:
    """The ``register_hook`` hooks of parameter ``p``, in registration order (registered on its traced stand-in)."""
    return list(_compat.tensor_hooks(p)[0].values())


def _aliased_input(node: torch.fx.Node) -> torch.fx.Node:
    """Follow in-place ops and views (their first argument aliases their result) back to where a value starts."""
    for _ in range(64):
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.arguments or not node.args:
            break
        if schema.arguments[0].alias_info is None or not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
    return node


def refuse_local_scalars(gm: torch.fx.GraphModule, step: Any) -> None:
    """Raise when the traced step reads a tensor's value into Python (``aten._local_scalar_dense``).

    ``step`` is the call's :class:`.step_trace.StepArgs`.

    Raises:
        ValueError: naming the node, and the optimizer and its state when the value is optimizer state
            (Adam's CPU step count), with what to do.
    """
    reads = [n for n in gm.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default]
    if not reads:
        return
    node = reads[0]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    source = _aliased_input(node.args[0]) if node.args and isinstance(node.args[0], torch.fx.Node) else node
    first_state = len(step.params) + len(step.buffers)
    index = placeholders.index(source) if source in placeholders else -1
    if first_state <= index < step.num_fixed:
        i, _, key = step.state_slots[index - first_state]
        name = type(step.optimizers[i]).__name__
        raise ValueError(
            f"optimizer {i} ({name}) reads its state {key!r}, a CPU tensor, into Python with .item() (node "
            f"{node.name!r}); a traced graph cannot hold a Python number that changes at every step. {name} keeps "
            "its step count on the device only with capturable=True, which needs parameters on a CUDA, XPU or "
            "HPU device. On CPU, call optimizer.step() outside the step function (a step that ends with "
            "loss.backward() leaves the averaged gradients in .grad), or use an optimizer without a step "
            "count (SGD)."
        )
    raise ValueError(
        f"the step reads a tensor's value into Python (node {node.name!r}: .item(), .tolist(), float(t), "
        "int(t), or a Python condition on a tensor); a traced graph would keep the value of the first call as "
        "a constant. Keep the value a tensor (torch.where instead of an if, tensor arithmetic instead of "
        "Python numbers), or compute it outside the step function."
    )
