"""A training step's state, saved and put back: parameters' and buffers' local shards, optimizer, LR scheduler, RNG.

NOTE [one build, saved state]
The numerics check runs the compiled and the eager steps on one build of the target (one ``make_step()``):
building twice in one process is what some trainers cannot do (torchtitan 0.3.0's second build fails in
``fully_shard``: "Expected param's DTensor mesh to be the same mesh passed to fully_shard"), and a second
model compiles a second time.  So the state both runs start from is saved and put back in place:

- each parameter's and buffer's local values (a DTensor's local shard: FSDP2 and TP parameters stay the same
  objects, with the same placements; only their values are copied back), under ``no_grad``;
- the optimizer's and the LR scheduler's ``state_dict()``, deep-copied, put back with ``load_state_dict``
  (torch's optimizers and schedulers, and containers that follow their protocol, as torchtitan's
  ``OptimizersContainer`` and ``LRSchedulersContainer`` do; torchtitan's materializes its optimizer state with
  a zero-learning-rate step when asked for it before the first step, which leaves the parameters as they
  are);
- the CPU and CUDA random number generators.

Gradients are not state: each run starts with none.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class SavedState:
    """What :func:`save` took: local values by name, the optimizer's and scheduler's state dicts, RNG states."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    lr_scheduler: dict[str, Any] | None
    rng: tuple[Any, Any]


def local(t: torch.Tensor) -> torch.Tensor:
    """The values this rank holds of ``t``: a DTensor's local shard (the same storage under ``no_grad``), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def rng_state() -> tuple[Any, Any]:
    """The CPU generator's state, and every CUDA device's when CUDA is there."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_state(state: tuple[Any, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def save(model: torch.nn.Module, optimizer: Any = None, lr_scheduler: Any = None) -> SavedState:
    """The state a step starts from (NOTE [one build, saved state]); copies, so later steps leave it as it is."""
    with torch.no_grad():
        params = {n: local(p).detach().clone() for n, p in model.named_parameters()}
        buffers = {n: local(b).detach().clone() for n, b in model.named_buffers()}
    return SavedState(
        params=params,
        buffers=buffers,
        optimizer=copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
        lr_scheduler=copy.deepcopy(lr_scheduler.state_dict()) if lr_scheduler is not None else None,
        rng=rng_state(),
    )


def restore(saved: SavedState, model: torch.nn.Module, optimizer: Any = None, lr_scheduler: Any = None) -> None:
    """Put ``saved`` back into ``model`` (in place), ``optimizer``, ``lr_scheduler`` and the generators.

    Raises:
        ValueError: ``model`` has a parameter or buffer ``saved`` lacks, or of another shape (not the model saved).
    """
    with torch.no_grad():
        for kind, named, values in (
            ("parameter", model.named_parameters(), saved.params),
            ("buffer", model.named_buffers(), saved.buffers),
        ):
            for name, t in named:
                value, target = values.get(name), local(t)
                if value is None or value.shape != target.shape:
                    raise ValueError(
                        f"cannot restore {kind} {name!r}: the saved state has "
                        f"{'none' if value is None else list(value.shape)}, the model {list(target.shape)}; "
                        "restore into the model that was saved"
                    )
                target.copy_(value)
    if optimizer is not None and saved.optimizer is not None:
        optimizer.load_state_dict(copy.deepcopy(saved.optimizer))
    if lr_scheduler is not None and saved.lr_scheduler is not None:
        lr_scheduler.load_state_dict(copy.deepcopy(saved.lr_scheduler))
    for p in model.parameters():
        p.grad = None
    set_rng_state(saved.rng)
