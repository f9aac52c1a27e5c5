"""``dynamo-ext audit --compare-stock`` of examples/hf_llama_audit.py: transformers' LlamaForCausalLM (tiny random
config), TP plan + FSDP2, one compiled forward and loss on 4 gloo ranks, report checked.

The example checks its compiled step against an eager copy itself (loss, gradients' placements and local shards)
and raises on a difference, so "plugin ranks ok" is also "equal to eager".  Until the block split carried
transformers' ``torch.no_grad()`` / autocast-off rotary embedding across its cuts (NOTE [grad mode and autocast
across cuts]), every plugin rank raised ``BackendCompilerFailed`` from ``split_module`` and the audit exited 2.

What the audit finds with transformers 5.23 on torch 2.13 and 2.15 (asserted exactly, so a change either way
shows up):

- plugin: no break, one graph (the forward and the loss, FSDP2's all-gathers and TP's all-reduces traced), no
  recompile;
- stock: FSDP2's hooks skip the decoder-layer loop's frame (5 per rank), transformers' output capturing skips its
  dict comprehension (1), and one recompile (the gb_types and the recompile's guard are each release's own
  words: 2.13 "Attempted to call function marked as skipped" and ``layer_idx``, 2.15 "Call to
  `torch._dynamo.disable()`" and a module hook's guard).
"""

from __future__ import annotations

import inspect
import json
import tempfile
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", minversion="5", reason='the HF Llama audit target needs transformers>=5 (pip install -e ".[test]")'
)

from test_audit_e2e import REPO, cli  # noqa: E402

pytestmark = pytest.mark.gloo

EXAMPLE = REPO / "examples" / "hf_llama_audit.py"


def _line(module_name: str, text: str) -> tuple[str, int]:
    """(file relative to site-packages, 1-based line) of the first line of ``module_name`` containing ``text``."""
    import importlib

    module = importlib.import_module(module_name)
    lines = inspect.getsource(module).splitlines()
    return module_name.replace(".", "/") + ".py", next(n for n, line in enumerate(lines, 1) if text in line)


@pytest.fixture(scope="module")
def report():
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf_llama.json"
        proc = cli("--nproc", "4", "--compare-stock", "--json", str(out), "--quiet", str(EXAMPLE), timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(out.read_text())


def test_plugin_ranks_run_the_step_as_one_graph(report):
    assert report["errors"] == []
    for r in report["ranks"]:
        assert r["status"] == "ok" and not r["error"], r
        assert (r["graph_breaks"], r["frame_skips"], r["graphs"], r["recompiles"]) == (0, 0, 1, 0), r
    assert report["totals"] == {
        "graph_breaks": 0,
        "recompiles": 0,
        "graphs": 1,
        "hang_risks": [],
        "numerics_mismatches": None,  # the example compares against eager itself
        "comm_bytes_per_step": 468736,
    }, report["totals"]
    assert report["graph_breaks"] == [] and report["recompiles"] == []
    (graph,) = report["graphs"]
    assert (graph["phase"], graph["ranks"], graph["divergent"], graph["hang_risk"]) == (
        "forward",
        [0, 1, 2, 3],
        False,
        False,
    )
    # FSDP2's all-gathers over "dp", one per param group (the root's, each layer's: NOTE [FSDP2 gathers per
    # group]) and the rowwise o_proj / down_proj all-reduces over "tp" (2 layers); the backward AOTAutograd
    # derived: the layers re-gathered, FSDP2's reduce-scatters (per parameter) and TP's input-gradient all-reduces
    assert graph["collectives"] == [["all_gather_into_tensor", 3], ["all_reduce", 4]], graph["collectives"]
    assert graph["backward_collectives"] == [
        ["all_gather_into_tensor", 2],
        ["all_reduce", 10],
        ["reduce_scatter_tensor", 21],
    ], graph["backward_collectives"]


def test_stock_column_breaks_at_every_decoder_layer(report):
    stock = report["stock"]
    assert all(r["status"] == "ok" for r in stock["ranks"]), stock["ranks"]
    layer_loop = _line("transformers.models.llama.modeling_llama", "hidden_states = decoder_layer(")
    capture = _line("transformers.utils.output_capturing", "recordable_keys = {")
    got = {(b["kind"], b["file"], b["line"]): dict(b["count_by_rank"]) for b in stock["graph_breaks"]}
    assert got == {
        ("frame_skip", *layer_loop): {r: 5 for r in range(4)},
        ("frame_skip", *capture): {r: 1 for r in range(4)},
    }, got
    assert all(b["gb_type"] for b in stock["graph_breaks"])
    (recompile,) = stock["recompiles"]
    assert recompile["reason"] and recompile["ranks"] == [0, 1, 2, 3], recompile
    assert (stock["totals"]["graph_breaks"], stock["totals"]["graphs"], stock["totals"]["recompiles"]) == (6, 5, 1)
