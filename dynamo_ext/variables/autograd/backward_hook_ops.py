"""Module full backward hooks run by the eager autograd engine from a compiled graph.

NOTE [module backward hooks without compiled autograd]
Eager ``nn.Module.__call__`` wraps a hooked module's positional tensor inputs
and its outputs in ``BackwardHookFunction`` (torch/utils/hooks.py,
``BackwardHook``).  When the gradient reaches the outputs, the backward
pre-hooks run on ``grad_output`` (a returned tuple replaces it); when it
reaches the inputs, the full backward hooks run on ``(grad_input,
grad_output)`` (a returned tuple replaces ``grad_input``).  Stock Dynamo
can only express that under compiled autograd and breaks the graph otherwise.

We put the same two identity points in the forward graph: :class:`HookOutputs`
on the module's outputs and :class:`HookInputs` on its inputs, each an
``autograd.Function`` whose forward is a view and whose backward calls the
opaque custom op ``dynamo_ext::run_module_hooks``.  AOTAutograd traces the
backward into the compiled backward graph with that op in it; at run time the
op looks the module up by its call site and calls the module's hooks *as they
are registered then*, eagerly, with the real gradients.  So the hooks' side
effects (prints, collectives, counters) and values are eager's, every backward.

Between the two points the ``grad_output`` a pre-hook produced waits in
:data:`_PENDING`, keyed by call site: within one backward pass the module's
input point always runs after its output point (the input gradient depends on
the output gradient), as in eager.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import warnings
import weakref
from typing import Any

import torch

log = logging.getLogger(__name__)

NAMESPACE = "dynamo_ext"
OP_NAME = "run_module_hooks"
PHASE_OUTPUTS = 0  # gradient reached the module's outputs: backward pre-hooks
PHASE_INPUTS = 1  # gradient reached the module's inputs: full backward hooks


@dataclasses.dataclass
class HookSite:
    """One traced call of a hooked module: where its tensors sit among its arguments and results.

    ``input_idx`` / ``output_idx`` are the positions of the tensors among the
    positional arguments / the result tuple (``None``: no hook point there, as
    eager's ``BackwardHook`` when no tensor requires grad).
    """

    site_id: int
    module: weakref.ref[torch.nn.Module]
    n_inputs: int = 0
    input_idx: tuple[int, ...] | None = None
    n_outputs: int = 0
    output_idx: tuple[int, ...] | None = None


_SITES: dict[int, HookSite] = {}
_PENDING: dict[int, tuple[Any, ...]] = {}
_site_ids = itertools.count()
_lib: Any = None


def new_site(module: torch.nn.Module) -> int:
    """Register a call site of ``module`` (at trace time); return its id."""
    site = next(_site_ids)
    # Sites of freed modules can never run hooks again (run_module_hooks treats a missing site as
    # a freed module): drop them, so the table holds one entry per live traced call site.
    for dead in [k for k, v in _SITES.items() if v.module() is None]:
        del _SITES[dead]
    _SITES[site] = HookSite(site, weakref.ref(module))
    return site


def site(site_id: int) -> HookSite:
    """The :class:`HookSite` with this id."""
    return _SITES[site_id]


def _pack(indices: tuple[int, ...], values: list[Any], size: int) -> tuple[Any, ...]:
    out: list[Any] = [None] * size
    for i, v in zip(indices, values, strict=True):
        out[i] = v
    return tuple(out)


def _checked(new: Any, old: torch.Tensor, what: str, i: int) -> torch.Tensor:
    """``new`` as the replacement of gradient ``old``, or a RuntimeError saying why it cannot be."""
    if new is None:
        raise RuntimeError(
            f"A module backward hook returned None for {what}[{i}], whose gradient is defined. "
            "dynamo-ext runs module hooks inside a compiled backward graph (no compiled autograd), "
            "where a gradient cannot be dropped: return zeros instead, or enable compiled autograd "
            "(torch._dynamo.config.compiled_autograd = True before torch.compile)."
        )
    if not isinstance(new, torch.Tensor):
        raise TypeError(f"A module backward hook returned {type(new).__name__} for {what}[{i}]; expected a Tensor")
    if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
        raise RuntimeError(
            f"A module backward hook returned {what}[{i}] of shape {tuple(new.shape)}, dtype {new.dtype}, "
            f"device {new.device}; expected shape {tuple(old.shape)}, dtype {old.dtype}, device {old.device}"
        )
    return new


def _fresh(out: list[torch.Tensor], ins: list[torch.Tensor]) -> list[torch.Tensor]:
    # A custom op may not return its own inputs (AOTAutograd and Inductor assume no aliasing).
    ptrs = {t.untyped_storage().data_ptr() for t in ins if t.numel()}
    return [t.clone() if t.numel() and t.untyped_storage().data_ptr() in ptrs else t for t in out]


def _run_pre_hooks(s: HookSite, module: torch.nn.Module, defined: list[int], grads: list[torch.Tensor]) -> list:
    assert s.output_idx is not None
    flat: list[Any] = [None] * len(s.output_idx)
    for pos, g in zip(defined, grads, strict=True):
        flat[pos] = g
    grad_outputs = _pack(s.output_idx, flat, s.n_outputs)
    for hook in module._get_backward_pre_hooks():
        new = hook(module, grad_outputs)
        if new is None:
            continue
        if len(new) != len(grad_outputs):
            raise RuntimeError(
                "Backward pre hook returned an invalid number of grad_output, "
                f"got {len(new)}, but expected {len(grad_outputs)}"
            )
        grad_outputs = tuple(new)
    if s.input_idx is None:
        # As eager: no input requires grad, so the full hooks fire here with grad_input all None.
        warnings.warn(
            "Full backward hook is firing when gradients are computed with respect to module outputs "
            "since no inputs require gradients. See "
            "https://docs.pytorch.org/docs/main/generated/torch.nn.Module.html#torch.nn.Module.register_full_backward_hook "
            "for more details.",
            stacklevel=2,
        )
        grad_inputs = (None,) * s.n_inputs
        for hook in module._get_backward_hooks()[0]:
            res = hook(module, grad_inputs, grad_outputs)
            if res is not None and not (isinstance(res, tuple) and all(el is None for el in res)):
                raise RuntimeError(
                    "Backward hook for Modules where no input requires gradient should always "
                    "return None or None for all gradients."
                )
    else:
        _PENDING[s.site_id] = grad_outputs
    return [_checked(grad_outputs[s.output_idx[p]], g, "grad_output", s.output_idx[p]) for p, g in zip(defined, grads)]


def _run_full_hooks(s: HookSite, module: torch.nn.Module, defined: list[int], grads: list[torch.Tensor]) -> list:
    assert s.input_idx is not None
    grad_outputs = _PENDING.pop(s.site_id, None)
    if grad_outputs is None:  # gradient reached the inputs without passing the outputs (eager: no call)
        return grads
    res = _pack(s.input_idx, grads, s.n_inputs)
    for hook in module._get_backward_hooks()[0]:
        out = hook(module, res, grad_outputs)
        if out is None:
            continue
        if len(out) != len(res):
            raise RuntimeError(
                f"Backward hook returned an invalid number of grad_input, got {len(out)}, but expected {len(res)}"
            )
        res = tuple(out)
    # What a hook returns for an input that does not require grad is dropped, as in eager.
    keep = set(defined)
    return [
        _checked(res[i], g, "grad_input", i) if p in keep else g for p, (i, g) in enumerate(zip(s.input_idx, grads))
    ]


def run_module_hooks(site_id: int, phase: int, defined: list[int], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Eager body of ``dynamo_ext::run_module_hooks``: call the module's current hooks on ``grads``.

    At the outputs (``phase`` 0) ``grads`` are the defined gradients and
    ``defined`` their positions among the outputs' tensors; at the inputs
    (``phase`` 1) ``grads`` are all the inputs' gradients (zeros where none
    arrived, as eager) and ``defined`` the positions of inputs that require grad.  Returns the gradients to pass on
    (same shapes, dtypes and devices), fresh tensors where a hook kept one.
    """
    s = _SITES.get(site_id)
    module = s.module() if s is not None else None
    # module freed or plugin uninstalled: hooks cannot run (eager would not have them either)
    if s is None or module is None:
        return [g.clone() for g in grads]
    if phase == PHASE_OUTPUTS:
        out = _run_pre_hooks(s, module, list(defined), list(grads))
    else:
        out = _run_full_hooks(s, module, list(defined), list(grads))
    return _fresh(list(out), list(grads))


def _fake_run_module_hooks(site_id: int, phase: int, defined: list[int], grads: list[torch.Tensor]) -> list:
    return [torch.empty_like(g) for g in grads]


def _call_op(site_id: int, phase: int, defined: list[int], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return torch.ops.dynamo_ext.run_module_hooks(site_id, phase, defined, grads)


def _identity(ctx: Any, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    # Views, as autograd makes of inputs a Function returns; eager's BackwardHookFunction marks
    # the ones whose input does not require grad non-differentiable.
    outs = tuple(t.view_as(t) for t in tensors)
    ctx.mark_non_differentiable(*[o for o, t in zip(outs, tensors) if not t.requires_grad])
    return outs


class HookOutputs(torch.autograd.Function):
    """Identity on a hooked module's output tensors; backward runs the backward pre-hooks."""

    @staticmethod
    def forward(ctx: Any, site_id: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.site_id = site_id
        ctx.set_materialize_grads(False)  # eager's pre-hooks see None for outputs that got no gradient
        return _identity(ctx, tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        defined = [i for i, g in enumerate(grads) if g is not None]
        new = _call_op(ctx.site_id, PHASE_OUTPUTS, defined, [g for g in grads if g is not None])
        out: list[Any] = [None] * len(grads)
        for i, g in zip(defined, new):
            out[i] = g
        return (None, *out)


class HookInputs(torch.autograd.Function):
    """Identity on a hooked module's positional input tensors; backward runs the full backward hooks."""

    @staticmethod
    def forward(ctx: Any, site_id: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.site_id = site_id
        ctx.differentiable = [i for i, t in enumerate(tensors) if t.requires_grad]
        return _identity(ctx, tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        # Materialized like eager's BackwardHookFunction: zeros where no gradient arrived.
        new = _call_op(ctx.site_id, PHASE_INPUTS, ctx.differentiable, list(grads))
        return (None, *new)


def hook_outputs(site_id: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The graph call on a hooked module's output tensors (see NOTE above)."""
    return HookOutputs.apply(site_id, *tensors)


def hook_inputs(site_id: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The graph call on a hooked module's positional input tensors (see NOTE above)."""
    return HookInputs.apply(site_id, *tensors)


def define_ops() -> None:
    """Define ``dynamo_ext::run_module_hooks`` (idempotent); :func:`undefine_ops` removes it."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # noqa: TOR901
    lib.define(f"{OP_NAME}(int site, int phase, int[] defined, Tensor[] grads) -> Tensor[]")
    lib.impl(OP_NAME, run_module_hooks, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{OP_NAME}", _fake_run_module_hooks, lib=lib)
    _lib = lib


def undefine_ops() -> None:
    """Remove the op and forget every call site (``uninstall()``)."""
    global _lib
    if _lib is not None:
        _lib._destroy()
        _lib = None
    _SITES.clear()
    _PENDING.clear()
