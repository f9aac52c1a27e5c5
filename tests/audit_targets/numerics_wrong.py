"""Audit target whose compiled step is wrong on purpose: the gradient of `lin.weight` is 1% off, only under compile.

`make_step()` follows the audit's step protocol (docs/audit.md, "Numerics check"): the forward values
agree, so the first tensor that differs is the gradient of `lin.weight` (then the parameters after the
optimizer step).  `main()` is what the audit runs first: one compiled step on every rank, or with
`--self-check` the target's own `check_step` (with a tolerance the error passes).
"""

import torch
import torch.distributed as dist
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        h = self.lin(x)
        if torch.compiler.is_compiling():
            # Same forward value, a gradient 1.01x as large: wrong only when compiled.
            h = h + 0.01 * (h - h.detach())
        return self.head(torch.relu(h))


def make_step():
    torch.manual_seed(0)
    model = Model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0))

    def step(use_compile):
        out = (compiled if use_compile else model)(x)
        loss = out.square().mean()
        loss.backward()
        return {"loss": loss, "out": out}

    return model, optim, step


def main():
    import sys

    dist.init_process_group("gloo")
    model, optim, step = make_step()
    if "--self-check" in sys.argv:
        # The target checks its own step, with a tolerance the 1% error passes: the audit reports this check
        # (docs/audit.md, --check-numerics) instead of checking make_step() again with the default tolerances.
        from dynamo_ext.audit import Step, check_step

        check_step(Step(model, optim, step), rtol=0.05, atol=0.05)
    else:
        step(True)
        optim.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
