"""Audit target: a print inside a loop (Dynamo skips the frame) and a recompile on a shape change."""

import torch
import torch.distributed as dist


def looped(x):
    for _ in range(2):
        x = x + 1
        print("in loop")  # BREAK_LOOP
    return x


def shaped(x):
    return x.sin() + 1


def main():
    dist.init_process_group("gloo")
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch.compile(looped, backend="eager")(torch.ones(4))
    f = torch.compile(shaped, backend="eager")
    f(torch.ones(4))
    f(torch.ones(5))  # RECOMPILE
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
