"""The numerics check: one training step compiled and the same step eagerly, from the same state, compared.

NOTE [step protocol]
A target exposes "a step" with a module-level ``make_step()`` (next to the
``module:function`` target's function, or at the top level of a target
script) returning :class:`Step`, or a ``(model, optimizer, step)`` triple
(``(model, optimizer, step, lr_scheduler)``):

- ``model``: the ``nn.Module`` whose parameters the step trains (FSDP2 /
  DTensor parameters are fine: their local shards are compared);
- ``optimizer``: a ``torch.optim.Optimizer`` over them, or ``None``;
- ``step(compiled: bool)``: runs the forward, the loss and ``backward()`` once,
  through ``torch.compile`` (and compiled autograd, if the target uses it) when
  ``compiled`` is true and eagerly otherwise, and returns the loss or a
  (nested) dict / list / tuple of tensors (the outputs to compare, by path:
  ``"loss"``, ``"out[0]"``, ``"logits"``).  It must not call the optimizer;
- ``lr_scheduler`` (optional): stepped after each optimizer step, saved and
  restored with the rest (anything with ``step()``, ``state_dict()`` and
  ``load_state_dict()``);
- ``tolerances`` (optional): ``{pattern: (rtol, atol)}`` for the tensors whose
  compiled values the target knows to differ from eager's (a fused eager kernel
  whose compiled decomposition sums in another order), matched with ``fnmatch``
  against ``"<kind>:<name>"`` (``"grad:*norm.weight"``, ``"param:*"``,
  ``"output:loss"``), the first match wins; ``--rtol``/``--atol`` replace them all.

A training step is ``step(compiled)``, ``optimizer.step()``, ``lr_scheduler.step()``
(:func:`run_step`).  :func:`check_step` saves the parameters' and buffers' local
values, the optimizer's and scheduler's state and the RNG state (:mod:`.state`,
NOTE [one build, saved state]), runs the eager training step, restores them,
runs the compiled one, and compares, in this order,
the outputs, the gradients (before the optimizer step; type and DTensor
placements, then local values) and the parameters after the optimizer step.
Tensors are equal when ``torch.testing.assert_close`` would call them equal
with the given ``rtol``/``atol`` (default: its per-dtype defaults).

NOTE [the target's own check]
A target script often checks its step itself (``main()`` calls
:func:`check_step` and raises on a mismatch, as the examples do).  Under
``--check-numerics`` the audit observes those calls (:func:`observe_checks`)
and reports their results instead of building the step again with
``make_step()``: the compiled step it checked is then the audited one, and the
model is compiled once, not twice.  The observed eager step's collectives are
counted as :func:`.eager_comm.eager_counted_step` counts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Step:
    """What ``make_step()`` returns (see NOTE [step protocol]); ``lr_scheduler`` is optional."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    step: Callable[[bool], Any]
    lr_scheduler: Any = None
    tolerances: Mapping[str, tuple[float, float]] | None = None


MakeStepResult = Step | tuple[nn.Module, torch.optim.Optimizer | None, Callable[[bool], Any]]
"""What a ``make_step()`` returns: a :class:`Step`, or its ``(model, optimizer, step[, lr_scheduler])`` tuple."""


def is_step(obj: Any) -> bool:
    """Whether ``obj`` is what a ``make_step()`` returns (a :class:`Step`, or a tuple :func:`as_step` takes)."""
    return isinstance(obj, Step) or (
        isinstance(obj, tuple) and len(obj) in (3, 4) and isinstance(obj[0], nn.Module) and callable(obj[2])
    )


def as_step(obj: Any) -> Step:
    """A :class:`Step` from ``make_step()``'s result (a ``Step``, or a ``(model, optimizer, step[, lr_scheduler])``
    tuple).

    Raises:
        TypeError: ``obj`` is neither, or its parts have the wrong types.
    """
    if not isinstance(obj, Step):
        if not (isinstance(obj, (tuple, list)) and len(obj) in (3, 4)):
            raise TypeError(
                f"make_step() must return dynamo_ext.audit.Step or a (model, optimizer, step[, lr_scheduler]) "
                f"tuple, got {type(obj).__name__}"
            )
        obj = Step(*obj)
    if not isinstance(obj.model, nn.Module):
        raise TypeError(f"make_step(): model must be a torch.nn.Module, got {type(obj.model).__name__}")
    if obj.optimizer is not None and not isinstance(obj.optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"make_step(): optimizer must be a torch.optim.Optimizer or None, got {type(obj.optimizer).__name__}"
        )
    if not callable(obj.step):
        raise TypeError(f"make_step(): step must be callable as step(compiled: bool), got {type(obj.step).__name__}")
    missing = [m for m in ("step", "state_dict", "load_state_dict") if not callable(getattr(obj.lr_scheduler, m, None))]
    if obj.lr_scheduler is not None and missing:
        raise TypeError(
            f"make_step(): lr_scheduler must have step(), state_dict() and load_state_dict() (a "
            f"torch.optim.lr_scheduler.LRScheduler or a container like it), got {type(obj.lr_scheduler).__name__} "
            f"without {', '.join(missing)}()"
        )
    for pattern, tol in (obj.tolerances or {}).items():
        if not (isinstance(pattern, str) and isinstance(tol, tuple) and len(tol) == 2 and all(t >= 0 for t in tol)):
            raise TypeError(
                f"make_step(): tolerances must map a pattern such as 'grad:*norm.weight' to (rtol, atol), two "
                f"numbers >= 0; got {pattern!r}: {tol!r}"
            )
    return obj


