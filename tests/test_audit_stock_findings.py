"""A failed stock run of ``--compare-stock`` is a finding of the stock column, not an error of the audit.

Tier 1: the CLI's exit status with the launcher replaced by canned reports, the grouped failure lines, and
the bundled example's eager check on a gradient that stayed a plain tensor (what stock compiled autograd
leaves for FSDP2's root parameters).  The real 4-rank run is ``tests/test_readme_main_command.py``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dynamo_ext.audit import cli
from dynamo_ext.audit.model.records import AuditReport, Numerics, NumericsMismatch, RankSummary

DIFFERS = "RuntimeError: rank {r}: the compiled step differs from eager: gradients not reduced: 3 of 21 are plain"


def _rank(r: int, error: str = "") -> RankSummary:
    return RankSummary(
        rank=r, status="error" if error else "ok", error=error, graph_breaks=0, frame_skips=0, graphs=1,
        recompiles=0, compile_time_s=0.0, dynamo_graph_breaks=0, dynamo_unique_graphs=1, log="",
    )  # fmt: skip


def _report(*, installed: bool, raised: dict[int, str] | None = None, numerics: Numerics | None = None) -> AuditReport:
    raised = raised or {}
    return AuditReport(
        target=cli.DEFAULT_TARGET, world_size=4, backend="", torch_version=torch.__version__,
        plugin={"installed": installed, "version": "", "error": ""}, graph_breaks=(), graphs=(), recompiles=(),
        ranks=tuple(_rank(r, raised.get(r, "")) for r in range(4)),
        errors=tuple(f"rank {r} raised {e}" for r, e in sorted(raised.items())), numerics=numerics,
    )  # fmt: skip


STOCK_FAILED = _report(installed=False, raised={r: DIFFERS.format(r=r) for r in range(4)})
PLUGIN_OK = _report(installed=True, numerics=Numerics(compared=44, ranks=(0, 1, 2, 3), mismatches=()))


def _audit(monkeypatch, tmp_path, stock: AuditReport, plugin: AuditReport, *flags: str):
    """``dynamo-ext audit FLAGS --json F`` with the two runs' reports canned; (exit status, JSON)."""
    from dynamo_ext.audit import launch

    def run_ranks(target, target_args, *, plugin, **kwargs):
        return canned[plugin]

    canned = {False: stock, True: plugin}
    monkeypatch.setattr(launch, "run_ranks", run_ranks)
    out = tmp_path / "out.json"
    code = cli.main(["audit", *flags, "--quiet", "--json", str(out)])
    return code, json.loads(out.read_text())


def test_failures_group_ranks_that_raised_the_same():
    lines = STOCK_FAILED.failures
    assert lines == (
        "ranks 0\u20133 raised RuntimeError: the compiled step differs from eager: gradients not reduced: 3 of 21 "
        "are plain",
    ), lines
    mixed = _report(installed=False, raised={0: "ValueError: x", 2: "ValueError: x", 3: "KeyError: 'y'"})
    assert mixed.failures == ("ranks 0, 2 raised ValueError: x", "rank 3 raised KeyError: 'y'")
    timeout = dataclasses.replace(PLUGIN_OK, errors=("timeout: after 5 s: rank 1 hung at t.py:3",))
    assert timeout.failures == ("timeout: after 5 s: rank 1 hung at t.py:3",)
    assert PLUGIN_OK.failures == ()


def test_compare_stock_exits_0_when_only_the_stock_run_failed(monkeypatch, tmp_path, capsys):
    code, data = _audit(monkeypatch, tmp_path, STOCK_FAILED, PLUGIN_OK, "--compare-stock")
    err = capsys.readouterr().err
    assert code == cli.EXIT_OK, err
    assert "error" not in err.replace("not an error", ""), err
    assert "dynamo-ext audit: stock run (a finding, not an error): ranks 0\u20133 raised RuntimeError: " in err, err
    assert "gradients not reduced" in err
    assert data["errors"] == [] and data["totals"]["numerics_mismatches"] == 0
    assert [r["status"] for r in data["stock"]["ranks"]] == ["error"] * 4
    assert all("gradients not reduced" in e for e in data["stock"]["errors"]), data["stock"]["errors"]
    text = str(dataclasses.replace(PLUGIN_OK, stock=STOCK_FAILED))
    assert "a finding of the stock column, not an error of the audit" in text, text
    assert "  stock: ranks 0\u20133 raised RuntimeError: the compiled step differs from eager" in text, text
    assert "error:" not in text, text
    from dynamo_ext.audit.render.html import render_html

    html = render_html(dataclasses.replace(PLUGIN_OK, stock=STOCK_FAILED))
    assert "<li>stock: ranks 0\u20133 raised RuntimeError: the compiled step differs from eager" in html


