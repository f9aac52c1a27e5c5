"""The README's main command, exactly as written there, in a brand-new virtual environment of a fresh copy.

The command is read from README.md ("Set up": the line starting ``pip install`` that runs ``dynamo-ext
audit``) and run with bash in a copy of the repository made in a temporary directory outside it, inside a
virtual environment created there with ``python -m venv`` (nothing installed beforehand, no
``PYTHONPATH``), so it installs torch and this package the way a new user's first run does
(``readme_run.py``, NOTE [fresh copy, not git clone]; the session fixture ``readme_main_command_run``, whose
plugin column ``test_audit_example.py`` reads too).

What it checks: exit status 0, both columns in the JSON, the stock run's failure named as a finding
(stock compiled autograd leaves FSDP2's root gradients unreduced plain tensors), the plugin run with no
error and 0 numerics mismatches.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from readme_run import REPO, readme_main_command, readme_torch_release, runs_here

pytestmark = [pytest.mark.gloo, pytest.mark.fresh_venv]


def test_readme_main_command_is_found():
    cmd = readme_main_command((REPO / "README.md").read_text(encoding="utf-8"))
    assert cmd.startswith("pip install ") and "dynamo-ext audit" in cmd and "--json out.json" in cmd, cmd
    with pytest.raises(ValueError, match="expected one line starting 'pip install'"):
        readme_main_command("pip install foo\n")
    assert readme_torch_release("pip install torch==2.15.0 -e . && dynamo-ext audit") == "2.15.0"
    with pytest.raises(ValueError, match="pins no torch release"):
        readme_torch_release("pip install torch -e . && dynamo-ext audit")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the repository's files")
@pytest.mark.skipif(
    not runs_here(torch.__version__),
    reason="the README's main command runs in the session of the torch release it pins (CI's stage on that release; "
    "NOTE [the main command in its release's session] in readme_run.py)",
)
def test_readme_main_command_in_a_new_venv(readme_main_command_run):
    run = readme_main_command_run
    proc = run.proc
    tail = f"\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    print(f"README main command: exit {proc.returncode}, {run.wall_s:.0f} s wall")
    assert proc.returncode == 0, tail
    assert run.installed.startswith(run.tree), run.installed  # the copy, installed editable, is what ran
    # the release the command pins is what ran (pip did not pick another one)
    assert run.torch_version.split("+")[0] == readme_torch_release(run.command), (run.torch_version, run.command)
    report = run.report
    assert report is not None, tail

    # the plugin column: every rank finished, one forward and one backward graph, the numerics check equal
    assert report["plugin"]["installed"] is True and report["errors"] == [], report["errors"]
    assert [r["status"] for r in report["ranks"]] == ["ok"] * 4, report["ranks"]
    assert report["totals"]["graph_breaks"] == 0 and report["totals"]["graphs"] == 2, report["totals"]
    assert report["totals"]["numerics_mismatches"] == 0 and report["numerics"]["ranks"] == [0, 1, 2, 3]
    # the stock column: present, and its failure named (a finding, not an error of the audit)
    stock = report["stock"]
    assert stock is not None and stock["plugin"]["installed"] is False
    assert stock["totals"]["graph_breaks"] > 0, stock["totals"]
    # every rank raises after its own check; torchrun may stop a slower one first (status "stopped")
    statuses = [r["status"] for r in stock["ranks"]]
    assert "error" in statuses and set(statuses) <= {"error", "stopped"}, stock["ranks"]
    assert stock["errors"], stock
    for e in stock["errors"]:
        assert "the compiled step differs from eager: gradients not reduced" in e, e
        assert "plain tensors, not sharded DTensors" in e, e
    assert "AttributeError" not in json.dumps(stock["errors"])
    assert "dynamo-ext audit: stock run (a finding, not an error): rank" in proc.stderr, proc.stderr
    assert "dynamo-ext audit: error" not in proc.stderr, proc.stderr
