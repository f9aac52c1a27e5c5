"""Audit target: rank 0 waits in a compiled all-reduce that follows a graph break; rank 1 sleeps before it.

Usage: waits_in_compiled.py
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
    for _ in range(3):  # every context of the step is checked on both ranks: the fourth call meets no check
        compiled(torch.ones(4))
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(3600)  # SLEEP_LINE
    compiled(torch.ones(4))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
