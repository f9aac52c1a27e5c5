"""Backward hooks that call c10d collectives, compiled vs eager on 4 gloo ranks (tier 2).

One launch runs every scenario; each compares, on every rank, the losses,
the gradients and the parameters after 3 SGD steps, and what the hooks saw
(in order), with eager.  Inputs differ per rank, so a skipped or doubled
all-reduce changes the numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import run_on_ranks

pytestmark = pytest.mark.gloo


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _ddp_tensor_hooks(model: nn.Module, seen: list) -> None:
    """DDP's pattern on ``param.register_hook``: all-reduce the gradient, divide by the world size."""
    ws = dist.get_world_size()
    for name, p in model.named_parameters():

        def hook(g, name=name):
            seen.append((name, g.detach().clone()))
            g = g.clone()
            dist.all_reduce(g)
            return g / ws

        p.register_hook(hook)


def _ddp_post_accumulate_hooks(model: nn.Module, seen: list) -> None:
    """The same after accumulation: ``register_post_accumulate_grad_hook`` reduces ``p.grad`` in place."""
    ws = dist.get_world_size()
    for name, p in model.named_parameters():

        def hook(p, name=name):
            seen.append((name, p.grad.detach().clone()))
            dist.all_reduce(p.grad)
            p.grad.div_(ws)

        p.register_post_accumulate_grad_hook(hook)


def _module_hooks(model: nn.Module, seen: list) -> None:
    """Module hooks: a pre-hook scales grad_output, a full hook all-reduces grad_input (averaged)."""
    ws = dist.get_world_size()

    def pre(mod, grad_output):
        seen.append(("down.pre", grad_output[0].detach().clone()))
        return (grad_output[0] * 0.5,)

    def full(mod, grad_input, grad_output):
        seen.append(("down.full", grad_input[0].detach().clone(), grad_output[0].detach().clone()))
        g = grad_input[0].clone()
        dist.all_reduce(g)
        return (g / ws,)

    model.down.register_full_backward_pre_hook(pre)
    model.down.register_full_backward_hook(full)


HOOKS = {"tensor": _ddp_tensor_hooks, "post_accumulate": _ddp_post_accumulate_hooks, "module": _module_hooks}


def _train(rank, install, compiled: bool, compiled_autograd: bool, ca_graphs: list):
    torch.manual_seed(0)
    model = MLP()
    seen: list = []
    install(model, seen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fn = torch.compile(lambda x: model(x), backend="aot_eager", fullgraph=True) if compiled else model
    g = torch.Generator().manual_seed(100 + rank)
    losses, grads, all_seen = [], [], []
    for _ in range(3):
        x = torch.randn(6, 8, generator=g)
        opt.zero_grad(set_to_none=True)

        def step(x=x):
            loss = fn(x).pow(2).mean()
            loss.backward()
            return loss

        if compiled_autograd:

            def backend(gm, example_inputs):
                ca_graphs.append(gm.code)
                return gm.forward

            from dynamo_ext import _compat

            with _compat.compiled_autograd(torch.compile(backend=backend, fullgraph=True)):
                loss = step()
        else:
            loss = step()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        # Emptied every step, so the compiled-autograd graph (which appends to it) is not recompiled.
        all_seen.append(list(seen))
        seen.clear()
    return losses, grads, [p.detach().clone() for p in model.parameters()], all_seen


def _close(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    return a == b


def _scenarios(rank: int, world_size: int) -> dict:
    from torch._dynamo.utils import counters

    out = {}
    # Tensor hooks without compiled autograd run on leaf tensors in the eager engine, plugin or not
    # (they fire in the order of the AccumulateGrad nodes after the compiled backward node, as stock).
    for hooks, ca in [("tensor", True), ("post_accumulate", True), ("module", False), ("module", True)]:
        name = f"{hooks}-{'ca' if ca else 'no_ca'}"
        torch._dynamo.reset()
        counters.clear()
        ca_graphs: list = []
        try:
            eager = _train(rank, HOOKS[hooks], False, False, [])
            got = _train(rank, HOOKS[hooks], True, ca, ca_graphs)
            out[name] = {
                "loss": _close(got[0], eager[0]),
                "grads": _close(got[1], eager[1]),
                "params": _close(got[2], eager[2]),
                "seen_order": [[e[0] for e in st] for st in got[3]] == [[e[0] for e in st] for st in eager[3]],
                "seen_values": _close([[e[1:] for e in st] for st in got[3]], [[e[1:] for e in st] for st in eager[3]]),
                "breaks": sum(counters["graph_break"].values()),
                "ca_graphs": len(ca_graphs),
                "ca_all_reduce": any("_c10d_functional.all_reduce" in c for c in ca_graphs),
            }
        except Exception as e:  # reported per scenario, with the others still run
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        dist.barrier()
    return out


def test_hooks_with_collectives_match_eager_on_4_ranks():
    results = run_on_ranks(_scenarios, nproc=4)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert "error" not in r, (rank, name, r)
            assert r["loss"] and r["grads"] and r["params"], (rank, name, r)
            assert r["seen_order"] and r["seen_values"], (rank, name, r)
            assert r["breaks"] == 0, (rank, name, r)
            if name.endswith("-ca"):
                # The backward, hooks and their collectives included, is one compiled-autograd graph per step
                # (fullgraph=True), with the all-reduce traced as a functional collective.
                # One graph for the 3 steps: no recompile after step 1.
                assert r["ca_graphs"] == 1 and r["ca_all_reduce"], (rank, name, r)
            else:
                assert r["ca_graphs"] == 0, (rank, name, r)
