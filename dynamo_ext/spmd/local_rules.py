"""Ops of a data-parallel step that each rank computes on its own samples, as each rank of DDP does.

NOTE [local rules]
The batch-dim analysis (:mod:`.batch_dim`) runs each node on DTensors and
takes DTensor's layout for it.  For a few ops DTensor's rule communicates
(gathers the batch, or all-reduces a reduction over it) although the value
a ``DistributedDataParallel`` rank computes is the one computed from its own
samples; these rules say what that local value is, so the analysis computes
the op on each rank's local tensors and gives the result this layout:

- ``nll_loss_forward`` / ``nll_loss2d_forward`` with ``reduction="mean"``
  (``F.cross_entropy``, ``F.nll_loss``; class weights and ``ignore_index``
  included) on an input and target sharded on the same dim (the batch, not
  the input's class dim): the local weighted mean,
  ``Partial("avg")``, and its total weight, ``Partial("sum")``.  torch 2.13's
  DTensor rule gave the same; 2.15's has no sharded mean and gathers the batch.
- ``binary_cross_entropy_with_logits`` (no DTensor rule on 2.13 or 2.15) on
  an input and target sharded alike, with replicated ``weight`` and
  ``pos_weight``: the local mean, ``Partial("avg")``, sum, ``Partial("sum")``,
  or per-element loss, sharded as its input.
- ``div`` of a value without a batch dim by a sum over the batch
  (``Partial("sum")``, read as each rank's own): a mean with its own count,
  ``Partial("avg")``.  ``F.cross_entropy``'s label smoothing divides the
  smoothing term's sum by the count of samples not ignored (or their summed
  class weights), and its backward divides by that count again; DDP divides
  by each rank's own count.  The edge is a local read (NOTE [reduction edges]).
- ``all`` / ``any`` over a batch-sharded tensor (``F.one_hot``'s range check
  of the labels): each rank's own answer, ``Partial("min")`` / ``Partial("max")``
  of it over the batch.
- ``_assert_async``: each rank asserts on its own value (no output), as under
  DDP; a Partial input is a local read.

A rule applies only where its inputs have those layouts; any other case goes
to DTensor's rule as before.  Rules that read a Partial input apply only in
:func:`.batch_dim.analyze_step` (which records local reads), not in
:func:`.batch_dim.analyze_batch_dims`, and never to a parameter's gradient or
a value computed from one (``analyze_step``'s ``gradients``): DDP's readers
of a gradient (an optimizer dividing by ``grad.sum()``) see the average, so
those reads stay reduction edges.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

aten = torch.ops.aten

_MEAN, _SUM = 1, 2  # torch.nn._reduction: 0 none, 1 mean, 2 sum
_NLL_FORWARD = frozenset(
    getattr(aten, name).default for name in ("nll_loss_forward", "nll_loss2d_forward") if hasattr(aten, name)
)
_ALL_ANY: dict[Any, str] = {aten.all.default: "min", aten.any.default: "max"}
_ASSERTS = frozenset(
    getattr(getattr(aten, name), overload)
    for name, overload in (("_assert_async", "default"), ("_assert_async", "msg"))
    if hasattr(getattr(aten, name, None), overload)
)


@dataclasses.dataclass(frozen=True)
class LocalRule:
    """How a node's local result is laid out."""

    outputs: tuple[Placement, ...] | Placement | None
    """The placement of the result (a tuple for several outputs; None: no tensor output)."""
    local_reads: list[str]
    """The names of its Partial inputs, each read as the rank's own value."""


def _layout(a: Any, layouts: dict[str, Any]) -> Any:
    return layouts.get(a.name) if isinstance(a, torch.fx.Node) else None


def local_rule(node: torch.fx.Node, layouts: dict[str, Any]) -> LocalRule | None:
    """The rule of NOTE [local rules] that applies to ``node`` given its inputs' layouts, or None."""
    if node.op != "call_function":
        return None
    target, args = node.target, list[Any](node.args)
    if target in _NLL_FORWARD and len(args) >= 4 and args[3] == _MEAN:
        weight = _layout(args[2], layouts) if args[2] is not None else Replicate()
        batch = _layout(args[0], layouts)
        # the target has the input's dims but the channel dim (1): the batch is the same dim of both
        if isinstance(batch, Shard) and batch.dim != 1 and weight == Replicate():
            if _layout(args[1], layouts) == Shard(batch.dim - (batch.dim > 1)):
                return LocalRule((Partial("avg"), Partial("sum")), [])
    if target is aten.binary_cross_entropy_with_logits.default and len(args) >= 2:
        batch = _layout(args[0], layouts)
        weights = [_layout(a, layouts) for a in (*args[2:4], node.kwargs.get("weight"), node.kwargs.get("pos_weight"))]
        reduction: Any = args[4] if len(args) > 4 else node.kwargs.get("reduction", _MEAN)
        if (
            isinstance(batch, Shard)
            and _layout(args[1], layouts) == batch
            and all(w in (None, Replicate()) for w in weights)
        ):
            return LocalRule({_MEAN: Partial("avg"), _SUM: Partial("sum")}.get(reduction, batch), [])
    if target is aten.div.Tensor and len(args) == 2:
        num, den = (_layout(a, layouts) for a in args)
        if den == Partial("sum") and not isinstance(num, Shard):
            reads = [a.name for a in node.all_input_nodes if isinstance(_layout(a, layouts), Partial)]
            return LocalRule(Partial("avg"), reads)
    if target in _ALL_ANY and len(args) == 1 and isinstance(_layout(args[0], layouts), Shard):
        return LocalRule(Partial(_ALL_ANY[target]), [])
    if target in _ASSERTS:
        ins = [_layout(a, layouts) for a in node.all_input_nodes]
        if any(isinstance(x, Shard | Partial) for x in ins):
            return LocalRule(None, [a.name for a in node.all_input_nodes if isinstance(_layout(a, layouts), Partial)])
    return None