def tolerance(
    kind: str, name: str, rtol: float | None, atol: float | None, tolerances: Mapping[str, tuple[float, float]] | None
) -> tuple[float | None, float | None]:
    """The ``(rtol, atol)`` a tensor is compared with: ``rtol``/``atol`` when given, else the first of the target's
    ``tolerances`` whose pattern matches ``"<kind>:<name>"`` (NOTE [step protocol]), else ``(None, None)``
    (``torch.testing.assert_close``'s per-dtype defaults)."""
    if rtol is not None or atol is not None:
        return rtol, atol
    for pattern, (r, a) in (tolerances or {}).items():
        if fnmatch.fnmatchcase(f"{kind}:{name}", pattern):
            return r, a
    return None, None


def described_tolerances(tolerances: Mapping[str, tuple[float, float]] | None) -> list[str]:
    """The target's tolerances in words, for the report (``"grad:*norm.weight: rtol 0, atol 0.0001"``)."""
    return [f"{p}: rtol {r:g}, atol {a:g}" for p, (r, a) in (tolerances or {}).items()]


def _flatten(out: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(out, torch.Tensor):
        yield path or "loss", out
    elif isinstance(out, dict):
        for k, v in out.items():
            yield from _flatten(v, f"{path}.{k}" if path else str(k))
    elif isinstance(out, (list, tuple)):
        for i, v in enumerate(out):
            yield from _flatten(v, f"{path or 'out'}[{i}]")
    elif hasattr(out, "to_tuple"):  # transformers' ModelOutput
        yield from _flatten(dict(out.items()) if hasattr(out, "items") else out.to_tuple(), path)


def _describe(t: torch.Tensor) -> tuple[str, tuple[Any, ...], torch.Tensor]:
    """(type name, DTensor placements or (), local tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return "DTensor", tuple(t.placements), t.to_local()
    return type(t).__name__, (), t


def compare(name: str, kind: str, eager: Any, compiled: Any, rtol: float | None, atol: float | None) -> dict | None:
    """``None`` when equal; else a mismatch record (``max_abs``/``max_rel`` over the local values)."""
    if eager is None or compiled is None:
        if eager is None and compiled is None:
            return None
        return {"kind": kind, "name": name, "detail": f"eager {_kind(eager)}, compiled {_kind(compiled)}",
                "max_abs": None, "max_rel": None}  # fmt: skip
    te, pe, le = _describe(eager)
    tc, pc, lc = _describe(compiled)
    if te != tc or pe != pc:
        return {"kind": kind, "name": name, "detail": f"eager {te}{list(pe) if pe else ''}, compiled {tc}{list(pc) if pc else ''}",
                "max_abs": None, "max_rel": None}  # fmt: skip
    if le.shape != lc.shape or le.dtype != lc.dtype:
        return {"kind": kind, "name": name,
                "detail": f"eager {le.dtype}{list(le.shape)}, compiled {lc.dtype}{list(lc.shape)}",
                "max_abs": None, "max_rel": None}  # fmt: skip
    le, lc = le.detach(), lc.detach()
    try:
        torch.testing.assert_close(lc, le, rtol=rtol, atol=atol, equal_nan=True)
        return None
    except AssertionError:
        pass
    a, b = le.double(), lc.double()
    diff = (a - b).abs()
    finite = torch.isfinite(diff)
    max_abs = float(diff[finite].max()) if finite.any() else None
    rel = diff / a.abs().clamp_min(torch.finfo(torch.float64).tiny)
    max_rel = float(rel[finite].max()) if finite.any() else None
    return {"kind": kind, "name": name, "detail": f"{le.dtype}{list(le.shape)}", "max_abs": max_abs, "max_rel": max_rel}


def _kind(x: Any) -> str:
    return "None" if x is None else type(x).__name__


Run = tuple[list[tuple[str, Any]], list[tuple[str, Any]], list[tuple[str, Any]]]
"""One step's (outputs, gradients, parameters after the optimizer step), by name, as :func:`run_step` captured them."""


def run_step(spec: Step, compiled: bool, *, capture: bool = True) -> Run | None:
    """One training step: ``spec.step(compiled)``, then the optimizer's and the LR scheduler's step.

    Gradients are cleared first.  With ``capture``, returns copies of the outputs, the gradients after
    ``step`` (before the optimizer) and the parameters after the optimizer step; else ``None``.
    """
    for p in spec.model.parameters():
        p.grad = None
    out = spec.step(compiled)
    named = list(spec.model.named_parameters()) if capture else []
    outputs = [(n, t.detach().clone()) for n, t in _flatten(out)] if capture else []
    grads = [(n, None if p.grad is None else p.grad.detach().clone()) for n, p in named]
    if spec.optimizer is not None:
        spec.optimizer.step()
        spec.optimizer.zero_grad(set_to_none=True)
    if spec.lr_scheduler is not None:
        spec.lr_scheduler.step()
    if not capture:
        return None
    return outputs, grads, [(n, p.detach().clone()) for n, p in named]


def compare_runs(
    eager: list[Run],
    compiled: list[Run],
    rtol: float | None,
    atol: float | None,
    *,
    first: int = 1,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """Compare the eager and compiled runs of the same steps, step by step: ``{"compared", "mismatches"}``.

    Each mismatch has ``index`` (its position in the comparison order: step by step, outputs, then gradients,
    then parameters) and, when more than one step was compared, ``step`` (the first is number ``first``).
    Tolerances: :func:`tolerance`.
    """
    mismatches: list[dict[str, Any]] = []
    compared = 0
    for number, (e_run, c_run) in enumerate(zip(eager, compiled, strict=True), first):
        for kind, e_list, c_list in zip(("output", "grad", "param"), e_run, c_run):
            e_map, c_map = dict(e_list), dict(c_list)
            for name in list(e_map) + [n for n in c_map if n not in e_map]:
                compared += 1
                r, a = tolerance(kind, name, rtol, atol, tolerances)
                m = compare(name, kind, e_map.get(name), c_map.get(name), r, a)
                if m is not None:
                    mismatches.append({"index": compared - 1, **({"step": number} if len(eager) > 1 else {}), **m})
    return {"compared": compared, "mismatches": mismatches}


def check_step(spec: Step, *, rtol: float | None = None, atol: float | None = None) -> dict[str, Any]:
    """Run ``spec``'s step eagerly and compiled from the same state and compare (see NOTE [step protocol]).

    Returns ``{"compared": int, "mismatches": [{"index", "kind": "output"|"grad"|"param", "name", "detail",
    "max_abs", "max_rel"}]}`` in comparison order (the first is the first tensor that differs; ``index``
    its position in that order).  ``max_abs``/``max_rel`` are ``None`` when the two are not comparable
    (a type, placement, shape or dtype differs, or one is missing; ``detail`` says which) or not finite.
    The model and optimizer are left in the state after the compiled step.

    Raises:
        ValueError: ``rtol`` and ``atol`` not given together (as ``torch.testing.assert_close``).
        Whatever ``step`` raises.
    """
    if (rtol is None) != (atol is None):
        raise ValueError("give both rtol and atol, or neither (the per-dtype defaults of torch.testing.assert_close)")
    eager_comm: dict[str, Any] = {}
    if _OBSERVERS:  # NOTE [the target's own check]
        from .eager_comm import eager_counted_step

        spec, eager_comm = eager_counted_step(spec)
    result = _check(spec, rtol, atol)
    for observer in list(_OBSERVERS):
        observer({**result, "eager_comm": eager_comm})
    return result


_OBSERVERS: list[Callable[[dict[str, Any]], None]] = []


@contextlib.contextmanager
def observe_checks(observer: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """Within the block, call ``observer`` with each :func:`check_step` result, plus ``"eager_comm"``.

    ``eager_comm``: the eager step's collectives by phase and kind (:func:`.eager_comm.count_eager`).
    See NOTE [the target's own check].
    """
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


def combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several :func:`check_step` results (with ``eager_comm``) as one: counts summed, mismatches in order.

    Each mismatch's ``index`` becomes its position in the combined order; ``eager_comm`` is the first
    check's (the communication report compares one step).
    """
    compared, mismatches = 0, []
    for r in results:
        mismatches += [{**m, "index": compared + m["index"]} for m in r["mismatches"]]
        compared += r["compared"]
    return {"compared": compared, "mismatches": mismatches, "eager_comm": results[0]["eager_comm"] if results else {}}


_ASIDE = [0]


@contextlib.contextmanager
def aside() -> Iterator[None]:
    """Within the block, optimizer steps are the check's own (an eager reference step, a state saved), not the
    target's training steps (:class:`.steps.OptimizerSteps` does not count them)."""
    _ASIDE[0] += 1
    try:
        yield
    finally:
        _ASIDE[0] -= 1


def is_aside() -> bool:
    """Whether an :func:`aside` block is open."""
    return _ASIDE[0] > 0


def _check(spec: Step, rtol: float | None, atol: float | None) -> dict[str, Any]:
    from . import state

    with aside():  # the target's training step is the compiled one
        saved = state.save(spec.model, spec.optimizer, spec.lr_scheduler)
        eager = run_step(spec, compiled=False)
        state.restore(saved, spec.model, spec.optimizer, spec.lr_scheduler)
    compiled = run_step(spec, compiled=True)
    assert eager is not None and compiled is not None
    return compare_runs([eager], [compiled], rtol, atol, tolerances=spec.tolerances)
