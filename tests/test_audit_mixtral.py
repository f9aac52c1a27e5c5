"""``dynamo-ext audit`` of Hugging Face transformers' MixtralForCausalLM, expert parallel + TP + FSDP2, 4 gloo ranks.

The target (examples/hf_mixtral_audit.py) lays the model out with transformers' own plans
(``DistributedConfig(tp_size=2, fsdp_size=2, ep_size=2)``: attention TP over "tp", experts ``Shard(0)`` over
"ep" reached by an all-to-all token dispatch, FSDP2 over "fsdp" / "efsdp") and checks its compiled step
against eager itself; the audit's numerics check does it again.  The report is checked exactly: every graph
break (gb_type, file, line, source line, count), the graphs, the recompiles, the collectives of the compiled
graphs with their mesh axes, and 0 numerics mismatches.  Expected values are for torch 2.13 and transformers
5.23 (lines are looked up in the installed transformers' sources).
"""

from __future__ import annotations

import inspect
import json
import tempfile
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", minversion="5", reason='the Mixtral audit target needs transformers>=5 (pip install -e ".[test]")'
)

from test_audit_e2e import cli  # noqa: E402

pytestmark = pytest.mark.gloo


def _line(module_name: str, text: str) -> tuple[str, int]:
    """(file relative to site-packages, 1-based line) of the first line of ``module_name`` containing ``text``."""
    import importlib

    module = importlib.import_module(module_name)
    lines = inspect.getsource(module).splitlines()
    rel = module_name.replace(".", "/") + ".py"
    return rel, next(n for n, line in enumerate(lines, 1) if text in line)


