"""Audit Hugging Face transformers' LlamaForCausalLM under TP + FSDP2 on 4 gloo ranks.

    pip install -e ".[examples]"        # transformers
    dynamo-ext audit --nproc 4 --compare-stock examples/hf_llama_audit.py

The model comes from a tiny ``LlamaConfig`` with random weights (nothing is
downloaded).  Each decoder layer is split over the "tp" axis of a (dp=2, tp=2)
mesh with ``parallelize_module`` (colwise q/k/v and gate/up, rowwise o and
down; the same plan as transformers' ``base_model_tp_plan``), then sharded
over "dp" with FSDP2 ``fully_shard`` per layer and at the root.  One step: the
compiled model runs forward and loss, ``loss.backward()`` runs eagerly (or
under compiled autograd with ``DYNAMO_EXT_EXAMPLE_COMPILED_AUTOGRAD=1``, which
torch 2.13 cannot do for this model yet), the optimizer steps eagerly.  The
same step also runs eagerly on a second copy of the model, and the example
fails (``RuntimeError`` naming the parameter) unless the compiled step's loss
and gradients (placements and local shards) match it.

Knobs: ``DYNAMO_EXT_EXAMPLE_BACKEND`` (default ``aot_eager``),
``DYNAMO_EXT_EXAMPLE_COMPILED_AUTOGRAD=1`` to trace the backward.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def build(mesh):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise SystemExit('examples/hf_llama_audit.py needs transformers: pip install -e ".[examples]"') from e
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, config


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dynamo_ext.audit.targets.example_llama import check_against_eager, compiled_backward

    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise ValueError(f"hf_llama_audit.py needs 4 ranks for its (dp=2, tp=2) mesh, got {dist.get_world_size()}")
    backend = os.environ.get("DYNAMO_EXT_EXAMPLE_BACKEND", "aot_eager")
    # Off by default: on torch 2.13 + transformers 5.x, compiled autograd fails inside
    # torch/_dynamo/compiled_autograd.py (is_placeholder on None), stock and plugin alike.
    trace_backward = os.environ.get("DYNAMO_EXT_EXAMPLE_COMPILED_AUTOGRAD", "0") == "1"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, config = build(mesh)
    reference, _ = build(mesh)  # the same step, eagerly, to check the compiled one
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=backend)

    gen = torch.Generator().manual_seed(1234 + mesh["dp"].get_local_rank())
    input_ids = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
    loss = compiled(input_ids=input_ids, labels=input_ids).loss
    with compiled_backward(backend, enabled=trace_backward):
        loss.backward()
    ref_loss = reference(input_ids=input_ids, labels=input_ids).loss
    ref_loss.backward()
    check_against_eager(model, reference, loss, ref_loss)  # raises, naming the first gradient that differs
    optim.step()
    optim.zero_grad()
    if dist.get_rank() == 0:
        print(f"hf_llama_audit: one step done, loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
