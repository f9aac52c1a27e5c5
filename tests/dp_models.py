"""Models, data and a training step shared by the data_parallel tests and benchmark.

Three small models of the kinds data-parallel users train (an MLP, a transformer, a conv
net), each with a loss that is a mean over the batch, and per-rank batches cut
from one global batch so every rank's part is known.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


class TinyTransformer(nn.Module):
    """One pre-norm encoder block (hand-written attention) over ``(batch, seq, dim)`` inputs, mean-pooled."""

    def __init__(self, dim: int = 16, heads: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (c // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(1))


class ConvNet(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1)
        )
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.features(x)).mean((2, 3)))


def build(kind: str, *, seed: int = 0, scale: int = 1) -> tuple[nn.Module, Any]:
    """The model (same weights on every rank) and a function ``(n, seed) -> (x, y)`` making a global batch of n."""
    torch.manual_seed(seed)
    if kind == "mlp":
        model = MLP(16 * scale, 32 * scale)

        def data(n: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(s)
            return torch.randn(n, 16 * scale, generator=g), torch.randn(n, 4, generator=g)

    elif kind == "transformer":
        model = TinyTransformer(16 * scale)

        def data(n: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(s)
            return torch.randn(n, 6, 16 * scale, generator=g), torch.randint(0, 5, (n,), generator=g)

    elif kind == "conv":
        model = ConvNet()

        def data(n: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(s)
            return torch.randn(n, 3, 8 * scale, 8 * scale, generator=g), torch.randint(0, 5, (n,), generator=g)

    else:
        raise ValueError(f"unknown model kind {kind!r}; choose mlp, transformer or conv")
    return model, data


def loss_fn(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean-over-the-batch loss: MSE for the MLP, cross-entropy for the classifiers."""
    return F.mse_loss(out, y) if kind == "mlp" else F.cross_entropy(out, y)


CLASSES = 5
IGNORED = 2
"""The class the ``ignore_index`` losses ignore; :func:`classification_data` gives it to every other sample."""
_WEIGHTS = (1.0, 2.0, 0.5, 1.5, 3.0)

CLASSIFICATION_LOSSES = (
    "cross_entropy",
    "cross_entropy_sum",
    "cross_entropy_ignore_index",
    "cross_entropy_label_smoothing",
    "cross_entropy_class_weights",
    "cross_entropy_weights_ignore_smoothing",
    "cross_entropy_weights_ignore_smoothing_sum",
    "cross_entropy_per_position",
    "nll_loss",
    "nll_loss_weights_ignore_index",
    "mse_one_hot",
    "bce_with_logits_pos_weight",
)
"""The losses of :func:`classification_loss`: the common classification losses and their options."""


def classification_loss(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss ``name`` (one of :data:`CLASSIFICATION_LOSSES`) of logits ``out`` against labels ``y``."""
    w = torch.tensor(_WEIGHTS)
    if name == "cross_entropy":
        return F.cross_entropy(out, y)
    if name == "cross_entropy_sum":
        return F.cross_entropy(out, y, reduction="sum")
    if name == "cross_entropy_ignore_index":
        return F.cross_entropy(out, y, ignore_index=IGNORED)
    if name == "cross_entropy_label_smoothing":
        return F.cross_entropy(out, y, label_smoothing=0.1)
    if name == "cross_entropy_class_weights":
        return F.cross_entropy(out, y, weight=w)
    if name.startswith("cross_entropy_weights_ignore_smoothing"):
        reduction = "sum" if name.endswith("_sum") else "mean"
        return F.cross_entropy(out, y, weight=w, ignore_index=IGNORED, label_smoothing=0.2, reduction=reduction)
    if name == "cross_entropy_per_position":  # (N, C, 2) logits against (N, 2) labels: nll_loss2d
        return F.cross_entropy(torch.stack([out, out.flip(1)], dim=2), torch.stack([y, (y + 1) % CLASSES], dim=1))
    if name == "nll_loss":
        return F.nll_loss(F.log_softmax(out, dim=1), y)
    if name == "nll_loss_weights_ignore_index":
        return F.nll_loss(F.log_softmax(out, dim=1), y, weight=w, ignore_index=IGNORED)
    if name == "mse_one_hot":
        return F.mse_loss(out, F.one_hot(y, CLASSES).float())
    if name == "bce_with_logits_pos_weight":  # multi-label: one_hot targets, a positive weight per class
        return F.binary_cross_entropy_with_logits(out, F.one_hot(y, CLASSES).float(), pos_weight=w)
    raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(CLASSIFICATION_LOSSES)}")


def classification_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of n samples of 16 features and labels in ``range(CLASSES)``, every even one ``IGNORED``."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 16, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    y[::2] = IGNORED
    return x, y


def local_part(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of dim 0 (even split)."""
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def make_step(kind: str, clip: float | None = None) -> Any:
    """The single-device training step ``data_parallel`` compiles: forward, mean loss, backward, SGD step.

    With ``clip``, gradients are clipped to that total norm before the step (in place, as eager does).
    """

    def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(kind, model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return loss.detach()

    return step


def compiled_autograd_step(model: nn.Module, kind: str, backend: Any) -> Any:
    """``step(x, y)``: forward, mean loss and ``loss.backward()`` in one ``torch.compile``'d function with compiled
    autograd on (what DDP's python reducer, ``optimize_ddp="python_reducer"``, needs); returns the loss."""
    with torch._dynamo.config.patch(compiled_autograd=True):

        @torch.compile(backend=backend)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(kind, model(x), y)
            loss.backward()
            return loss

    return step
