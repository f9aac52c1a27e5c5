"""The README's main command, run once per session in a brand-new virtual environment of a fresh copy.

Read by ``tests/test_readme_main_command.py`` (the command's exit status and both columns of its JSON) and
``tests/test_audit_example.py`` (the plugin column: the bundled example's graphs, numerics and
communication report), through the session fixture ``readme_main_command_run`` of ``conftest.py``.

NOTE [fresh copy, not git clone]
The copy is the files ``git ls-files`` lists (tracked, plus untracked ones git does not ignore), read
from the working tree: the tree under test, uncommitted edits included, with nothing a clone would not
have (no ``.venv``, build outputs, caches).  A ``git clone`` would test the last commit instead, so a
developer running this test would not test what they changed; on CI (``.ci/run`` runs on a fresh clone)
both are the same tree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


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


def readme_torch_release(command: str) -> str:
    """The torch release the README's main command pins (``torch==X.Y.Z``).

    Raises:
        ValueError: the command pins no torch release.
    """
    pinned = re.search(r"\btorch==([0-9][0-9.]*)", command)
    if pinned is None:
        raise ValueError(f"README.md's main command pins no torch release (torch==X.Y.Z): {command!r}")
    return pinned.group(1)


def runs_here(torch_version: str) -> bool:
    """Whether this session runs the README's main command: only where its torch is the release the command pins.

    NOTE [the main command in its release's session]: the command installs its own torch in a new virtual
    environment whatever the session's torch is; it runs in the session of that release (CI's stage on the
    newest release, ``.ci/run``) so that its plugin column, reused by ``test_audit_example.py``, is a run of
    the session's release, and once per CI run.
    """
    command = readme_main_command((REPO / "README.md").read_text(encoding="utf-8"))
    return torch_version.split("+")[0] == readme_torch_release(command)


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
    """This process's environment as a new shell would have it: the new venv first on PATH, nothing of ours.

    pip reads no configuration file (``PIP_CONFIG_FILE`` set to ``os.devnull``): this repository's machines
    carry a pip config whose constraint caps torch below the release the command installs, which a user's
    machine does not have.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_CONFIG_FILE"] = os.devnull
    outer = os.environ.get("VIRTUAL_ENV") or (sys.prefix if sys.prefix != sys.base_prefix else "")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not (outer and p.startswith(outer))]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["VIRTUAL_ENV"] = str(venv)
    return env


@dataclasses.dataclass(frozen=True)
class ReadmeRun:
    """One run of the README's main command: its process, where it ran, and its JSON (None if not written)."""

    command: str
    proc: subprocess.CompletedProcess[str]
    tree: str  # the copy of the repository the command ran in (removed after the run)
    installed: str  # ``dynamo_ext.__file__`` in the new venv after the run
    torch_version: str  # ``torch.__version__`` in the new venv after the run
    report: dict[str, Any] | None
    wall_s: float


def run_readme_main_command() -> ReadmeRun:
    """Copy the repository, create a venv with ``python -m venv`` and run the README's main command there.

    Raises ``subprocess.CalledProcessError`` when the venv cannot be created or git cannot list the files,
    and ``subprocess.TimeoutExpired`` after 25 minutes.
    """
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
        installed, _, torch_version = (
            subprocess.run(
                [
                    str(venv / "bin" / "python"),
                    "-c",
                    "import dynamo_ext, torch; print(dynamo_ext.__file__); print(torch.__version__)",
                ],
                cwd=tmp,
                env=_new_user_env(venv),
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .partition("\n")
        )
        out = tree / "out.json"
        report = json.loads(out.read_text()) if out.exists() else None
    return ReadmeRun(
        command=command,
        proc=proc,
        tree=str(tree),
        installed=installed,
        torch_version=torch_version,
        report=report,
        wall_s=wall,
    )
