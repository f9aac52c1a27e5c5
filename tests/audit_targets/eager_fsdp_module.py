"""Audit target: two FSDP2 modules, the second called through a function Dynamo must not trace.

`first` is compiled with its FSDP2 hooks (the plugin traces them: its all-gather and
reduce-scatters in the graphs); `second` runs behind a graph break (`torch._dynamo.disable`), so its
FSDP2 hooks and collectives run eagerly and no compiled graph has them.  The communication report's
counts then differ from eager `CommDebugMode`'s by exactly `second`'s collectives, and the report must
say so per module (tests/test_audit_comm_counts.py).  `main()` checks the step itself with `check_step`,
which the audit reports under `--check-numerics`.
"""

import torch
import torch.distributed as dist
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8, bias=False)
        self.second = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        h = torch.relu(self.first(x))
        return run_eagerly(self.second, h)  # the graph break


@torch._dynamo.disable
def run_eagerly(module, x):
    return module(x)


def make_step():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model()
    fully_shard(model.first)
    fully_shard(model.second)
    fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step(use_compile):
        loss = (compiled if use_compile else model)(x).square().mean()
        loss.backward()
        return {"loss": loss}

    return model, optim, step


def main():
    from dynamo_ext.audit import Step, check_step

    dist.init_process_group("gloo")
    # The target's own check is what --check-numerics reports (make_step() is not run again).
    check_step(Step(*make_step()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
