"""Audit target: a training step the audit trains itself (``schedule_step.py:make_step``), with an LR scheduler.

The model's ``temperature`` follows the LR scheduler's step count (as a schedule-driven attribute does in real
trainers): a Python float the compiled forward reads, so Dynamo specializes it in step 1 and recompiles in step
2 (the first change), when it makes it dynamic; step 3 runs that graph.  Each step's batch is picked by the
scheduler's step count too, so the eager steps of the numerics check see the compiled steps' batches only when
the audit restored the scheduler's state.  ``forward`` all-reduces its hidden activation over the ranks
(an explicit collective in the graph).  ``make_step()`` refuses to build twice in one process, as torchtitan's
model cannot (its second ``fully_shard`` fails): the audit builds it once.  ``main()`` (run as a script) trains
three steps itself.
"""

import os

import torch
import torch.distributed as dist
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.temperature = 1.0

    def forward(self, x):
        h = torch.relu(self.lin(x)) / self.temperature
        dist.all_reduce(h)
        return self.head(h)


def make_step():
    # Process-wide (the script may be loaded more than once): torchtitan's state lives in its modules.
    if os.environ.get("SCHEDULE_STEP_BUILT"):
        raise RuntimeError("schedule_step: make_step() called twice in one process; this target builds once")
    os.environ["SCHEDULE_STEP_BUILT"] = "1"
    torch.manual_seed(0)
    model = Model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    compiled = torch.compile(model, backend="aot_eager")

    def step(use_compile):
        model.temperature = 1.0 + 0.5 * sched.last_epoch
        g = torch.Generator().manual_seed(100 * sched.last_epoch + dist.get_rank())
        x = torch.randn(4, 8, generator=g)
        loss = (compiled if use_compile else model)(x).square().mean()
        loss.backward()
        return {"loss": loss}

    return model, optim, step, sched


def main():
    dist.init_process_group("gloo")
    model, optim, step, sched = make_step()
    for _ in range(3):
        step(True)
        optim.step()
        optim.zero_grad()
        sched.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
