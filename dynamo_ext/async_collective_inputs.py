"""Keep the autograd edge of an ``AsyncCollectiveTensor`` that enters a compiled region as an input.

NOTE [grad-requiring AsyncCollectiveTensor inputs]
``DTensor.to_local()`` after an ``async_op=True`` redistribute returns an
``AsyncCollectiveTensor`` (ACT): a wrapper whose ``elem`` is the collective's
(not yet waited) output.  Tensor parallelism produces one between eagerly run
modules and compiled ones: torchtitan's rowwise-parallel embedding
(``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``)
reduce-scatters its output and hands the ACT to the first transformer block,
which torchtitan compiles on its own.  The ACT requires grad (its ``grad_fn``
is ``to_local``'s backward); its ``elem`` does not.

AOTAutograd's ``process_inputs`` (torch 2.12 to 2.15) replaces each top-level
ACT input with ``act.trigger_wait()``, the ``elem``, before it makes fake
inputs, so that the traced metadata never records an ACT (its runtime wrapper
waits on the ACT again before the compiled graph reads it).  That fake no longer
requires grad.  When nothing else requiring grad enters the region, AOTAutograd
compiles an inference graph and backward raises "element 0 of tensors does not
require grad"; in a block with parameters it differentiates with respect to the
parameters only, and the gradient to everything before the ACT (the
embedding's weight) is silently dropped (torchtitan's embedding gets zeros).

We wrap ``process_inputs``: it notes which inputs are ACTs that require grad,
lets the original fakify them, and sets ``requires_grad`` again on each of those
fakes that lost it.  The fake is changed in place, not replaced: the
symbolic-shape context AOTAutograd keeps per input is keyed by the fake's
identity.  At run time the compiled ``autograd.Function`` receives the ACT itself
(the wait happens inside its forward), so the gradient for that input flows back
through the ACT's ``grad_fn``.  AOTAutograd's cache keys on the fakes'
``requires_grad``, so an entry compiled without the fix is not reused (tested
with the collective check off, which otherwise bypasses that cache for such graphs).

On 2.11 ``process_inputs`` keeps ACT inputs as subclasses, with their
``requires_grad`` (eager's gradients, tested), and nothing is wrapped
(``_compat.aot_unwraps_async_collective_inputs``).  A DTensor input whose local
tensor is an ACT (``redistribute(..., async_op=True)`` without ``to_local``) is
left alone: it keeps its ``requires_grad`` on 2.13 (kept as it is) and on 2.15
(rebuilt around the waited local tensor), as a compiled ``d * 2`` shows.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from . import _compat
from ._patching import Patcher

log = logging.getLogger(__name__)


def grad_requiring_acts(flat_args: Sequence[Any], act_type: type) -> list[int]:
    """Positions in ``flat_args`` of ``AsyncCollectiveTensor`` inputs that require grad."""
    return [i for i, a in enumerate(flat_args) if isinstance(a, act_type) and a.requires_grad]


def restore_requires_grad(fakes: Sequence[Any], positions: Sequence[int], act_type: type) -> list[int]:
    """Set ``requires_grad`` on ``fakes[i]`` for each ``i`` in ``positions`` where it was lost.

    A fake that is still an ``AsyncCollectiveTensor`` (a release that does not unwrap them) or already
    requires grad is left alone.  Returns the positions changed.
    """
    changed = []
    for i in positions:
        fake = fakes[i]
        if isinstance(fake, torch.Tensor) and not isinstance(fake, act_type) and not fake.requires_grad:
            fake.requires_grad_(True)
            changed.append(i)
    return changed


def _keep_requires_grad(original: Any, act_type: type) -> Any:
    @functools.wraps(original)
    def process_inputs(flat_args: list[Any], *args: Any, **kwargs: Any) -> Any:
        positions = grad_requiring_acts(flat_args, act_type)  # before the original unwraps them in place
        result = original(flat_args, *args, **kwargs)
        if positions:
            fakes = result[0] if isinstance(result, tuple) else result
            changed = restore_requires_grad(fakes, positions, act_type)
            if changed:
                log.info(
                    "AsyncCollectiveTensor input(s) at position(s) %s of the compiled region require grad: "
                    "kept requires_grad on their unwrapped fakes (NOTE [grad-requiring AsyncCollectiveTensor inputs])",
                    changed,
                )
        return result

    return process_inputs


def install(patches: Patcher) -> None:
    """Wrap AOTAutograd's ``process_inputs`` where it unwraps ACT inputs (2.12 to 2.15; a no-op on 2.11)."""
    act_type = _compat.async_collective_tensor_type()
    original, owners = _compat.aot_process_inputs()
    if act_type is None or original is None or not _compat.aot_unwraps_async_collective_inputs():
        log.debug("AOTAutograd does not unwrap AsyncCollectiveTensor inputs here: they keep stock behaviour")
        return
    wrapped = _keep_requires_grad(original, act_type)
    for owner in owners:
        patches.setattr(owner, "process_inputs", wrapped)
