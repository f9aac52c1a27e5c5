"""Audit Hugging Face transformers' MixtralForCausalLM with expert parallelism + TP + FSDP2 on 4 gloo ranks.

    pip install -e ".[examples]"        # transformers
    dynamo-ext audit --nproc 4 --check-numerics examples/hf_mixtral_audit.py

The model comes from a tiny ``MixtralConfig`` (1 decoder layer, 4 experts,
top-2 routing, random weights; nothing is downloaded) and is laid out the way
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2,
fsdp_size=2, ep_size=2))`` lays it out, with transformers' own plans
(``base_model_tp_plan``, ``base_model_ep_plan``, the FSDP plan) applied by
``prepare_distribute_model`` / ``maybe_distribute_model`` (what
``from_pretrained`` calls; the weights stay the random ones instead of being
loaded, so ``accelerate`` is not needed):

- a dense mesh ("pp"=1, "fsdp"=2, "tp"=2): attention q/k/v colwise and o
  rowwise over "tp", the embedding sharded on the vocabulary and ``lm_head``
  colwise (gathered output) over "tp"; FSDP2 ``fully_shard`` over "fsdp";
- an expert mesh ("efsdp"=2, "ep"=2): the fused 3-D expert weights
  (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) ``Shard(0)`` on the
  expert dim over "ep" (2 of the 4 experts per rank), FSDP2 over "efsdp";
  tokens reach their experts through transformers' ``AllToAllEP`` (the training
  path of ``ep_implementation="auto"``): ``all_to_all_single`` of the token
  counts, ``.tolist()`` of the split sizes, ``all_to_all_single_autograd`` of
  the tokens there and of the expert outputs back.

One step (:func:`make_step`, the audit's step protocol): the compiled model
(``torch.compile``, ``DYNAMO_EXT_EXAMPLE_BACKEND``, default ``aot_eager``)
runs forward and loss, ``loss.backward()`` runs eagerly, then the optimizer
(AdamW) steps.  :func:`main` runs that step compiled and eagerly from the same
state (``dynamo_ext.audit.rank.numerics.check_step``) and raises ``RuntimeError``
naming the first output, gradient (placements, local shard) or parameter after
the optimizer step that differs.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def build(distributed_config, mesh_manager):
    """The tiny Mixtral, seeded, laid out by transformers' plans on ``mesh_manager``'s meshes."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)  # the same full weights on every rank; each keeps its shards
    model = MixtralForCausalLM(config)
    model.train()
    return MixtralForCausalLM.maybe_distribute_model(model, distributed_config, mesh_manager), config


def make_step():
    """The audit's step protocol (docs/audit.md, "Numerics check"): the parallelized model, AdamW, ``step(compiled)``.

    ``step(True)`` runs forward and loss through ``torch.compile``, ``step(False)``
    eagerly; both run ``loss.backward()`` eagerly and return ``{"loss", "logits"}``.
    Needs the default process group with 4 ranks (gloo on CPU).

    Raises:
        SystemExit: transformers is not installed.
        ValueError: the world size is not 4.
    """
    try:
        from transformers import MixtralForCausalLM
        from transformers.distributed import DistributedConfig
    except ImportError as e:
        raise SystemExit('examples/hf_mixtral_audit.py needs transformers>=5: pip install -e ".[examples]"') from e
    world = dist.get_world_size()
    if world != 4:
        raise ValueError(
            f"hf_mixtral_audit.py needs 4 ranks for its (fsdp=2, tp=2) and (efsdp=2, ep=2) meshes, got {world}; "
            "use --nproc 4"
        )
    backend = os.environ.get("DYNAMO_EXT_EXAMPLE_BACKEND", "aot_eager")
    distributed_config, _, mesh_manager = MixtralForCausalLM.prepare_distribute_model(
        DistributedConfig(tp_size=2, fsdp_size=2, ep_size=2)
    )
    model, config = build(distributed_config, mesh_manager)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=backend)

    # the two ranks of a tp group share a batch; the fsdp groups differ
    gen = torch.Generator().manual_seed(1234 + mesh_manager.get_mesh("fsdp").get_local_rank())
    input_ids = torch.randint(0, config.vocab_size, (2, 16), generator=gen)

    def step(use_compile: bool) -> dict[str, torch.Tensor]:
        out = (compiled if use_compile else model)(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        return {"loss": out.loss, "logits": out.logits}

    return model, optim, step


def main() -> None:
    """One training step compiled and eagerly from the same state, compared; needs 4 ranks."""
    from dynamo_ext.audit.rank.numerics import as_step, check_step

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    result = check_step(as_step(make_step()))  # eager step, then the compiled step from the same state
    if result["mismatches"]:
        first = result["mismatches"][0]
        raise RuntimeError(
            f"rank {dist.get_rank()}: the compiled step differs from eager: {first['kind']} {first['name']} "
            f"({first['detail']}, max abs {first['max_abs']}, max rel {first['max_rel']}); "
            f"{len(result['mismatches'])} of {result['compared']} tensors differ"
        )
    if dist.get_rank() == 0:
        print(f"hf_mixtral_audit: one step compiled and eagerly, {result['compared']} tensors per rank agree")
    if created:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
