"""FSDP2 training steps run eagerly and compiled, for the gloo tests and the benchmark.

A configuration is a dict of keyword arguments of :func:`build` and
:func:`train`; :func:`compare` trains the same model from the same seed
eagerly and compiled (forward compiled with the plugin, backward either eager
or under compiled autograd) and reports, per step, the largest difference of
the loss, of each gradient's local shard and of the parameters after the
optimizer step, plus the gradients' types and placements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

HIDDEN, INNER = 10, 6  # 10 rows over 4 ranks: 3, 3, 3, 1; 6 rows: 2, 2, 2, 0 (FSDP pads)


class Block(nn.Module):
    def __init__(self, hidden: int = HIDDEN, inner: int = INNER, checkpoint: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        self.checkpoint = checkpoint

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return x + torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)


class Net(nn.Module):
    """``[B, hidden] -> [B, hidden]``: an input projection, residual blocks (2 unless ``inners`` gives each
    block's inner width), an output projection.

    With ``norm``, a ``LayerNorm`` before the output projection (the final norm of a language model).
    """

    def __init__(
        self,
        *,
        tied: bool = False,
        checkpoint: str = "",
        hidden: int = HIDDEN,
        inner: int = INNER,
        inners: tuple[int, ...] | None = None,
        norm: bool = False,
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(hidden, hidden, bias=False)
        inside = checkpoint == "inside"  # activation checkpointing inside each block, or "outside" around it
        self.blocks = nn.ModuleList([Block(hidden, i, inside) for i in inners or (inner, inner)])
        self.out = nn.Linear(hidden, hidden, bias=False)
        if tied:
            self.out.weight = self.inp.weight
        self.checkpoint_outside = checkpoint == "outside"
        self.norm = nn.LayerNorm(hidden) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.checkpoint_outside:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.out(h)


def grad_records(net: Any) -> list[tuple[str, tuple[str, ...] | None, Any]]:
    """Each parameter's ``.grad`` as (type name, placements or None, local values or None), cloned."""
    from torch.distributed.tensor import DTensor

    return [
        (type(p.grad).__name__, tuple(map(str, p.grad.placements)), p.grad.to_local().detach().clone())
        if isinstance(p.grad, DTensor)
        else (type(p.grad).__name__, None, None if p.grad is None else p.grad.detach().clone())
        for p in net.parameters()
    ]


def build(
    world: int,
    *,
    nested: bool = True,
    reshard: bool | int = True,
    mp: tuple[torch.dtype, torch.dtype] | None = None,
    tied: bool = False,
    checkpoint: str = "",
    tp: bool = False,
    divide_factor: float | None = None,
    force_sum: bool = False,
    hidden: int = HIDDEN,
    inner: int = INNER,
    group: bool = False,
    inners: tuple[int, ...] | None = None,
    **_: Any,
) -> nn.Module:
    """The model sharded with ``fully_shard`` on a 1-D mesh (or FSDP over TP on a ``(2, W/2)`` mesh).

    ``group``: a final ``LayerNorm`` and the output projection sharded as one FSDP2 module group,
    ``fully_shard([net.norm, net.out])`` (torchtitan's plan for the final norm and the lm head); with
    ``tp`` the output projection is also ``ColwiseParallel`` (its output gathered to ``Replicate``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    net = Net(tied=tied, checkpoint=checkpoint, hidden=hidden, inner=inner, inners=inners, norm=group)
    if tp:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for block in net.blocks:
            parallelize_module(block, mesh2d["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if group:
            from torch.distributed.tensor import Replicate

            parallelize_module(net.out, mesh2d["tp"], ColwiseParallel(output_layouts=Replicate()))
        mesh = mesh2d["dp"]
    else:
        mesh = init_device_mesh("cpu", (world,))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    if mp is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp[0], reduce_dtype=mp[1])
    if nested:
        for block in net.blocks:
            fully_shard(block, **kwargs)
    if group:
        fully_shard([net.norm, net.out], **kwargs)
    fully_shard(net, **kwargs)
    for module in net.modules():
        if divide_factor is not None and hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(divide_factor)
        if force_sum and hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    return net


def batch(
    rank: int, step: int, micro: int = 0, *, tp: bool = False, rows: int = 4, hidden: int = HIDDEN
) -> torch.Tensor:
    """``[rows, hidden]`` fp32 input of one rank (the same across a TP group)."""
    seed = (rank // 2 if tp else rank) * 100 + step * 10 + micro
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))


def saved_bytes(net: nn.Module, model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """Bytes autograd holds for backward after one forward, per rank, then runs the backward.

    Counted once per storage when the forward has finished (so storage FSDP2
    frees after forward counts 0), leaving out the sharded parameters' own
    storage, which exists whether or not anything is saved.
    """
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    # Before the forward: eager FSDP2 with reshard_after_forward=False leaves the unsharded ones registered.
    params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage()._cdata for p in net.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).float().pow(2).mean()
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in saved}
    loss.backward()
    return sum(n for key, n in storages.items() if key not in params)


def train(
    net: nn.Module,
    model: Callable[[torch.Tensor], torch.Tensor],
    rank: int,
    *,
    steps: int = 3,
    accumulate: int = 1,
    no_sync: bool = False,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    tp: bool = False,
    **_: Any,
) -> list[dict[str, Any]]:
    """Train ``steps`` SGD steps; per step: loss, gradients (type, placements, local) and parameters."""

    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    record = []
    for step in range(steps):
        losses = []
        for micro in range(accumulate):
            if no_sync:
                net.set_requires_gradient_sync(micro == accumulate - 1)
            loss = model(batch(rank, step, micro, tp=tp)).float().pow(2).mean()
            backward(loss)
            losses.append(loss.detach())
        grads = grad_records(net)
        opt.step()
        opt.zero_grad()
        params = [p.to_local().detach().clone() for p in net.parameters()]
        record.append({"loss": torch.stack(losses), "grads": grads, "params": params})
    return record


def max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """Largest absolute difference; ``inf`` when shapes or presence differ."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def diff(eager: list[dict[str, Any]], compiled: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step largest differences and whether gradient types and placements agree."""
    return {
        "loss": max(max_diff(e["loss"], c["loss"]) for e, c in zip(eager, compiled)),
        "grads": max(max_diff(ge[2], gc[2]) for e, c in zip(eager, compiled) for ge, gc in zip(e["grads"], c["grads"])),
        "params": max(max_diff(pe, pc) for e, c in zip(eager, compiled) for pe, pc in zip(e["params"], c["params"])),
        "grad_kinds": [g[:2] for g in compiled[0]["grads"]],
        "grad_kinds_match": all(
            ge[:2] == gc[:2] for e, c in zip(eager, compiled) for ge, gc in zip(e["grads"], c["grads"])
        ),
    }
