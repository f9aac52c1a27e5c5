#!/usr/bin/env python3
"""Generate what docs/support.md says about torch releases, from the source and recorded results only.

    python scripts/support_table.py write             # regenerate the tables (and _compat/releases/private_apis.py)
    python scripts/support_table.py write --check     # exit 1, with a diff, if they are not current
    python scripts/support_table.py probe --python ~/.cache/dynamo-ext/venvs/torch-2.15.0/bin/python
    python scripts/support_table.py record-run ...    # what scripts/other_torch.sh calls after a run

``probe`` runs scripts/support_docs/presence.py under each given interpreter and saves which private torch
APIs the plugin uses exist there (docs/support/api_presence/RELEASE.json); ``record-run`` saves one run of
the suite and the corpus (docs/support/runs/RELEASE.json).  ``write`` renders the generated regions of
docs/support.md from the scan of dynamo_ext/ and those files.  Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from support_docs import render, runs, scan  # noqa: E402

SUPPORT_MD = ROOT / "docs" / "support.md"
PRESENCE_DIR = ROOT / "docs" / "support" / "api_presence"
RUNS_DIR = ROOT / "docs" / "support" / "runs"
RELEASES_CHECK = ROOT / "dynamo_ext" / "_compat" / "releases" / "check.py"
PRIVATE_APIS_PY = ROOT / "dynamo_ext" / "_compat" / "releases" / "private_apis.py"
PRESENCE_SCRIPT = ROOT / "scripts" / "support_docs" / "presence.py"


def load_presence(directory: Path = PRESENCE_DIR) -> dict[str, dict[str, Any]]:
    """The presence records by release."""
    out = {}
    for path in sorted(directory.glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        out[record["release"]] = record
    return out


def last_verified_release(path: Path = RELEASES_CHECK) -> str:
    """``LAST_VERIFIED_RELEASE`` as ``dynamo_ext/_compat/releases/check.py`` sets it (read, not imported)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "LAST_VERIFIED_RELEASE" for t in node.targets
        ):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
    raise ValueError(f"{path} does not set LAST_VERIFIED_RELEASE to a string literal")


def generate(root: Path = ROOT) -> dict[Path, str]:
    """Every generated file's new text, by path: docs/support.md (its regions) and private_apis.py."""
    found = scan.scan_package(root)
    presence = load_presence(root / "docs" / "support" / "api_presence")
    recorded = runs.load_runs(root / "docs" / "support" / "runs")
    page = (root / "docs" / "support.md").read_text(encoding="utf-8")
    page = render.splice(page, render.RESULTS, render.results_region(recorded, presence))
    page = render.splice(page, render.PRIVATE_APIS, render.private_api_region(found, presence))
    verified = last_verified_release(root / RELEASES_CHECK.relative_to(ROOT))
    if verified not in presence:
        raise ValueError(
            f"LAST_VERIFIED_RELEASE is {verified} but docs/support/api_presence/ has no record of it: "
            f"run `python scripts/support_table.py probe --python <torch {verified}'s python>`"
        )
    module = render.private_apis_module(found, presence[verified])
    return {root / "docs" / "support.md": page, root / PRIVATE_APIS_PY.relative_to(ROOT): module}


def cmd_write(args: argparse.Namespace) -> int:
    stale = []
    for path, text in generate().items():
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        if old == text:
            continue
        stale.append(path)
        if args.check:
            rel = str(path.relative_to(ROOT))
            sys.stdout.writelines(
                difflib.unified_diff(old.splitlines(True), text.splitlines(True), rel, rel + " (generated)")
            )
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if args.check and stale:
        print("\nnot current: run `python scripts/support_table.py write`", file=sys.stderr)
        return 1
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    found = scan.scan_package(ROOT)
    pairs = [[p, found.modules.get(p, "torch")] for p in found.paths()]
    PRESENCE_DIR.mkdir(parents=True, exist_ok=True)
    status = 0
    for python in args.python:
        proc = subprocess.run(
            [python, str(PRESENCE_SCRIPT)], input=json.dumps(pairs), capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            print(f"{python}: the probe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
            status = 1
            continue
        record = json.loads(proc.stdout)
        out = PRESENCE_DIR / f"{record['release']}.json"
        out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        missing = sum(not e["present"] for e in record["apis"].values())
        print(
            f"torch {record['torch_version']}: {len(pairs) - missing} of {len(pairs)} present -> {out.relative_to(ROOT)}"
        )
    return status


def cmd_record_run(args: argparse.Namespace) -> int:
    corpus: dict[str, tuple[int, Path | None]] = {}
    for spec in args.corpus:
        backend, _, rest = spec.partition("=")
        code, _, path = rest.partition(":")
        corpus[backend] = (int(code), Path(path) if path else None)
    record = runs.make_record(
        torch_version=args.torch_version,
        pytest_args=args.pytest_args,
        pytest_exit=args.pytest_exit,
        junit=Path(args.junit) if args.junit else None,
        corpus=corpus,
        ours=runs.our_case_names(ROOT / "tests" / "corpus_cases.py"),
        repo=ROOT,
    )
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    out = RUNS_DIR / f"{record['release']}.json"
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"recorded {out.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="regenerate the generated regions and private_apis.py")
    w.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff if not current")
    w.set_defaults(fn=cmd_write)
    p = sub.add_parser("probe", help="record which private APIs exist under each interpreter's torch")
    p.add_argument("--python", action="append", required=True, help="an interpreter with torch (repeatable)")
    p.set_defaults(fn=cmd_probe)
    r = sub.add_parser("record-run", help="record a run of the suite and the corpus (scripts/other_torch.sh)")
    r.add_argument("--torch-version", required=True, help="torch.__version__ of the run")
    r.add_argument("--pytest-exit", type=int, required=True)
    r.add_argument("--junit", default="", help="pytest's JUnit XML (-o junit_family=xunit1)")
    r.add_argument("--corpus", action="append", default=[], help="BACKEND=EXIT:JSON (repeatable)")
    r.add_argument("pytest_args", nargs=argparse.REMAINDER, help="the pytest arguments of the run, after --")
    r.set_defaults(fn=cmd_record_run)
    args = parser.parse_args(argv)
    if getattr(args, "pytest_args", None) and args.pytest_args[0] == "--":
        args.pytest_args = args.pytest_args[1:]
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
