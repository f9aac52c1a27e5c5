"""Audit target with known breaks: a print, an .item() branch, and (with --object-collective) dist.all_gather_object.

Run under torchrun (or `dynamo-ext audit`); every rank compiles `step` and calls it twice.
Line numbers matter to tests/test_audit_e2e.py: keep BREAK_* comments on the breaking lines.
"""

import sys

import torch
import torch.distributed as dist


def step(x):
    x = x * 2
    print("step on rank", dist.get_rank())  # BREAK_PRINT
    x = x + 1
    if x.sum().item() > -1e9:  # BREAK_ITEM
        x = x - 1
    if "--object-collective" in sys.argv:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, dist.get_rank())  # BREAK_OBJECT
    return torch.relu(x)


def main():
    dist.init_process_group("gloo")
    compiled = torch.compile(step, backend="eager")
    for _ in range(2):
        compiled(torch.ones(8))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