def test_compare_stock_exit_status_is_the_plugin_runs(monkeypatch, tmp_path, capsys):
    mismatch = NumericsMismatch(rank=0, index=3, kind="grad", name="w", detail="", max_abs=1.0, max_rel=1.0)
    plugin_differs = dataclasses.replace(PLUGIN_OK, numerics=Numerics(compared=44, ranks=(0,), mismatches=(mismatch,)))
    code, data = _audit(monkeypatch, tmp_path, STOCK_FAILED, plugin_differs, "--compare-stock")
    assert code == cli.EXIT_GATE
    assert "dynamo-ext audit: gate: numerics: 1 tensor(s) differ" in capsys.readouterr().err
    assert data["totals"]["numerics_mismatches"] == 1

    plugin_raised = _report(installed=True, raised={1: "RuntimeError: boom (at t.py:3)"})
    code, data = _audit(monkeypatch, tmp_path, STOCK_FAILED, plugin_raised, "--compare-stock")
    err = capsys.readouterr().err
    assert code == cli.EXIT_ERROR
    assert "dynamo-ext audit: error: rank 1 raised RuntimeError: boom (at t.py:3)" in err, err
    assert data["errors"] == ["rank 1 raised RuntimeError: boom (at t.py:3)"]


def test_no_plugin_run_that_raised_is_an_error(monkeypatch, tmp_path, capsys):
    """Without --compare-stock the stock run is the audited run: a rank that raised is exit 2, as documented."""
    code, data = _audit(monkeypatch, tmp_path, STOCK_FAILED, PLUGIN_OK, "--no-plugin")
    assert code == cli.EXIT_ERROR
    assert "dynamo-ext audit: error: rank 0 raised RuntimeError: rank 0: the compiled step differs" in (
        capsys.readouterr().err
    )
    assert data["stock"] is None and len(data["errors"]) == 4


def test_check_against_eager_names_plain_gradients_where_eager_has_dtensors(world):
    """Stock compiled autograd leaves FSDP2's root gradients unsharded plain tensors: named, not an AttributeError."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dynamo_ext.audit.targets.example_llama import check_against_eager

    mesh = init_device_mesh("cpu", (4,))
    model, reference = torch.nn.Linear(3, 8, bias=False), torch.nn.Linear(3, 8, bias=False)
    reference.weight = torch.nn.Parameter(distribute_tensor(reference.weight.detach(), mesh, [Shard(0)]))
    model.weight.grad = torch.ones(8, 3)  # the unsharded gradient nothing reduce-scattered
    reference.weight.grad = distribute_tensor(torch.ones(8, 3), mesh, [Shard(0)])
    loss = torch.tensor(1.0)
    with pytest.raises(RuntimeError) as info:
        check_against_eager(model, reference, loss, loss.clone())
    assert str(info.value) == (
        "rank 0: the compiled step differs from eager: gradients not reduced: 1 of 1 are plain tensors, not sharded "
        "DTensors as eager's (FSDP2's post-backward reduce-scatter did not produce them); weight.grad: compiled "
        "Tensor [8, 3], eager DTensor(S(0)) local [2, 3]"
    )

    # both DTensors, placements differ; then equal placements, values differ
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(1)]))
    model.weight.grad = distribute_tensor(torch.ones(8, 3), mesh, [Shard(1)])
    with pytest.raises(RuntimeError, match=r"weight\.grad: compiled DTensor\(S\(1\)\) local \[8, 1\], eager DTensor"):
        check_against_eager(model, reference, loss, loss.clone())
    model.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)]))
    model.weight.grad = distribute_tensor(torch.full((8, 3), 2.0), mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match=r"weight\.grad: max abs difference 1\.0 from eager \(DTensor\(S\(0\)\)"):
        check_against_eager(model, reference, loss, loss.clone())
