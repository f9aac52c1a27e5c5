"""The README's main command, exactly as written there, in a brand-new virtual environment of a fresh copy.

The command is read from README.md ("Set up": the line starting ``pip install`` that runs ``dynamo-ext
audit``) and run with bash in a copy of the repository made in a temporary directory outside it, inside a
virtual environment created there with ``python -m venv`` (nothing installed beforehand, no
``PYTHONPATH``), so it installs torch and this package the way a new user's first run does.

NOTE [fresh copy, not git clone]
The copy is the files ``git ls-files`` lists (tracked, plus untracked ones git does not ignore), read
from the working tree: the tree under test, uncommitted edits included, with nothing a clone would not
have (no ``.venv``, build outputs, caches).  A ``git clone`` would test the last commit instead, so a
developer running this test would not test what they changed; on CI (``.ci/run`` runs on a fresh clone)
both are the same tree.

What it checks: exit status 0, both columns in the JSON, the stock run's failure named as a finding
(stock compiled autograd leaves FSDP2's root gradients unreduced plain tensors), the plugin run with no
error and 0 numerics mismatches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.gloo, pytest.mark.slow, pytest.mark.fresh_venv]


def readme_main_command(readme: str) -> str:
    """The README's main command: the one line that starts with ``pip install`` and runs ``dynamo-ext audit``.

    Raises:
        ValueError: no such line, or more than one.
    """
    lines = [ln.strip() for ln in readme.splitlines() if ln.strip().startswith("pip install")]
    found = [ln for ln in lines if "dynamo-ext audit" in ln]
    if len(found) != 1:
        raise ValueError(f"README.md: expected one line starting 'pip install' with 'dynamo-ext audit', got {found}")
    return found[0]


def test_readme_main_command_is_found():
    cmd = readme_main_command((REPO / "README.md").read_text(encoding="utf-8"))
    assert cmd.startswith("pip install ") and "dynamo-ext audit" in cmd and "--json out.json" in cmd, cmd
    with pytest.raises(ValueError, match="expected one line starting 'pip install'"):
        readme_main_command("pip install foo\n")


def _copy_tree(dest: Path) -> None:
    """The files ``git ls-files`` lists, from the working tree (NOTE [fresh copy, not git clone])."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = REPO / rel
        if not src.is_file():  # deleted in the working tree, not yet committed
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def _new_user_env(venv: Path) -> dict[str, str]:
    """This process's environment as a new shell would have it: the new venv first on PATH, nothing of ours."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    outer = os.environ.get("VIRTUAL_ENV") or (sys.prefix if sys.prefix != sys.base_prefix else "")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not (outer and p.startswith(outer))]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["VIRTUAL_ENV"] = str(venv)
    return env


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the repository's files")
def test_readme_main_command_in_a_new_venv():
    command = readme_main_command((REPO / "README.md").read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory(prefix="dynamo-ext-readme-") as tmp:
        tree, venv = Path(tmp) / "dynamo-ext", Path(tmp) / "venv"
        _copy_tree(tree)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        start = time.monotonic()
        proc = subprocess.run(
            ["bash", "-c", command], cwd=tree, env=_new_user_env(venv), capture_output=True, text=True, timeout=1500
        )
        wall = time.monotonic() - start
        tail = f"\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
        print(f"README main command: exit {proc.returncode}, {wall:.0f} s wall")
        assert proc.returncode == 0, tail
        installed = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import dynamo_ext; print(dynamo_ext.__file__)"],
            cwd=tmp,
            env=_new_user_env(venv),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert installed.startswith(str(tree)), installed  # the copy, installed editable, is what ran
        report = json.loads((tree / "out.json").read_text())

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
