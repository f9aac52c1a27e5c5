"""Every third-party module the repository imports is declared in pyproject.toml.

Parses each import (``ast``) in ``dynamo_ext/``, ``tests/``, ``benchmarks/``, ``examples/`` and ``scripts/``,
drops the standard library (``sys.stdlib_module_names``), first-party and local modules (files and packages in
this repository, the shared corpus beside it) and relative imports, maps what is left to distributions
(``importlib.metadata.packages_distributions()``; a module that is not installed is taken to be its own
distribution's name) and checks them against pyproject's ``dependencies`` and extras.  ``tests/`` must get
by with ``dependencies`` plus the ``test`` extra, which is all ``scripts/test.sh`` installs, and the ``titan``
extra, whose tests skip without it; the other trees may use any extra (``examples`` for transformers).

What a declaration cannot see (torch warning at import without numpy) is caught by ``.ci/run``, which runs
the test command in a brand-new virtual environment.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("dynamo_ext", "tests", "benchmarks", "examples", "scripts")
# The shared corpus runner's modules (../shared/corpus beside the repository, put on sys.path by
# tests/test_corpus.py and benchmarks/bench_trace_and_guards.py); named here for a checkout without it.
SHARED_CORPUS_MODULES = frozenset({"corpus", "cases_public"})
SKIP_DIRS = frozenset({".git", "__pycache__", "build", "dist", ".venv", "venv", "node_modules"})


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (``PyYAML`` == ``pyyaml``, ``a_b`` == ``a-b``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The distribution name at the start of a PEP 508 requirement (``"torch>=2.11,<2.16"`` -> ``"torch"``)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if m is None:
        raise ValueError(f"not a PEP 508 requirement: {requirement!r}")
    return normalize(m.group(1))


def imported_modules(path: Path) -> Iterator[tuple[str, int]]:
    """(top-level module name, line) for every absolute import in the Python file ``path``, nested ones too."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.partition(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.partition(".")[0], node.lineno


def python_files(root: Path, trees: Iterable[str]) -> list[Path]:
    """The ``*.py`` files under ``root/<tree>`` for each tree that exists, sorted."""
    out: list[Path] = []
    for tree in trees:
        out.extend(p for p in (root / tree).rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts))
    return sorted(out)


def local_modules(root: Path) -> set[str]:
    """Top-level names importable from this checkout (and the shared corpus beside it).

    A package directory whose parent is not a package (``dynamo_ext``), and a ``*.py`` file in a directory
    that is not a package (``tests/helpers.py``, a benchmark script): what ``import NAME`` finds with that
    directory on ``sys.path``.  A package's own submodules are not top-level names.
    """
    names = set(SHARED_CORPUS_MODULES)
    for base in (root, root.parent / "shared" / "corpus"):
        if not base.is_dir():
            continue
        for p in base.rglob("*.py"):
            if SKIP_DIRS.intersection(p.relative_to(base).parts):
                continue
            if p.name == "__init__.py":
                if not (p.parent.parent / "__init__.py").exists():
                    names.add(p.parent.name)
            elif not (p.parent / "__init__.py").exists():
                names.add(p.stem)
    return names


def undeclared_imports(
    files: Iterable[Path],
    *,
    declared: Mapping[Path, set[str]],
    local: set[str],
    distributions: Mapping[str, list[str]],
    root: Path,
) -> list[str]:
    """One line per import of a third-party module that no declared distribution provides.

    ``declared`` maps a tree (a directory under ``root``) to the normalized distribution names its files may
    use; ``distributions`` maps top-level module names to the distributions that install them.
    """
    problems = []
    for path in files:
        allowed = next(names for tree, names in declared.items() if path.is_relative_to(tree))
        for module, line in imported_modules(path):
            if module in sys.stdlib_module_names or module in local:
                continue
            dists = distributions.get(module) or [module]
            if not any(normalize(d) in allowed for d in dists):
                problems.append(
                    f"{path.relative_to(root)}:{line}: imports {module!r} (distribution {' or '.join(dists)}), "
                    "which pyproject.toml does not declare for this tree"
                )
    return problems


def declared_distributions(root: Path) -> tuple[set[str], dict[str, set[str]]]:
    """(dependencies, {extra: requirements}) from ``root/pyproject.toml``, as normalized names."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    deps = {requirement_name(r) for r in project.get("dependencies", [])}
    extras = {k: {requirement_name(r) for r in v} for k, v in project.get("optional-dependencies", {}).items()}
    return deps, extras


def test_every_imported_third_party_module_is_declared():
    deps, extras = declared_distributions(ROOT)
    every_extra = set().union(*extras.values())
    declared = {ROOT / "tests": deps | extras.get("test", set()) | extras.get("titan", set())}
    declared.update({ROOT / t: deps | every_extra for t in TREES if t != "tests"})
    files = python_files(ROOT, TREES)
    assert len(files) > 20 and any(p.is_relative_to(ROOT / "examples") for p in files)
    problems = undeclared_imports(
        files,
        declared=declared,
        local=local_modules(ROOT),
        distributions=importlib.metadata.packages_distributions(),
        root=ROOT,
    )
    assert not problems, "\n".join(problems)


def test_undeclared_imports_finds_what_is_missing(tmp_path):
    pkg = tmp_path / "pkg"
    tests = tmp_path / "tests"
    pkg.mkdir()
    tests.mkdir()
    (pkg / "mod.py").write_text(
        "import os\nimport torch.nn\nfrom . import sibling\nimport yaml\n"
        "def f():\n    import notdeclared_xyz.sub as s\n    return s\n"
    )
    (tests / "test_x.py").write_text("from helpers_local import thing\nimport transformers\nimport pytest\n")
    (tests / "helpers_local.py").write_text("thing = 1\n")
    declared = {pkg: {"torch", "pyyaml", "transformers"}, tests: {"torch", "pytest"}}
    problems = undeclared_imports(
        python_files(tmp_path, ["pkg", "tests"]),
        declared=declared,
        local=local_modules(tmp_path),
        distributions={"yaml": ["PyYAML"], "torch": ["torch"]},
        root=tmp_path,
    )
    assert problems == [
        "pkg/mod.py:6: imports 'notdeclared_xyz' (distribution notdeclared_xyz), "
        "which pyproject.toml does not declare for this tree",
        "tests/test_x.py:2: imports 'transformers' (distribution transformers), "
        "which pyproject.toml does not declare for this tree",
    ]


def test_requirement_names():
    assert [requirement_name(r) for r in ("torch>=2.11,<2.16", "Typing_Extensions ; python_version<'3.11'")] == [
        "torch",
        "typing-extensions",
    ]
    with pytest.raises(ValueError, match="not a PEP 508 requirement"):
        requirement_name(">=1.0")
