"""House style, checked: ruff (lint and format) over the package, tests, benchmarks and examples."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import env_tool

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["dynamo_ext", "tests", "benchmarks", "examples"]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args):
    ruff = env_tool("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    proc = subprocess.run([ruff, *args, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
