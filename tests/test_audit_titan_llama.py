"""``dynamo-ext audit --check-numerics`` of examples/titan_llama_audit.py: a torchtitan-style Llama 3 training step
(TP + sequence parallel + FSDP2 + full activation checkpointing + loss parallel) on 4 gloo ranks, report checked.

What the audit finds on torch 2.13 (asserted exactly below, so a change in either direction shows up):

- no graph break and no recompile: the forward and the loss are one graph, with the hooks of every FSDP2
  state traced, the ``[norm, output]`` module group (``fully_shard([model.norm, model.output])``) included
  (its parameters all-gathered once, at ``norm``), and TP's module hooks inlined;
- 0 numerics mismatches in 43 tensors per rank (loss, 21 gradients, 21 parameters after AdamW).

The collective counts cover the compiled graph only; eager ``CommDebugMode`` counts FSDP2's flat all-gather
and reduce-scatter per parameter group where the graph has an all-gather per group and a reduce-scatter per
parameter.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_audit_e2e import REPO, cli

EXAMPLE = REPO / "examples" / "titan_llama_audit.py"


def test_module_path_drops_checkpoint_wrapper_and_module_dict_spelling():
    """The communication report names modules by their FQNs (as the state_dict does), not by Dynamo's spelling."""
    from dynamo_ext.audit.rank.comm import module_path

    def node(path):
        return SimpleNamespace(meta={"nn_module_stack": {"k": (path, object)}})

    wrapped = "L['self'].layers.0.__dict__['_modules']['_checkpoint_wrapped_module'].attention.wo"
    assert module_path(node(wrapped)) == "layers.0.attention.wo"
    assert module_path(node("L['self'].__dict__['_modules']['norm']")) == "norm"
    assert module_path(node("L['self'].layers.0.feed_forward")) == "layers.0.feed_forward"
    assert module_path(node("L['self']")) == "<root>"
    assert module_path(SimpleNamespace(meta={})) is None


@pytest.mark.gloo
def test_titan_llama_training_step_audit():
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        proc = cli("--nproc", "4", "--check-numerics", "--json", str(out), "--quiet", str(EXAMPLE), timeout=480)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads(out.read_text())
    example = "examples/titan_llama_audit.py"
    assert report["totals"] == {
        "graph_breaks": 0,
        "recompiles": 0,
        "graphs": 1,
        "hang_risks": [],
        "numerics_mismatches": 0,
        "comm_bytes_per_step": 470400,
    }, report["totals"]
    assert report["graph_breaks"] == [] and report["recompiles"] == []

    graphs = [(g["file"], g["id"].split(" |")[0].split(" ")[-1], g["phase"]) for g in report["graphs"]]
    assert graphs == [(example, "forward_loss", "forward")], graphs
    assert all(g["ranks"] == [0, 1, 2, 3] for g in report["graphs"])

    assert report["numerics"] == {
        "compared": 43,
        "ranks": [0, 1, 2, 3],
        "mismatches": [],
        "steps": 1,
        "tolerances": [],
    }, report["numerics"]
    _check_comm(report["comm"], example)


