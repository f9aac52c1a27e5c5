"""The shared distributed-tracing corpus (4 gloo ranks), public cases plus ours, with the plugin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT.parent / "shared" / "corpus" / "run.py"


@pytest.mark.corpus
@pytest.mark.gloo
# aot_eager only: it runs Dynamo as the eager backend does, and AOTAutograd and the collective check after it
@pytest.mark.parametrize("backend", ["aot_eager"])
def test_corpus_with_plugin(backend, tmp_path):
    if not RUNNER.exists():
        pytest.skip(f"shared corpus not found at {RUNNER}")
    out = tmp_path / "corpus.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(RUNNER),
            "--plugin",
            "dynamo_ext",
            "--backend",
            backend,
            "--cases-file",
            str(ROOT / "tests" / "corpus_cases.py"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    failed = [r for r in rows if not (r.get("fullgraph") and r.get("match") and "error" not in r)]
    assert not failed, "\n".join(
        f"{r['case']}: {r.get('error') or r.get('fullgraph_error') or 'mismatch'}" for r in failed
    )
    assert len(rows) >= 39 + 14 and proc.returncode == 0
