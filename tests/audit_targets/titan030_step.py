"""Audit target: torchtitan 0.3.0's own Llama 3 training step (``tests/titan030.py``) as the audit's step protocol.

``make_step()`` builds torchtitan's debug model with its own ``parallelize_llama`` and ``ParallelDims``
(dp_shard=2 x tp=2 on 4 ranks; the harness's three CPU patches), its chunked loss, ``OptimizersContainer``
(AdamW) and ``LRSchedulersContainer``, once, and returns ``Step(model, optimizers, step,
lr_scheduler=lr_schedulers)``: ``step(compiled)`` is ``Trainer.train_step``'s forward, loss, backward and
gradient clipping, through the compiled model (``compiled``) or eagerly.  The audit drives it
(``dynamo-ext audit --nproc 4 --compare-stock --check-numerics tests/audit_targets/titan030_step.py:make_step``):
it runs the optimizer and scheduler steps, and starts the eager steps from the state it saved.

Each step's batch is picked by the LR scheduler's step count, so the eager steps see the compiled steps'
batches only when the scheduler's state was restored with the rest.

Its tolerances (``Step.tolerances``): the RMSNorm weights.  Compiled code decomposes ``rms_norm``'s backward
where eager runs the fused kernel, so their gradients differ in the last bits (up to 3.4e-5 here, 4 ranks,
aot_eager, stock and plugin alike; NOTE [torchtitan 0.3.0 against eager: tolerances] in ``tests/titan030.py``),
and AdamW turns a gradient near 0 of the other sign into a step of the other sign (up to 3.8e-4 on a
parameter, about twice the learning rate).  Every other tensor is compared with the audit's defaults.

Knobs: ``DYNAMO_EXT_TITAN_MODE`` (``whole``: ``torch.compile(model)``, the default; ``per_block``: torchtitan's
``compile.enable``), ``DYNAMO_EXT_TITAN_SPMD_BACKEND`` (``spmd_types``, torchtitan's default, or
``partial_dtensor``), ``DYNAMO_EXT_EXAMPLE_BACKEND`` (default ``aot_eager``).  Run as a script, it trains three
compiled steps on its own (under ``torchrun --nproc-per-node 4``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the harness

import titan030  # noqa: E402


def setup() -> titan030.Setup:
    """The harness's configuration, from the environment (see the module's docstring)."""
    return titan030.Setup(
        spmd_backend=os.environ.get("DYNAMO_EXT_TITAN_SPMD_BACKEND", "spmd_types"),
        mode=os.environ.get("DYNAMO_EXT_TITAN_MODE", "whole"),
        backend=os.environ.get("DYNAMO_EXT_EXAMPLE_BACKEND", "aot_eager"),
    )


# The RMSNorm weights' (see the module's docstring); a gradient reduced twice, not at all or over the wrong ranks
# is off by far more (50% of its largest value).
TOLERANCES = {"grad:*norm.weight": (0.0, 1e-4), "param:*norm.weight": (0.0, 1e-3)}


def make_step() -> Any:
    """The audit's step protocol: torchtitan's model, optimizers, ``step(compiled)`` and LR schedulers."""
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed import utils as dist_utils

    from dynamo_ext.audit import Step

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = setup()
    t = titan030.build(world, cfg)
    scheduler = t.lr_schedulers.schedulers[0]

    def step(compiled: bool) -> dict[str, torch.Tensor]:
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types

        inputs, labels = titan030.batch(rank, cfg, scheduler.last_epoch, t.parallel_dims.tp)
        global_valid = dist_utils.dist_sum_tensor((labels != -100).sum(), t.parallel_dims.get_mesh("batch"))
        if cfg.spmd_backend == "spmd_types":
            inputs, labels, _ = annotate_input_spmd_types(t.parallel_dims, inputs, labels, {})
        model = t.step_model if compiled else t.model
        # per_block: the blocks are compiled inside the model; the eager step runs them eagerly.
        stance = contextlib.nullcontext() if compiled else torch.compiler.set_stance("force_eager")
        with stance, t.train_context():
            pred = model(inputs)
            loss, _ = t.loss_fn(pred, labels, global_valid)
            del pred
            loss.backward()
        dist_utils.clip_grad_norm_(list(t.model.parameters()), t.config.training.max_norm, foreach=True)
        loss = loss.detach()
        return {"loss": loss.full_tensor() if isinstance(loss, DTensor) else loss}

    return Step(t.model, t.optimizers, step, lr_scheduler=t.lr_schedulers, tolerances=TOLERANCES)


def main() -> None:
    """Three compiled training steps, as torchtitan's trainer runs them."""
    dist.init_process_group("gloo")
    spec = make_step()
    for _ in range(3):
        spec.optimizer.zero_grad(set_to_none=True)
        loss = spec.step(True)["loss"]
        spec.optimizer.step()
        spec.lr_scheduler.step()
    if dist.get_rank() == 0:
        print(f"titan030_step: 3 steps, loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
