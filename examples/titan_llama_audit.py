"""Audit a torchtitan-style Llama 3 training step: TP + sequence parallel + FSDP2 + activation checkpointing.

    dynamo-ext audit --nproc 4 --check-numerics examples/titan_llama_audit.py

A (dp=2, tp=2) mesh of 4 ranks (gloo on CPU), a tiny Llama 3 with random
weights (dim 64, 2 layers, 4 query heads and 2 KV heads, vocab 256, sequence
16; nothing is downloaded), parallelized the way torchtitan v0.2.2 does it.
Each piece follows a torchtitan file (``git show v0.2.2:<path>`` in
pytorch/torchtitan):

- the model: ``torchtitan/models/llama3/model/model.py`` (RMSNorm, RoPE with
  Llama 3 frequency scaling as complex multiplication, GQA attention through
  SDPA, SwiGLU feed-forward with ``multiple_of`` rounding, untied output);
- ``apply_tp``, ``apply_fsdp``: ``torchtitan/models/llama3/infra/parallelize.py``
  (rowwise embedding to ``Shard(1)``, ``SequenceParallel`` norms,
  ``PrepareModuleInput`` for attention and feed-forward, colwise/rowwise
  projections with ``use_local_output``, a colwise output to ``Shard(-1)``
  for loss parallel; ``fully_shard`` on the embedding, every block, the
  ``[norm, output]`` group and the root, with FSDP's gradient division off);
- ``apply_ac``: ``torchtitan/distributed/activation_checkpoint.py`` (full AC:
  ``checkpoint_wrapper`` per block, applied before FSDP);
- the loss: ``torchtitan/components/loss.py`` and ``torchtitan/train.py``
  (summed cross-entropy under ``loss_parallel()``, divided by the number of
  valid tokens over the data-parallel ranks).

Unlike torchtitan, which compiles each block, the forward and the loss are one
``torch.compile`` call, so FSDP2's and TP's hooks are traced (the plugin's job),
those of the ``[norm, output]`` FSDP2 module group included: one graph, no
graph break.  The backward runs on the eager autograd engine by default;
``DYNAMO_EXT_EXAMPLE_COMPILED_AUTOGRAD=1`` traces it with compiled autograd
(one backward graph, the same numbers).  The optimizer (AdamW) steps eagerly.  Two CPU-only departures: parameters stay fp32
(``MixedPrecisionPolicy(float32, float32)``; torchtitan trains in bf16 on
GPUs), and FSDP2 reduces with a plain sum (``set_force_sum_reduction_for_comms``:
gloo has no ``PREMUL_SUM``, which a divide factor of 1 asks for otherwise).

``main()`` runs the step compiled and eagerly from the same state
(``dynamo_ext.audit.check_step``) and raises ``RuntimeError`` naming the
first tensor that differs (loss, gradient type/placements/local shard, or a
parameter after the optimizer step).  ``make_step()`` is the audit's step
protocol (``--check-numerics``).  Knobs: ``DYNAMO_EXT_EXAMPLE_BACKEND``
(default ``aot_eager``), ``DYNAMO_EXT_EXAMPLE_COMPILED_AUTOGRAD`` (default 0),
``DYNAMO_EXT_TITAN_AC`` (``full`` (default), ``op`` for torchtitan's
selective op AC, ``none``), ``DYNAMO_EXT_TITAN_LOSS_PARALLEL`` (default 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812  (the usual name)
from torch import nn


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """torchtitan's ``TransformerModelArgs``, tiny; Llama 3's RoPE scaling constants."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 16
    scaling_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def precompute_freqs_cis(args: ModelArgs) -> torch.Tensor:
    """RoPE frequencies with Llama 3 scaling, complex64 ``[max_seq_len, head_dim // 2]`` (torchtitan's)."""
    dim = args.dim // args.n_heads
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    wavelen = 2 * math.pi / freqs
    high_freq_wavelen = args.original_max_position_embeddings / args.high_freq_factor
    low_freq_wavelen = args.original_max_position_embeddings / args.low_freq_factor
    freqs = torch.where(wavelen > low_freq_wavelen, freqs / args.scaling_factor, freqs)
    smooth = (args.original_max_position_embeddings / wavelen - args.low_freq_factor) / (
        args.high_freq_factor - args.low_freq_factor
    )
    smoothed = (1 - smooth) * freqs / args.scaling_factor + smooth * freqs
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    freqs = torch.where(is_medium, smoothed, freqs)
    freqs = torch.outer(torch.arange(args.max_seq_len), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``xq``/``xk`` (``[bs, seq, heads, head_dim]``) by ``freqs_cis`` as complex numbers."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    seqlen = xq_.shape[1]
    freqs_cis = freqs_cis[0:seqlen].view(1, seqlen, 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.enable_gqa = args.n_heads > args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 heads: after colwise TP each rank holds n_heads / tp query heads and n_kv_heads / tp KV heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True, enable_gqa=self.enable_gqa
        )
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU ``w2(silu(w1(x)) * w3(x))``; hidden size 2/3 of ``4 * dim`` rounded up to ``multiple_of``."""

    def __init__(self, dim: int, hidden_dim: int, multiple_of: int) -> None:
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 3: tokens ``int64[bs, seq]`` -> logits ``[bs, seq, vocab_size]`` (``Shard(-1)`` DTensor under loss parallel)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # torchtitan's init_weights, in short: depth-scaled std for wo/w2/w3, truncated normal output.
        for block in self.layers.values():
            std = 0.02 / (2 * args.n_layers) ** 0.5
            for lin in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
            for lin in (block.attention.wo, block.feed_forward.w2, block.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=std)
        std = args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def apply_tp(model: Transformer, tp_mesh: object, *, loss_parallel: bool) -> None:
    """torchtitan's ``apply_tp`` (sequence parallel between blocks; float8 and async TP left out)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)


# torchtitan's _op_sac_save_list, the ops that exist on CPU: save matmuls (every other one) and attention.
_OP_SAC_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_attention_math.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def _op_sac_context_fn() -> tuple[object, object]:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    meta: defaultdict[str, int] = defaultdict(int)

    def policy(ctx: object, func: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"  # type: ignore[attr-defined]
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        save = func in _OP_SAC_SAVE_LIST and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(model: Transformer, mode: str) -> None:
    """torchtitan's ``apply_ac``: every block in ``checkpoint_wrapper`` (``mode`` "full", or "op" for selective op AC).

    Raises:
        ValueError: ``mode`` is not "full", "op" or "none".
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode not in ("full", "op", "none"):
        raise ValueError(f"DYNAMO_EXT_TITAN_AC must be 'full', 'op' or 'none', got {mode!r}")
    if mode == "none":
        return
    for layer_id, block in list(model.layers.named_children()):
        kwargs = {"context_fn": _op_sac_context_fn} if mode == "op" else {}
        model.layers.register_module(layer_id, checkpoint_wrapper(block, preserve_rng_state=False, **kwargs))


def apply_fsdp(model: Transformer, dp_mesh: object) -> None:
    """torchtitan's ``apply_fsdp`` (default reshard policy, no PP) and ``disable_fsdp_gradient_division``."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    config = {"mesh": dp_mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)}
    fully_shard(model.tok_embeddings, **config, reshard_after_forward=True)
    for block in model.layers.values():
        fully_shard(block, **config, reshard_after_forward=True)
    fully_shard([model.norm, model.output], **config, reshard_after_forward=False)
    fully_shard(model, **config)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # the loss is divided by the global token count instead
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def make_step() -> tuple[Transformer, torch.optim.Optimizer, object]:
    """The audit's step protocol (docs/audit.md, "Numerics check"): the parallelized model, AdamW, ``step(compiled)``.

    ``step(True)`` runs the forward and the loss through one ``torch.compile`` call and
    ``loss.backward()`` eagerly (under compiled autograd with ``DYNAMO_EXT_EXAMPLE_COMPILED_AUTOGRAD=1``);
    ``step(False)`` runs both eagerly.  Both return ``{"loss"}`` (a replicated DTensor under loss
    parallel).  Needs the default process group with 4 ranks.

    Raises:
        ValueError: the world size is not 4, or a knob has a bad value.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx

    from dynamo_ext.audit.targets.example_llama import compiled_backward

    world = dist.get_world_size()
    if world != 4:
        raise ValueError(f"titan_llama_audit.py needs 4 ranks for its (dp=2, tp=2) mesh, got {world}; use --nproc 4")
    backend = os.environ.get("DYNAMO_EXT_EXAMPLE_BACKEND", "aot_eager")
    # Off by default (the audit's report is checked with the eager backward); on, the backward is one graph.
    trace_backward = os.environ.get("DYNAMO_EXT_EXAMPLE_COMPILED_AUTOGRAD", "0") == "1"
    ac_mode = os.environ.get("DYNAMO_EXT_TITAN_AC", "full")
    loss_parallel = os.environ.get("DYNAMO_EXT_TITAN_LOSS_PARALLEL", "1") == "1"

    args = ModelArgs()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Transformer(args)
    apply_tp(model, mesh["tp"], loss_parallel=loss_parallel)
    apply_ac(model, ac_mode)
    apply_fsdp(model, mesh["dp"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # torchtitan's data loader gives each dp rank its own batch; the tp ranks of a dp group share it.
    gen = torch.Generator().manual_seed(1234 + mesh["dp"].get_local_rank())
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    # train.py: the loss is a token sum divided by the valid tokens of all dp ranks (no label is ignored here).
    global_valid_tokens = torch.tensor(float(labels.numel()))
    dist.all_reduce(global_valid_tokens, group=mesh["dp"].get_group())

    def forward_loss(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pred = model(inputs)
        loss_sum = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
        return loss_sum / global_valid_tokens

    compiled = torch.compile(forward_loss, backend=backend)

    def step(use_compile: bool) -> dict[str, torch.Tensor]:
        # torchtitan's train_context: loss parallel around the forward and the backward, outside torch.compile.
        with loss_parallel_ctx() if loss_parallel else contextlib.nullcontext():
            loss = (compiled if use_compile else forward_loss)(inputs, labels)
            with compiled_backward(backend, enabled=trace_backward and use_compile):
                loss.backward()
        return {"loss": loss}

    return model, optim, step


def main() -> None:
    """One compiled training step on a (dp=2, tp=2) mesh, checked against the same step run eagerly; 4 ranks.

    ``torch.compile`` here is whatever the process has: the plugin under ``dynamo-ext audit`` (stock torch
    for ``--compare-stock``'s stock run).  Launched directly (``torchrun --nproc-per-node 4``), it is stock
    ``torch.compile``, which fails on this model (docs/audit.md); call ``dynamo_ext.install()`` first to
    run it with the plugin.
    """
    from dynamo_ext.audit import Step, check_step

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    model, optim, step = make_step()
    # The eager step, then the compiled one from the same state: loss, gradients, parameters after AdamW.
    result = check_step(Step(model, optim, step), rtol=1e-4, atol=1e-5)
    if result["mismatches"]:
        first = result["mismatches"][0]
        raise RuntimeError(
            f"rank {dist.get_rank()}: the compiled step differs from eager in {len(result['mismatches'])} of "
            f"{result['compared']} tensors; first: {first['kind']} {first['name']} ({first['detail']}, "
            f"max abs {first['max_abs']}, max rel {first['max_rel']})"
        )
    if dist.get_rank() == 0:
        print(f"titan_llama_audit: one step done, {result['compared']} tensors equal to eager")
    if created:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
