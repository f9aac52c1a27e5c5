"""The bundled audit target: a small Llama-style decoder, TP + FSDP2 on a 2-D mesh, one training step.

``dynamo-ext audit`` with no TARGET runs :func:`main` on 4 ranks (gloo on CPU):
a ``("dp", "tp")`` mesh of shape (2, 2); attention and SwiGLU MLP weights are
split over "tp" with ``parallelize_module`` (colwise q/k/v and gate/up,
rowwise o and down), every block and the root are sharded over "dp" with
FSDP2 ``fully_shard``; the model is compiled with ``torch.compile`` and takes
one step: the compiled model runs the forward, ``loss.backward()`` runs
under compiled autograd (the backward and its hooks traced too), the
optimizer steps eagerly.  The same step runs eagerly on a copy of the model,
and the loss and gradients must match it (:func:`check_against_eager` raises).

``make_step()`` exposes the same step to the audit's numerics check
(``--check-numerics``, on by default for this example): compiled vs eager
from the same state.

Also runnable under torchrun:
``torchrun --nproc-per-node 4 -m dynamo_ext.audit.targets.example_llama``.
Environment knobs: ``DYNAMO_EXT_EXAMPLE_BACKEND`` (default ``aot_eager``),
``DYNAMO_EXT_EXAMPLE_COMPILED_AUTOGRAD=0`` (leave the backward to eager
autograd).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812  (the usual name)
from torch import nn


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    hidden: int = 128
    seq: int = 16
    batch: int = 2
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: after colwise TP each rank holds n_heads / tp of them.
        q = self.wq(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: Decoder, mesh: object) -> Decoder:
    """TP over mesh["tp"] inside each block, then FSDP2 over mesh["dp"] per block and at the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp, dp = mesh["tp"], mesh["dp"]  # type: ignore[index]
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, tp, plan)
    for block in model.layers:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def compiled_backward(backend: str, *, enabled: bool = True) -> contextlib.AbstractContextManager[object]:
    """Trace the backward (FSDP2's and TP's hooks included) with compiled autograd.

    Compiled autograd's entry point is private (see ``dynamo_ext._compat.compiled_autograd``);
    torchtitan's training loop uses it too.  Without it the backward runs eagerly.
    """
    if not enabled:
        return contextlib.nullcontext()
    from dynamo_ext import _compat

    return _compat.compiled_autograd(torch.compile(backend=backend))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _placements(t: torch.Tensor) -> tuple[object, ...] | None:
    """A DTensor's placements; ``None`` for a plain tensor."""
    placements = getattr(t, "placements", None)
    return None if placements is None else tuple(placements)


def _describe(t: torch.Tensor) -> str:
    """``DTensor(Shard(dim=0), Replicate()) local [32, 64]`` or ``Tensor [64, 64]``."""
    placements = _placements(t)
    if placements is None:
        return f"{type(t).__name__} {list(t.shape)}"
    return f"DTensor({', '.join(map(str, placements))}) local {list(_local(t).shape)}"


def check_against_eager(model: nn.Module, reference: nn.Module, loss: torch.Tensor, ref_loss: torch.Tensor) -> None:
    """Compare a compiled step's loss and gradients (type, placements, local shards) with an eager step's.

    ``model`` and ``reference`` have the same parameters in the same order; their ``.grad`` (DTensors
    or plain tensors, fp32) are compared: present or not, then the type and DTensor placements, then
    the local values (rtol 1e-4, atol 1e-5; shapes must match).

    Raises:
        RuntimeError: something differs.  The message names the rank and what differs, first the
            summary when gradients are plain tensors where eager's are DTensors (they were never
            reduced to their sharded form: what FSDP2's reduce-scatter produces), then up to five
            tensors with compiled and eager side by side.
    """

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)

    problems = []
    if not close(loss.detach(), ref_loss.detach()):
        problems.append(f"loss: compiled {loss.item():.6f}, eager {ref_loss.item():.6f}")
    not_reduced, with_grad = 0, 0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if (p.grad is None) != (q.grad is None):
            problems.append(f"{name}.grad: compiled {type(p.grad).__name__}, eager {type(q.grad).__name__}")
            continue
        if p.grad is None or q.grad is None:
            continue
        with_grad += 1
        pp, qp = _placements(p.grad), _placements(q.grad)
        if pp != qp:
            not_reduced += pp is None
            problems.append(f"{name}.grad: compiled {_describe(p.grad)}, eager {_describe(q.grad)}")
        elif not close(_local(p.grad), _local(q.grad)):
            a, b = _local(p.grad), _local(q.grad)
            err = f"max abs difference {float((a - b).abs().max())}" if a.shape == b.shape else "shape differs"
            problems.append(f"{name}.grad: {err} from eager ({_describe(p.grad)}, eager {_describe(q.grad)})")
    if not_reduced:
        # NOTE: a plain gradient where eager has a DTensor one is the unsharded gradient nothing reduced:
        # FSDP2's post-backward reduce-scatter is what turns it into the sharded DTensor eager has.
        problems.insert(
            0,
            f"gradients not reduced: {not_reduced} of {with_grad} are plain tensors, not sharded DTensors as eager's "
            "(FSDP2's post-backward reduce-scatter did not produce them)",
        )
    if problems:
        raise RuntimeError(f"rank {dist.get_rank()}: the compiled step differs from eager: " + "; ".join(problems[:6]))


def make_step() -> tuple[Decoder, torch.optim.Optimizer, Callable[[bool], dict[str, torch.Tensor]]]:
    """The audit's step protocol (docs/audit.md, "Numerics check"): the parallelized model, AdamW, ``step(compiled)``.

    ``step(True)`` runs the forward through ``torch.compile`` and ``loss.backward()``
    under compiled autograd (unless ``DYNAMO_EXT_EXAMPLE_COMPILED_AUTOGRAD=0``);
    ``step(False)`` runs both eagerly.  Both return ``{"loss", "logits"}``.  Needs
    the default process group with 4 ranks.

    Raises:
        ValueError: the world size is not 4.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world != 4:
        raise ValueError(f"the bundled example needs 4 ranks for its (dp=2, tp=2) mesh, got {world}; use --nproc 4")
    backend = os.environ.get("DYNAMO_EXT_EXAMPLE_BACKEND", "aot_eager")
    trace_backward = os.environ.get("DYNAMO_EXT_EXAMPLE_COMPILED_AUTOGRAD", "1") == "1"

    cfg = Config()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize(Decoder(cfg), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=backend)

    dp_rank = mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(1234 + dp_rank)  # same batch on both tp ranks of a dp group
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)

    def step(use_compile: bool) -> dict[str, torch.Tensor]:
        logits = (compiled if use_compile else model)(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        with compiled_backward(backend, enabled=trace_backward and use_compile):
            loss.backward()
        return {"loss": loss, "logits": logits}

    return model, optim, step


def main() -> None:
    """One compiled training step on a (dp=2, tp=2) mesh, checked against eager; needs 4 ranks."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    model, optim, step = make_step()
    loss = step(True)["loss"]
    reference, _, reference_step = make_step()  # the same step, eagerly, from the same initial state
    check_against_eager(model, reference, loss, reference_step(False)["loss"])
    optim.step()
    optim.zero_grad()
    if dist.get_rank() == 0:
        print(f"example_llama: one step done, loss {loss.item():.4f}")
    if created:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
