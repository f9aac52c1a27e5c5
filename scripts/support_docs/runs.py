"""A recorded run of the suite and the corpus on one torch release (``docs/support/runs/<release>.json``).

``scripts/other_torch.sh`` makes one: pytest writes a JUnit XML (``-o junit_family=xunit1``, whose test cases
carry their file), the corpus runner writes its ``--json``, and :func:`make_record` reads both with the release
(``torch.__version__``), the date (UTC) and the commit.  The results table is rendered from these files only.

A run is *full* when pytest got no arguments but reporting ones (:data:`REPORTING_ARGS`): the default suite
(tests marked ``slow`` left out, as CI runs it).  Anything else (a file, ``-k``, ``-m``, ``-x``) is partial,
and the table says so with the arguments.
"""

from __future__ import annotations

import ast
import datetime
import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

OUTCOMES = ("passed", "failed", "error", "skipped")
REPORTING_ARGS = frozenset({"-q", "-qq", "-v", "-vv", "-ra", "-rA", "-rfE", "-s", "--tb=short", "--tb=line", "--tb=no"})
_MESSAGE_CHARS = 200


def is_full(pytest_args: list[str]) -> bool:
    """Whether pytest ran the whole default suite (see the module docstring)."""
    return all(a in REPORTING_ARGS for a in pytest_args)


def _first_line(text: str | None) -> str:
    line = (text or "").strip().splitlines()
    return line[0][:_MESSAGE_CHARS] if line else ""


def read_junit(path: Path) -> dict[str, Any]:
    """Totals, per-file counts and the tests that did not pass (id, outcome, first line of the message)."""
    root = ET.parse(path).getroot()
    totals = dict.fromkeys(OUTCOMES, 0)
    files: dict[str, dict[str, int]] = {}
    not_passed: list[dict[str, str]] = []
    for case in root.iter("testcase"):
        file = case.get("file") or (case.get("classname") or "").replace(".", "/") + ".py"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = _first_line(child.get("message") or child.text)
                break
        totals[outcome] += 1
        counts = files.setdefault(file, dict.fromkeys(OUTCOMES, 0))
        counts[outcome] += 1
        if outcome != "passed":
            classname = case.get("classname") or ""
            cls = classname.rpartition(".")[2] if classname.rpartition(".")[2][:1].isupper() else ""
            test_id = "::".join(p for p in (file, cls, case.get("name") or "") if p)
            not_passed.append({"id": test_id, "outcome": outcome, "message": message})
    return {"totals": totals, "files": dict(sorted(files.items())), "not_passed": not_passed}


def our_case_names(cases_file: Path) -> set[str]:
    """The corpus cases ``cases_file`` registers (functions decorated with ``@case(...)``, named ``case_<name>``)."""
    tree = ast.parse(cases_file.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Call) and getattr(d.func, "id", None) == "case" for d in node.decorator_list
        ):
            names.add(node.name.removeprefix("case_"))
    return names


def read_corpus(path: Path, ours: set[str]) -> list[dict[str, Any]]:
    """Each case of a corpus ``--json`` file: passed (one graph, equal to eager, no error), ours or public, and
    the note the runner prints for it."""
    rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
    out = []
    for r in rows:
        ok = bool(r.get("fullgraph") and r.get("match") and "error" not in r)
        note = r.get("error") or ("" if r.get("fullgraph") else r.get("fullgraph_error") or "")
        if not note and not r.get("match"):
            note = "MISMATCH vs eager"
        out.append({"case": r["case"], "ours": r["case"] in ours, "ok": ok, "note": _first_line(str(note))})
    return out


def git_commit(repo: Path) -> dict[str, Any]:
    """The checked-out commit (short hash) and whether tracked files differ from it."""

    def git(*args: str) -> str:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
        return proc.stdout.strip()

    return {
        "commit": git("rev-parse", "--short=10", "HEAD"),
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def make_record(
    *,
    torch_version: str,
    pytest_args: list[str],
    pytest_exit: int,
    junit: Path | None,
    corpus: dict[str, tuple[int, Path | None]],
    ours: set[str],
    repo: Path,
    date: str | None = None,
) -> dict[str, Any]:
    """The record of one run; ``corpus`` maps a backend to the runner's exit status and its ``--json`` file."""
    pytest: dict[str, Any] = {"args": pytest_args, "full": is_full(pytest_args), "exit": pytest_exit}
    if junit is not None and junit.is_file() and junit.stat().st_size:
        pytest.update(read_junit(junit))
    else:
        pytest["missing"] = "no JUnit XML: pytest did not finish"
    backends: dict[str, Any] = {}
    for backend, (code, path) in sorted(corpus.items()):
        if path is not None and path.is_file():
            backends[backend] = {"exit": code, "cases": read_corpus(path, ours)}
        else:
            backends[backend] = {"exit": code, "missing": "no --json output: the runner did not finish"}
    return {
        "release": torch_version.split("+")[0],
        "torch_version": torch_version,
        "date": date or datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        **git_commit(repo),
        "pytest": pytest,
        "corpus": backends,
    }


def load_runs(directory: Path) -> dict[str, dict[str, Any]]:
    """The recorded runs by release."""
    runs = {}
    for path in sorted(directory.glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        runs[record["release"]] = record
    return runs
