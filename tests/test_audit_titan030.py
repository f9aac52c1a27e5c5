"""``dynamo-ext audit --nproc 4 --compare-stock --check-numerics`` of torchtitan 0.3.0's own training step, on its
defaults (``tests/audit_targets/titan030_step.py:make_step``: the whole model compiled, ``spmd_types``, aot_eager).

The audit builds torchtitan's trainer once per rank (a second build fails in ``fully_shard``), trains it three
steps compiled, then runs each step eagerly from the state its compiled step started from and compares the
loss, every gradient (placements, local shard) and every parameter after AdamW and the LR scheduler's step.
Checked: every rank of both runs finishes, the report counts each step, every recompile says why, modules are
named by their fully qualified names, every difference between the compiled and the eager collective counts
has a reason, and the numerics check finds nothing beyond the target's RMSNorm tolerances.

Needs torch 2.15 with torchtitan 0.3.0 and spmd_types 0.2.3 (skipped without them).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("spmd_types")
pytest.importorskip("torchtitan")

from test_audit_e2e import cli  # noqa: E402

pytestmark = pytest.mark.gloo

TARGET = "tests/audit_targets/titan030_step.py:make_step"


@pytest.fixture(scope="module")
def titan_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("titan030") / "out.json"
    proc = cli("--nproc", "4", "--compare-stock", "--check-numerics", "--timeout", "900", "--json", str(out), TARGET,
               timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_rank_of_both_runs_finishes_and_each_step_is_counted(titan_report):
    report, text = titan_report
    for run in (report, report["stock"]):
        assert [r["status"] for r in run["ranks"]] == ["ok"] * 4 and run["errors"] == [], run["ranks"]
        assert [s["step"] for s in run["steps"]] == [1, 2, 3], run["steps"]
        for r in run["ranks"]:
            for key in ("graph_breaks", "frame_skips", "graphs", "recompiles"):
                assert sum(s[key] for s in r["steps"]) == r[key], (key, r)
    assert "Per training step (worst rank)" in text
    # stock: FSDP2's _dynamo.disable breaks the model at its hooks in the first step; nothing compiles after it
    assert report["stock"]["steps"][0]["graph_breaks"] + report["stock"]["steps"][0]["frame_skips"] > 0
    assert all(s["graphs"] == s["recompiles"] == 0 for s in report["steps"][1:]), report["steps"]
    # the plugin: the whole model as one graph in the first step (README's audit table)
    first = report["steps"][0]
    assert (first["graph_breaks"] + first["frame_skips"], first["graphs"], first["recompiles"]) == (0, 1, 0), first


def test_every_recompile_says_why(titan_report):
    report, _ = titan_report
    recompiles = report["recompiles"] + report["stock"]["recompiles"]
    assert recompiles, "stock recompiles torchtitan's per-module forward wrapper"
    for r in recompiles:
        assert r["reason"] and r["why"] and r["steps"], r
    wrapper = [r for r in report["stock"]["recompiles"] if r["function"] == "forward_with_redistribution"]
    assert wrapper and "fn is another function here than the one this graph was compiled for" in wrapper[0]["why"]


def test_numerics_three_steps_from_one_build_within_the_targets_tolerances(titan_report):
    report, text = titan_report
    num = report["numerics"]
    # per step: the loss, 17 gradients and 17 parameters (2 layers of torchtitan's debug model)
    assert (num["steps"], num["compared"], num["ranks"], num["mismatches"]) == (3, 3 * 35, [0, 1, 2, 3], [])
    assert num["tolerances"] == ["grad:*norm.weight: rtol 0, atol 0.0001", "param:*norm.weight: rtol 0, atol 0.001"]
    assert report["totals"]["numerics_mismatches"] == 0
    assert "Numerics (3 compiled training steps vs eager, same state; the target's tolerances:" in text


def test_modules_named_by_their_fully_qualified_names_and_count_differences_explained(titan_report):
    report, text = titan_report
    comm = report["comm"]
    modules = {c["module"] for c in comm["collectives"]}
    assert "layers.0.attention.wo" in modules and not any("__closure__" in m or "L[" in m for m in modules), modules
    assert comm["eager_counts"] is not None
    for d in comm["count_differences"]:
        assert d["reasons"] and d["unexplained"] == "", d
    assert "MISMATCH" not in text
