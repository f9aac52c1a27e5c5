"""The numerics check: one training step compiled and the same step eagerly, from the same state, compared.

NOTE [step protocol]
A target exposes "a step" with a module-level ``make_step()`` (next to the
``module:function`` target's function, or at the top level of a target
script) returning :class:`Step`, or any ``(model, optimizer, step)`` triple:

- ``model``: the ``nn.Module`` whose parameters the step trains (FSDP2 /
  DTensor parameters are fine: their local shards are compared);
- ``optimizer``: a ``torch.optim.Optimizer`` over them, or ``None``;
- ``step(compiled: bool)``: runs the forward, the loss and ``backward()`` once,
  through ``torch.compile`` (and compiled autograd, if the target uses it) when
  ``compiled`` is true and eagerly otherwise, and returns the loss or a
  (nested) dict / list / tuple of tensors (the outputs to compare, by path:
  ``"loss"``, ``"out[0]"``, ``"logits"``).  It must not call the optimizer.

:func:`check_step` snapshots the parameters, the optimizer state and the RNG
state, runs ``step(False)``, then ``optimizer.step()``; restores the snapshot;
runs ``step(True)``, then ``optimizer.step()``; and compares, in this order,
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
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Step:
    """What ``make_step()`` returns (see NOTE [step protocol])."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    step: Callable[[bool], Any]


MakeStepResult = Step | tuple[nn.Module, torch.optim.Optimizer | None, Callable[[bool], Any]]
"""What a ``make_step()`` returns: a :class:`Step`, or its ``(model, optimizer, step)`` triple."""


def as_step(obj: Any) -> Step:
    """A :class:`Step` from ``make_step()``'s result (a ``Step`` or a ``(model, optimizer, step)`` triple).

    Raises:
        TypeError: ``obj`` is neither, or its parts have the wrong types.
    """
    if not isinstance(obj, Step):
        if not (isinstance(obj, (tuple, list)) and len(obj) == 3):
            raise TypeError(
                f"make_step() must return dynamo_ext.audit.Step or a (model, optimizer, step) triple, got "
                f"{type(obj).__name__}"
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
    return obj


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


def _rng_state() -> tuple[Any, Any]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng_state(state: tuple[Any, Any]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _run(spec: Step, compiled: bool) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]], list[tuple[str, Any]]]:
    for p in spec.model.parameters():
        p.grad = None
    out = spec.step(compiled)
    outputs = [(n, t.detach().clone()) for n, t in _flatten(out)]
    named = list(spec.model.named_parameters())
    grads = [(n, None if p.grad is None else p.grad.detach().clone()) for n, p in named]
    if spec.optimizer is not None:
        spec.optimizer.step()
        spec.optimizer.zero_grad(set_to_none=True)
    params = [(n, p.detach().clone()) for n, p in named]
    return outputs, grads, params


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


def _check(spec: Step, rtol: float | None, atol: float | None) -> dict[str, Any]:
    params = [p for _, p in spec.model.named_parameters()]
    with torch.no_grad():
        saved_params = [p.detach().clone() for p in params]
    saved_optim = copy.deepcopy(spec.optimizer.state_dict()) if spec.optimizer is not None else None
    rng = _rng_state()

    eager = _run(spec, compiled=False)
    with torch.no_grad():
        for p, s in zip(params, saved_params):
            p.copy_(s)
    if spec.optimizer is not None and saved_optim is not None:
        spec.optimizer.load_state_dict(copy.deepcopy(saved_optim))
    _set_rng_state(rng)
    compiled = _run(spec, compiled=True)

    mismatches: list[dict[str, Any]] = []
    compared = 0
    for kind, e_list, c_list in zip(("output", "grad", "param"), eager, compiled):
        e_map, c_map = dict(e_list), dict(c_list)
        for name in list(e_map) + [n for n in c_map if n not in e_map]:
            compared += 1
            m = compare(name, kind, e_map.get(name), c_map.get(name), rtol, atol)
            if m is not None:
                mismatches.append({"index": compared - 1, **m})
    return {"compared": compared, "mismatches": mismatches}
