"""The main job: ``dynamo-ext audit`` of the bundled Llama TP + FSDP2 training step, with the plugin.

The example checks its compiled step against an eager run of the same step
(:func:`dynamo_ext.audit.targets.example_llama.check_against_eager`), so a wrong
gradient fails the run; the audit must find one forward and one backward graph
and no graph break or recompile.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from readme_run import runs_here
from test_audit_e2e import cli

pytestmark = pytest.mark.gloo

README_TEST = "test_readme_main_command.py::test_readme_main_command_in_a_new_venv"


@pytest.fixture(scope="module")
def example_report(request):
    """The JSON report of ``dynamo-ext audit`` of the bundled example with the plugin (4 ranks).

    NOTE [one run of the bundled example]: the README's main command is ``dynamo-ext audit --compare-stock``
    of this example, whose JSON is the plugin run's report with the stock run's beside it.  When the session
    runs that command too (``test_readme_main_command.py``, in a new venv on a copy of this tree), its
    plugin column is this report: the same target, ranks, backend and numerics check, so the example is not
    launched twice.  The command runs only in the session of the torch release it pins (NOTE [the main command in
    its release's session] in ``readme_run.py``).  Otherwise the example runs here, from this tree, with the gates at 0.
    """
    readme_runs = shutil.which("git") and runs_here(torch.__version__)
    if readme_runs and any(item.nodeid.endswith(README_TEST) for item in request.session.items):
        run = request.getfixturevalue("readme_main_command_run")
        assert run.proc.returncode == 0 and run.report is not None, run.proc.stdout[-3000:] + run.proc.stderr[-3000:]
        return run.report
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        proc = cli("--json", str(out), "--max-breaks", "0", "--max-recompiles", "0", timeout=480)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(out.read_text())


def test_bundled_example_trains_as_one_forward_and_one_backward_graph(example_report):
    report = example_report
    assert report["totals"]["graph_breaks"] == 0 and report["totals"]["recompiles"] == 0, report["totals"]
    phases = sorted(g["phase"] for g in report["graphs"])
    assert phases == ["backward", "forward"], report["graphs"]
    backward = next(g for g in report["graphs"] if g["phase"] == "backward")
    assert "reduce_scatter_tensor" in json.dumps(backward), backward  # FSDP2's reduction, traced
    # numerics on by default for the bundled example: the compiled step equals eager on every rank
    num = report["numerics"]
    assert num["ranks"] == [0, 1, 2, 3]
    assert num["mismatches"] == [], num["mismatches"][:3]
    assert num["compared"] > 2 * 20  # loss, logits, every gradient and parameter
    assert report["totals"]["hang_risks"] == []
    assert all("#" not in g["id"] and not g["file"].startswith("/") for g in report["graphs"])
    _check_comm(report)


def _check_comm(report):
    """The communication report of the same launch: every collective of the forward and backward graphs.

    Like with like (NOTE [like-with-like collective counts] in dynamo_ext/audit/comm_merge.py): CommDebugMode
    counts the eager step's DTensor collectives as legacy ``c10d_functional.*`` ops and FSDP2's as c10d ops
    (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``), one flat buffer per FSDP group; the traced
    FSDP2 step gathers and reduce-scatters each parameter, so its FSDP collectives count once per (graph,
    FSDP module, kind).  Both sides map to traffic kinds (all_gather, all_reduce, reduce_scatter).
    """
    comm = report["comm"]
    runs = [c for c in comm["collectives"] if not c["inlined"]]
    by = {(c["graph_kind"], c["kind"], c["origin"]) for c in runs}
    # forward: FSDP2 all-gathers over "dp", RowwiseParallel's all-reduces over "tp"; backward under compiled
    # autograd: FSDP2's re-gathers and reduce-scatters, ColwiseParallel's input-gradient all-reduces.
    assert by == {
        ("forward", "all_gather", "fsdp"),
        ("forward", "all_reduce", "dtensor"),
        ("compiled_autograd", "all_gather", "fsdp"),
        ("compiled_autograd", "reduce_scatter", "fsdp"),
        ("compiled_autograd", "all_reduce", "dtensor"),
    }, by
    for c in runs:
        assert c["mesh_axis"] == ("dp" if c["origin"] == "fsdp" else "tp"), c
        assert c["line"] > 0 and c["file"], c
        assert c["bytes_in"] > 0 and c["sent"] > 0 and c["est_ms"] > 0, c
        if c["origin"] == "dtensor":
            assert c["file"].endswith("example_llama.py") and c["module"].startswith("layers."), c
            assert (c["placements_before"], c["placements_after"]) in {("(P(sum))", "(R)"), ("P(sum)", "R")}, c
            assert c["alternative_basis"] == "heuristic", c
    # 8 KiB all-reduce of fp32 [2, 16, 64] activations over tp=2: a ring sends 2 * (2-1)/2 * 8 KiB per rank
    tp = [c for c in runs if c["kind"] == "all_reduce"]
    assert {(c["bytes_in"], c["sent"]) for c in tp} == {(2 * 16 * 64 * 4, 2 * 16 * 64 * 4)}, tp
    assert comm["bytes_per_step"] == sum(c["sent"] for c in runs) == report["totals"]["comm_bytes_per_step"]
    assert comm["eager_counts"] is not None and comm["counts"] == comm["eager_counts"], comm
    assert comm["counts"] == [
        ["backward", "all_gather", 2],  # the two blocks re-gathered (reshard_after_forward)
        ["backward", "all_reduce", 10],  # wq, wk, wv, w1, w3 input gradients, 2 blocks
        ["backward", "reduce_scatter", 3],  # root + 2 blocks
        ["forward", "all_gather", 3],
        ["forward", "all_reduce", 4],  # wo, w2 outputs, 2 blocks
    ]


def test_check_against_eager_names_the_gradient_that_differs(world):
    from dynamo_ext.audit.targets.example_llama import check_against_eager

    torch.manual_seed(0)
    model, reference = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3)
    loss, ref_loss = model(x).sum(), reference(x).sum()
    loss.backward()
    ref_loss.backward()
    check_against_eager(model, reference, loss, ref_loss)  # equal: no error
    model.weight.grad *= 4  # the 4x FSDP2 gradient bug of an earlier release
    with pytest.raises(RuntimeError, match=r"rank 0: the compiled step differs from eager: weight\.grad"):
        check_against_eager(model, reference, loss, ref_loss)