def _check_comm(comm, example):
    runs = [c for c in comm["collectives"] if not c["inlined"]]
    assert len(runs) == len(comm["collectives"]) == 61, len(comm["collectives"])
    by = Counter(
        (c["graph"].split(" |")[0].split(" ")[-1], c["graph_kind"], c["kind"], c["mesh_axis"], c["origin"])
        for c in runs
    )
    assert by == {
        # one graph: FSDP2's all-gathers over "dp", one per param group (NOTE [FSDP2 gathers per group]: the root's
        # embedding, each block's 9 parameters, the [norm, output] group) ...
        ("forward_loss", "forward", "all_gather", "dp", "fsdp"): 4,
        # ... PrepareModuleInput's Shard(1) -> Replicate gathers before attention and feed-forward, and output's ...
        ("forward_loss", "forward", "all_gather", "tp", "dtensor"): 5,
        # ... the rowwise embedding, wo and w2 reduce-scattering to Shard(1) (sequence parallel) ...
        ("forward_loss", "forward", "reduce_scatter", "tp", "dtensor"): 5,
        # ... and loss parallel: the max, the sum of exponentials and the target logits over the vocabulary shards
        ("forward_loss", "forward", "all_reduce", "tp", "dtensor"): 3,
        # its backward: the blocks re-gathered (reshard_after_forward; the embedding's backward needs no weight,
        # the group keeps its unsharded parameters: reshard_after_forward=False),
        ("forward_loss", "backward", "all_gather", "dp", "fsdp"): 2,
        ("forward_loss", "backward", "all_gather", "tp", "dtensor"): 9,
        # (7, not the 8 of the graph compiled whole: cut at its blocks (NOTE [the audit compiles each block]), the
        # last block's output is an input of the part after the blocks and saved there for the final norm, where
        # the whole graph recomputed it from the checkpointed block, feed_forward.w2's reduce-scatter included)
        ("forward_loss", "backward", "reduce_scatter", "tp", "dtensor"): 7,
        # FSDP2's per-parameter gradient reduce-scatters, and the Replicate-on-"tp" norm weights' all-reduces
        ("forward_loss", "backward", "reduce_scatter", "dp", "fsdp"): 21,
        ("forward_loss", "backward", "all_reduce", "tp", "fsdp"): 5,
    }, by
    for c in runs:
        assert c["line"] > 0 and c["file"] and c["sent"] > 0 and c["bytes_in"] > 0, c
        assert c["ranks"] == [0, 1, 2, 3] and c["group_size"] == 2, c
        assert "__dict__" not in c["module"] and "_checkpoint_wrapped_module" not in c["module"], c
    block_modules = {c["module"] for c in runs if c["origin"] == "dtensor" and c["module"].startswith("layers.")}
    assert block_modules == {
        f"layers.{i}.{m}" for i in (0, 1) for m in ("attention", "attention.wo", "feed_forward", "feed_forward.w2")
    }, block_modules
    # the group's gathers sit at its first module called
    assert {c["module"] for c in runs if c["origin"] == "fsdp" and c["graph_kind"] == "forward"} == {
        "tok_embeddings",
        "layers.0",
        "layers.1",
        "norm",
    }
    assert comm["bytes_by_rank"] == [[r, 470400] for r in range(4)] and comm["missing"] == [], comm["bytes_by_rank"]
    assert comm["counts"] == [
        ["backward", "all_gather", 11],
        ["backward", "all_reduce", 5],  # the norm weights' all-reduces, per parameter as eager FSDP2
        ["backward", "reduce_scatter", 11],
        ["forward", "all_gather", 9],
        ["forward", "all_reduce", 3],
        ["forward", "reduce_scatter", 5],
    ], comm["counts"]
    assert comm["eager_counts"] == [
        ["backward", "all_gather", 12],
        ["backward", "all_reduce", 5],
        ["backward", "reduce_scatter", 11],
        ["forward", "all_gather", 9],
        ["forward", "all_reduce", 3],
        ["forward", "reduce_scatter", 5],
    ], comm["eager_counts"]
    # `output`, which the group's hooks reach first through the FSDP2 state, is named by its path
    assert {c["module"] for c in runs if c["module"].split(".")[0] in ("norm", "output")} == {"norm", "output"}
    # No break, nothing eager: the one difference is FSDP2's backward gathers (eager prefetches each in the unit
    # after it and re-gathers the embedding, whose compiled backward needs no weight).  The reduce-scatters agree:
    # cut at its blocks, the last block's output is saved for the final norm as eager saves it (compiled whole,
    # the partitioner recomputed it from the checkpointed block, one reduce-scatter more than eager).
    diffs = {(d["phase"], d["kind"]): d for d in comm["count_differences"]}
    assert {k: (d["compiled"], d["eager"], d["unexplained"]) for k, d in diffs.items()} == {
        ("backward", "all_gather"): (11, 12, ""),
    }, comm["count_differences"]
    assert diffs["backward", "all_gather"]["reasons"] == [
        "output: compiled 0, eager 1: FSDP2's all_gathers differ (compiled 0, eager 1), DTensor's agree",
        "FSDP2's backward all_gathers in all: compiled 2 (layers.0 1, layers.1 1), eager 3 (layers.0 1, layers.1 1, "
        "output 1): eager FSDP2 all-gathers a unit's parameters for its backward ahead, in the backward hook of the "
        "unit after it in forward order (prefetch), where CommDebugMode counts it, and re-gathers every unit it "
        "resharded after forward; the compiled backward gathers a unit's parameters where its backward uses them, "
        "and not those of norm, tok_embeddings (kept from the forward, reshard_after_forward=False, or unused by "
        "the backward, as an embedding's weight)",
    ], diffs["backward", "all_gather"]["reasons"]