@pytest.fixture(scope="module")
def report():
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mixtral.json"
        proc = cli("--nproc", "4", "--check-numerics", "--json", str(out), "examples/hf_mixtral_audit.py", timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        data = json.loads(out.read_text())
    data["_stdout"] = proc.stdout
    return data


def test_graph_breaks_each_with_gb_type_line_and_cause(report):
    tolist = _line("transformers.distributed.expert_parallel", "send_sizes, recv_sizes = torch.stack(")
    lm_head = _line("transformers.models.mixtral.modeling_mixtral", "logits = self.lm_head(hidden_states)")
    record = _line("transformers.utils.output_capturing", "recordable_keys = {")
    got = {
        (b["kind"], b["gb_type"], b["file"], b["line"], b["function"], b["distributed"]): b
        for b in report["graph_breaks"]
    }
    # Dynamo's name for the dict comprehension's break: "Missing tp_iternext" to 2.13, "C-implemented special
    # method without VariableTracker model" on 2.15
    (dict_keys,) = [k[1] for k in got if (k[2], k[3]) == record] or ["(no break at the comprehension)"]
    assert dict_keys in ("Missing tp_iternext", "C-implemented special method without VariableTracker model")
    expected = {
        # MoE routing: the all-to-all split sizes read back to the host (inherent: data-dependent sizes).  It sits
        # under transformers' _use_local_dtensor_params context manager, where Dynamo cannot resume, so Dynamo
        # retries and skips each frame above it (the decoder layer, the model): 14 attempts per rank
        ("frame_skip", "Data dependent operator", *tolist, "_dispatch_tokens", False): 14,
        # FSDP2's module group fully_shard([norm, lm_head]) (transformers' FSDP plan for the tail): norm runs in the
        # model's frame, which Dynamo skips (the .tolist() above), so FSDP2's eager hooks start the group's pass;
        # the plugin traces group hooks, but not a pass eager hooks started: a named break, lm_head's run eagerly
        ("graph_break", "dynamo_ext: FSDP2 setting not traced", *lm_head, "forward", True): 1,
        # transformers' output capturing iterates a dict's keys in a comprehension (stock Dynamo limitation)
        ("frame_skip", dict_keys, *record, "<dictcomp>", False): 1,
    }
    assert {k: dict(b["count_by_rank"]) for k, b in got.items()} == {
        k: {r: n for r in range(4)} for k, n in expected.items()
    }
    assert all(b["ranks"] == [0, 1, 2, 3] and not b["hang_risk"] for b in report["graph_breaks"])
    (dd,) = [b for b in report["graph_breaks"] if b["gb_type"] == "Data dependent operator"]
    assert ".tolist()" in dd["source"] and "GenericContextWrappingVariable" in dd["wrapper"], dd
    for r in report["ranks"]:
        assert r["status"] == "ok" and r["graph_breaks"] == r["dynamo_graph_breaks"] == 11, r
        assert (r["frame_skips"], r["graphs"], r["recompiles"]) == (5, 13, 2), r
    assert report["totals"]["hang_risks"] == []


def test_graphs_and_recompiles(report):
    assert all(g["ranks"] == [0, 1, 2, 3] and not g["divergent"] for g in report["graphs"])
    where = sorted((g["file"], g["function"]) for g in report["graphs"])
    mixtral = "transformers/models/mixtral/modeling_mixtral.py"
    assert where == sorted(
        [
            ("transformers/distributed/expert_parallel.py", "__call__"),  # AllToAllEP, resumed after the dispatch
            ("transformers/distributed/expert_parallel.py", "_dispatch_tokens"),  # up to the counts' all_to_all
            ("transformers/distributed/expert_parallel.py", "_dispatch_tokens"),  # resumed after .tolist()
            ("transformers/distributed/tensor_parallel.py", "tp_forward"),  # embedding (vocab-sharded)
            ("transformers/distributed/tensor_parallel.py", "tp_forward"),  # lm_head: recompiled, Float input
            ("transformers/modeling_rope_utils.py", "wrapper"),
            *[(mixtral, "forward")] * 7,  # layer, MoE block, norms, model, causal LM pieces between the breaks
        ]
    ), where
    recompiles = sorted(
        (rc["function"], rc["file"], rc["reason"].split("  #")[0], rc["ranks"]) for rc in report["recompiles"]
    )
    assert recompiles == [
        # an ID_MATCH guard on the code of the forward transformers' checkpointing wrapper calls
        ("forward_with_checkpointing", "transformers/modeling_layers.py",
         "___check_obj_id(forward.__code__, <id>), type=<class 'code'>", [0, 1, 2, 3]),
        # one tp_forward closure code for the embedding (Long ids) and lm_head (Float hidden states)
        ("tp_forward", "transformers/distributed/tensor_parallel.py",
         "tensor 'args[0]' dtype mismatch. expected Long, actual Float", [0, 1, 2, 3]),
    ]  # fmt: skip


def test_communication_report_names_each_collective_and_mesh_axis(report):
    comm = report["comm"]
    runs = [c for c in comm["collectives"] if not c["inlined"]]
    kinds = sorted({(c["graph_kind"], c["kind"], c["mesh_axis"], c["origin"]) for c in runs})
    assert kinds == [
        ("backward", "all_gather", "tp", "dtensor"),  # AllToAllEP's Replicate -> Shard(0) over "tp", backward
        ("backward", "all_reduce", "tp", "dtensor"),  # colwise q/k/v and the embedding's input gradients
        ("backward", "all_to_all", "ep", "explicit"),  # all_to_all_single_autograd's backward
        ("forward", "all_gather", "tp", "dtensor"),  # lm_head colwise_gather_output
        ("forward", "all_gather", "tp", "explicit"),  # the expert outputs' Shard(0) -> Replicate over "tp"
        ("forward", "all_reduce", "tp", "dtensor"),  # rowwise o_proj, vocab-sharded embedding
        ("forward", "all_to_all", "ep", "explicit"),  # token counts, tokens there, expert outputs back
    ], kinds
    for c in runs:
        assert c["file"].startswith("transformers/distributed/") and c["line"] > 0, c
        assert c["bytes_in"] > 0 and c["sent"] > 0, c
    # compiled graphs only: FSDP2's all-gathers and reduce-scatters run in its eager hooks here (the backward is
    # eager), so eager CommDebugMode counts more
    assert comm["counts"] == [
        ["backward", "all_gather", 2],
        ["backward", "all_reduce", 4],
        ["backward", "all_to_all", 2],
        ["forward", "all_gather", 2],
        ["forward", "all_reduce", 2],
        ["forward", "all_to_all", 3],
    ], comm["counts"]
    assert comm["bytes_per_step"] == sum(c["sent"] for c in runs) == report["totals"]["comm_bytes_per_step"]
    numerics = report["numerics"]
    assert numerics["mismatches"] == [] and numerics["ranks"] == [0, 1, 2, 3]
    assert numerics["compared"] == 26  # loss, logits, 12 gradients, 12 parameters
    assert report["totals"]["numerics_mismatches"] == 0
    assert "0 mismatches" in report["_stdout"]
