"""Audit target: rank 0 waits in the collective check before a compiled all-reduce that follows a graph break;
rank 1 sleeps before it.

The step's second call runs the all-reduce's graph after itself on the group: a context no rank has checked yet
(NOTE [when the stream is checked]), so rank 0 waits in the check for rank 1's entry before it enters the
all-reduce.

Usage: waits_in_check.py
"""

import time

import torch
import torch.distributed as dist


def step(x):
    x = x + 1
    print("compiled step")  # BREAK_PRINT
    dist.all_reduce(x)  # ALL_REDUCE_LINE
    return x * 2


def main():
    dist.init_process_group("gloo")
    compiled = torch.compile(step, backend="aot_eager")
    compiled(torch.ones(4))
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(3600)  # SLEEP_LINE
    compiled(torch.ones(4))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
