"""Audit target whose graphs differ per rank: once with the same collectives (fine), once not (a hang risk).

Every rank compiles `agree` (rank 0 computes more, both then all-reduce once)
and `differ` (only rank 0 all-reduces inside the graph; the other ranks issue
the matching all-reduce eagerly afterwards, so the run itself does not hang).
Rank 1 also recompiles `shaped` once more than rank 0 before `later` compiles.
Line numbers matter to tests/test_audit_e2e.py: keep the markers on their lines.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def agree(x, rank):
    if rank == 0:
        x = x * 2 + 1
    return funcol.all_reduce(x, "sum", dist.group.WORLD)  # AGREE


def differ(x, rank):
    if rank == 0:
        x = funcol.all_reduce(x, "sum", dist.group.WORLD)  # HANG_RISK
    return x + 1


def shaped(x):
    return x.cos()


def later(x):
    return x.sin() * 3


def main():
    dist.init_process_group("gloo")
    torch._dynamo.config.automatic_dynamic_shapes = False
    rank = dist.get_rank()
    x = torch.ones(4)
    torch.compile(agree, backend="eager")(x, rank)
    torch.compile(differ, backend="eager")(x, rank)
    if rank != 0:
        funcol.all_reduce(x, "sum", dist.group.WORLD).wait()
    f = torch.compile(shaped, backend="eager")
    f(torch.ones(4))
    if rank == 1:
        f(torch.ones(5))  # EXTRA_RECOMPILE
    torch.compile(later, backend="eager")(x)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
