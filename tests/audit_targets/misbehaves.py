"""Audit target that misbehaves on one rank, after a graph break every rank sees.

Usage: misbehaves.py raise|die|kill|hang  (rank 1 raises ValueError, exits with status 7 without a word, is killed
by SIGKILL, or sleeps)
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def step(x):
    x = x + 1
    print("compiled step")  # BREAK_PRINT
    return x * 2


def main():
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    torch.compile(step, backend="eager")(torch.ones(4))
    dist.barrier()  # both ranks have logged the break before rank 1 misbehaves
    if dist.get_rank() == 1:
        if mode == "raise":
            raise ValueError("rank 1 refuses")  # RAISE_LINE
        if mode == "die":
            os._exit(7)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "hang":
            time.sleep(3600)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
