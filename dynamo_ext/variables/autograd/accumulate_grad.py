"""A DTensor leaf's first gradient under compiled autograd keeps the leaf's placements.

NOTE [compiled autograd: DTensor .grad of an uneven shard]
Compiled autograd accumulates each leaf's gradient with
``torch._dynamo.external_utils.call_accumulate_grad``, which runs the C++
functional ``AccumulateGrad``.  For a first gradient that it cannot steal it
calls autograd's ``clone_obey_contract``:
``new_grad.new_empty_strided(variable.sizes(), variable.strides()).copy_(new_grad)``.
Two releases' DTensor get that ``new_empty_strided`` wrong for FSDP2's parameters:

- 2.11: ``new_factory_strategy`` keeps the input's placements for
  ``new_empty_strided`` only when the tensor is evenly shardable (its local
  stride computation assumed even shards), so for an unevenly sharded
  parameter (``Shard(0)`` of 10 rows over 4 ranks) the allocation is
  ``Replicate`` and ``copy_`` all-gathers the gradient into it: ``.grad``
  arrives full size and ``Replicate`` where eager gives ``Shard(0)`` (same
  values);
- 2.11 and 2.12: the local shape of a ``_StridedShard`` (FSDP over TP:
  ``(_StridedShard(0, sf=2), Shard(0))``) is computed through its offsets list,
  ``.tolist()`` of a fake index tensor, whose unbacked SymInts no output binds:
  Dynamo fails with ``PendingUnbackedSymbolNotFound``.

Where a probe finds either (``_compat.dtensor_new_empty_strided_drops_uneven_shard``,
``_compat.dtensor_strided_shard_shape_materializes_offsets``) and compiled
autograd calls the C++ op this way, the plugin traces a DTensor leaf's first
gradient as ``torch.empty_like(variable).copy_(grad)``, the layout contract as
Dynamo's own ``accumulate_grad`` polyfill writes it (2.12+): ``empty_like``
follows the leaf's placements and local shape for any shard sizes.  Every other
case (a plain tensor, an existing ``.grad``, placements that differ, grad mode
on) runs torch's own.
"""

from __future__ import annotations

import logging
from typing import Any

from ... import _compat
from ..base import wrap_constant
from ..functions import register_handler

log = logging.getLogger(__name__)


def _accumulate_dtensor(variable: Any, grad: Any, has_post_hooks: bool) -> bool:
    """Set a DTensor leaf's first ``.grad`` with the leaf's placements; ``False`` where torch's own applies."""
    import torch

    if (
        variable.grad is None
        and not torch.is_grad_enabled()
        and isinstance(grad, torch.distributed.tensor.DTensor)  # pyright: ignore[reportAttributeAccessIssue]  # imported
        and grad.placements == variable.placements
    ):
        new_grad = torch.empty_like(variable)
        new_grad.copy_(grad)
        variable.grad = new_grad
        return True
    return False


def register() -> None:
    """Trace a DTensor leaf's first gradient with its placements where this release's DTensor would not."""
    original = _compat.compiled_autograd_accumulate_grad_with_grad_arg()
    reasons = [
        reason
        for reason, hit in (
            (
                "new_empty_strided makes an uneven shard Replicate",
                _compat.dtensor_new_empty_strided_drops_uneven_shard(),
            ),
            (
                "a _StridedShard's local shape allocates unbacked SymInts",
                _compat.dtensor_strided_shard_shape_materializes_offsets(),
            ),
        )
        if hit
    ]
    if original is None or not reasons:
        return
    log.debug(
        "compiled autograd: DTensor leaves' first gradients traced with empty_like + copy_ (%s)", "; ".join(reasons)
    )
    from torch.distributed.tensor import DTensor

    def handler(tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        leaf = args[0] if args else kwargs.get("variable")
        if leaf is not None and issubclass(_python_type(leaf), DTensor):
            # Every condition is known at trace time (grad presence, grad mode, types, placements).
            done = _compat.user_function_variable(_accumulate_dtensor).call_function(tx, args, kwargs)
            if done.is_python_constant() and done.as_python_constant():
                log.debug("compiled autograd: a DTensor leaf's first gradient keeps the leaf's placements")
                return wrap_constant(tx, None)
        return _compat.user_function_variable(original).call_function(tx, args, kwargs)

    register_handler(original, handler)


def _python_type(vt: Any) -> type:
    try:
        return vt.python_type()
    except NotImplementedError:
        return type(None)
