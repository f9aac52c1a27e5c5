"""``dynamo-ext audit --check-numerics`` of examples/titan_llama_audit.py: a torchtitan-style Llama 3 training step
(TP + sequence parallel + FSDP2 + full activation checkpointing + loss parallel) on 4 gloo ranks, report checked.

What the audit finds on torch 2.13 (asserted exactly below, so a change in either direction shows up):

- one graph break, 3 times per rank, at ``return self.output(self.norm(h))``: torchtitan shards ``[norm, output]``
  as one FSDP2 module group (``fully_shard([model.norm, model.output])``), whose hooks are per-group closures
  FSDP2 marks ``torch._dynamo.disable``; the plugin traces the hooks of single-module FSDP2 states only, so
  stock Dynamo's "Attempted to call function marked as skipped" break runs them eagerly;
- after it, Dynamo compiles TP's module hooks of ``norm`` and ``output`` as frames of their own: the one
  ``distribute_module`` pre-hook lambda recompiles once (a plain tensor into ``norm``, a DTensor into ``output``),
  and ColwiseParallel's ``_prepare_output_fn`` is a graph;
- five graphs: the model up to the break (all of both blocks, FSDP2's gathers and reduce-scatters traced), the
  two hook-lambda graphs, the output hook, and the loss (three all-reduces over "tp" under loss parallel);
- 0 numerics mismatches in 43 tensors per rank (loss, 21 gradients, 21 parameters after AdamW): the eager
  FSDP2 hooks of the group and the traced ones of every other module give eager's gradients.

The collective counts cover the compiled graphs only, so they are below eager ``CommDebugMode``'s, which also
counts the eagerly run group (its flat all-gather and reduce-scatter) and the backward of the eager parts; the
report gives the reason for each difference per module (``norm``, ``output``: ran eagerly behind the break; the
output hook's all-gather: a graph of no module).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_audit_e2e import REPO, cli, marker_line

EXAMPLE = REPO / "examples" / "titan_llama_audit.py"


def test_module_path_drops_checkpoint_wrapper_and_module_dict_spelling():
    """The communication report names modules by their FQNs (as the state_dict does), not by Dynamo's spelling."""
    from dynamo_ext.audit.comm import module_path

    def node(path):
        return SimpleNamespace(meta={"nn_module_stack": {"k": (path, object)}})

    wrapped = "L['self'].layers.0.__dict__['_modules']['_checkpoint_wrapped_module'].attention.wo"
    assert module_path(node(wrapped)) == "layers.0.attention.wo"
    assert module_path(node("L['self'].__dict__['_modules']['norm']")) == "norm"
    assert module_path(node("L['self'].layers.0.feed_forward")) == "layers.0.feed_forward"
    assert module_path(node("L['self']")) == "<root>"
    assert module_path(SimpleNamespace(meta={})) is None


@pytest.mark.gloo
@pytest.mark.slow
def test_titan_llama_training_step_audit():
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        proc = cli("--nproc", "4", "--check-numerics", "--json", str(out), "--quiet", str(EXAMPLE), timeout=480)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads(out.read_text())
    example = "examples/titan_llama_audit.py"
    assert report["totals"] == {
        "graph_breaks": 3,
        "recompiles": 1,
        "graphs": 5,
        "hang_risks": [],
        "numerics_mismatches": 0,
        "comm_bytes_per_step": 433024,
    }, report["totals"]

    (brk,) = report["graph_breaks"]
    assert (brk["gb_type"], brk["file"], brk["line"], brk["source"]) == (
        "Attempted to call function marked as skipped",
        example,
        marker_line(EXAMPLE, "return self.output(self.norm(h))"),
        "return self.output(self.norm(h))",
    ), brk
    assert brk["distributed"] and brk["phase"] == "forward" and not brk["hang_risk"], brk
    assert brk["count_by_rank"] == [[r, 3] for r in range(4)], brk

    (rec,) = report["recompiles"]
    assert (rec["function"], rec["file"]) == ("<lambda>", "torch/distributed/tensor/_api.py"), rec
    assert "expected type of 'inputs[0]' to be a tensor type" in rec["reason"] and "DTensor" in rec["reason"], rec
    assert rec["count_by_rank"] == [[r, 1] for r in range(4)], rec

    graphs = sorted((g["file"], g["id"].split(" |")[0].split(" ")[-1], g["phase"]) for g in report["graphs"])
    assert graphs == [
        (example, "forward", "forward"),
        (example, "forward_loss", "forward"),
        ("torch/distributed/tensor/_api.py", "<lambda>", "forward"),
        ("torch/distributed/tensor/_api.py", "<lambda>", "forward"),
        ("torch/distributed/tensor/parallel/style.py", "_prepare_output_fn", "forward"),
    ], graphs
    assert all(g["ranks"] == [0, 1, 2, 3] for g in report["graphs"])

    assert report["numerics"] == {"compared": 43, "ranks": [0, 1, 2, 3], "mismatches": []}, report["numerics"]
    _check_comm(report["comm"], example)


