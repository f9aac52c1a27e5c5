"""Audit target for multi-node collection (tests/test_audit_multinode.py): a break, a collective, a recompile,
one outlier rank, and optionally a rank that is killed.

Every rank compiles `step` (a print break, then an all-reduce inside the graph)
and calls it on two shapes (one recompile); rank 2 also compiles `local`, with
no collective, on two shapes (the outlier: two more graphs, one more recompile).  With AUDIT_TARGET_KILL_RANK=R, rank R
kills itself with SIGKILL after that, before the final barrier.  As a script it
initializes its own process group; ``main_function`` leaves that to the audit.
Keep the markers on their lines.
"""

import os
import signal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def step(x):
    x = x * 2
    print("multinode step")  # BREAK_PRINT
    return funcol.all_reduce(x + 1, "sum", dist.group.WORLD)  # ALL_REDUCE


def local(x):
    return x.cos() + 1


def main_function():
    """The job, in a process group that is already initialized."""
    compiled = torch.compile(step, backend="eager")
    compiled(torch.ones(8))
    compiled(torch.ones(8))
    compiled(torch.ones(4, 2))  # RECOMPILE
    if dist.get_rank() == 2:
        outlier = torch.compile(local, backend="eager")
        outlier(torch.ones(3))
        outlier(torch.ones(3, 3))  # OUTLIER
    dist.barrier()  # every rank has logged its findings before one may be killed
    if os.environ.get("AUDIT_TARGET_KILL_RANK") == str(dist.get_rank()):
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def main():
    dist.init_process_group("gloo")
    main_function()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
