"""The main job: ``dynamo-ext audit`` of the bundled Llama TP + FSDP2 training step, with the plugin.

The example checks its compiled step against an eager run of the same step
(:func:`dynamo_ext.audit.example_llama.check_against_eager`), so a wrong
gradient fails the run; the audit must find one forward and one backward graph
and no graph break or recompile.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from test_audit_e2e import cli

pytestmark = [pytest.mark.gloo, pytest.mark.slow]


def test_bundled_example_trains_as_one_forward_and_one_backward_graph():
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        proc = cli("--json", str(out), "--max-breaks", "0", "--max-recompiles", "0", timeout=480)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads(out.read_text())
    assert report["totals"]["graph_breaks"] == 0 and report["totals"]["recompiles"] == 0, report["totals"]
    phases = sorted(g["phase"] for g in report["graphs"])
    assert phases == ["backward", "forward"], report["graphs"]
    backward = next(g for g in report["graphs"] if g["phase"] == "backward")
    assert "reduce_scatter_tensor" in json.dumps(backward), backward  # FSDP2's reduction, traced


def test_check_against_eager_names_the_gradient_that_differs(world):
    from dynamo_ext.audit.example_llama import check_against_eager

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