def _check_comm(comm, example):
    runs = [c for c in comm["collectives"] if not c["inlined"]]
    assert len(runs) == len(comm["collectives"]) == 88, len(comm["collectives"])
    by = Counter(
        (c["graph"].split(" |")[0].split(" ")[-1], c["graph_kind"], c["kind"], c["mesh_axis"], c["origin"])
        for c in runs
    )
    assert by == {
        # the model's graph: FSDP2's per-parameter all-gathers over "dp" (embedding + 9 per block) ...
        ("forward", "forward", "all_gather", "dp", "fsdp"): 19,
        # ... PrepareModuleInput's Shard(1) -> Replicate gathers before attention and feed-forward ...
        ("forward", "forward", "all_gather", "tp", "dtensor"): 4,
        # ... and the rowwise embedding, wo and w2 reduce-scattering to Shard(1) (sequence parallel)
        ("forward", "forward", "reduce_scatter", "tp", "dtensor"): 5,
        # its backward: the blocks re-gathered (reshard_after_forward; the embedding's backward needs no weight),
        ("forward", "backward", "all_gather", "dp", "fsdp"): 18,
        ("forward", "backward", "all_gather", "tp", "dtensor"): 9,
        ("forward", "backward", "reduce_scatter", "tp", "dtensor"): 6,
        # FSDP2's per-parameter gradient reduce-scatters, and the Replicate-on-"tp" norm weights' all-reduces
        ("forward", "backward", "reduce_scatter", "dp", "fsdp"): 19,
        ("forward", "backward", "all_reduce", "tp", "fsdp"): 4,
        # output's input (Shard(1) -> Replicate), in TP's hook compiled after the break
        ("<lambda>", "forward", "all_gather", "tp", "dtensor"): 1,
        # loss parallel: the max, the sum of exponentials and the target logits over the vocabulary shards
        ("forward_loss", "forward", "all_reduce", "tp", "dtensor"): 3,
    }, by
    for c in runs:
        assert c["line"] > 0 and c["file"] and c["sent"] > 0 and c["bytes_in"] > 0, c
        assert c["ranks"] == [0, 1, 2, 3] and c["group_size"] == 2, c
        assert "__dict__" not in c["module"] and "_checkpoint_wrapped_module" not in c["module"], c
    block_modules = {c["module"] for c in runs if c["origin"] == "dtensor" and c["module"].startswith("layers.")}
    assert block_modules == {
        f"layers.{i}.{m}" for i in (0, 1) for m in ("attention", "attention.wo", "feed_forward", "feed_forward.w2")
    }, block_modules
    assert comm["bytes_by_rank"] == [[r, 433024] for r in range(4)] and comm["missing"] == [], comm["bytes_by_rank"]
    # Compiled graphs only (the group's FSDP2 hooks and the backward of the eager hook frames run eagerly).
    assert comm["counts"] == [
        ["backward", "all_gather", 11],
        ["backward", "all_reduce", 4],  # the 2 norm weights per block, per parameter as eager FSDP2
        ["backward", "reduce_scatter", 9],
        ["forward", "all_gather", 8],
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
    # every difference has a reason: the [norm, output] group ran eagerly behind the break; output's input hook
    # is a graph of its own (no module), where eager counts it in output
    brk = f"graph breaks at {example}:{marker_line(EXAMPLE, 'return self.output(self.norm(h))')}"
    eager = f"no compiled graph has a collective of it: ran eagerly ({brk})"
    diffs = {(d["phase"], d["kind"]): d for d in comm["count_differences"]}
    assert {k: (d["compiled"], d["eager"], d["reasons"], d["unexplained"]) for k, d in diffs.items()} == {
        ("backward", "all_gather"): (11, 12, [f"output: compiled 0, eager 1: {eager}"], ""),
        ("backward", "all_reduce"): (4, 5, [f"norm: compiled 0, eager 1: {eager}"], ""),
        ("backward", "reduce_scatter"): (
            9, 11, [f"norm: compiled 0, eager 1: {eager}", f"output: compiled 0, eager 1: {eager}"], ""
        ),
        ("forward", "all_gather"): (
            8, 9,
            [f"norm: compiled 0, eager 1: {eager}, or in a graph of no module (outside any module)",
             f"output: compiled 0, eager 1: {eager}, or in a graph of no module (outside any module)",
             "outside any module: compiled 1, eager 0: compiled in a graph of no module "
             "(torch/distributed/tensor/_api.py:1188 <lambda>: a hook or function compiled as a frame of its own); "
             "eager counts it in the module whose hook ran it"],
            "",
        ),
    }, comm["count_differences"]  # fmt: skip
