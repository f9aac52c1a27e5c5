"""Arrows point one way: no cycle among the imports of ``dynamo_ext``'s modules; and no folder or module grows too big.

Every import counts, at module level or inside a function (a lazy import is still an arrow: a model that imports
its renderer inside ``__str__`` and the renderer that imports the model depend on each other); only
``if TYPE_CHECKING:`` blocks are left out.  An import of ``a.b.c`` is an arrow to ``a.b.c`` alone: Python loads the
parent packages first, but an arrow to a package's ``__init__`` from inside that package is not a cycle between
modules.

Sizes: a package folder holds at most :data:`MAX_MODULES` modules (``__init__.py`` counted) and a module has at most
:data:`MAX_LINES` lines; past that, cut the folder into subpackages by role, or the module by concern.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dynamo_ext"
MAX_MODULES = 15
MAX_LINES = 450


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under ``tree`` except those of ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for n in node.orelse:
                out += [n] if isinstance(n, (ast.Import, ast.ImportFrom)) else _imports(n)
        else:
            out += _imports(node)
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` for every ``.py`` file under ``package``."""
    files = {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        arrows: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = ".".join(here[: len(here) - node.level + 1] if node.level else [])
                base = ".".join(p for p in (base, node.module or "") if p)
                # ``from pkg import mod`` names a module; ``from mod import name`` names the module itself.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            arrows |= {t for t in targets if t in files and t != name}
        # Within a package, an arrow to one of its own ancestors' __init__ is Python's loading order, not a cycle.
        graph[name] = {t for t in arrows if not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle_through_from_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\n\ntry:\n    from ..c import x\nexcept ImportError:\n    pass\n")
    (pkg / "c.py").write_text("def f():\n    from pkg.a import y\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .a import y\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.c"] == {"pkg.a"} and graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_no_import_cycle_between_modules_of_the_package():
    """Lazy imports included: ``audit/model`` and ``audit/render`` once imported each other that way."""
    graph = import_graph()
    assert "dynamo_ext.audit.model.records" in graph and graph["dynamo_ext.audit.cli"]
    found = cycles(graph)
    assert not found, "import cycles (module-level imports): " + "; ".join(" <-> ".join(c) for c in found)


def test_audit_model_never_imports_renderers_or_what_uses_it():
    """The report model sits under everything that reads or renders it: it imports none of them, even lazily."""
    graph = import_graph()
    model = [m for m in graph if m.startswith("dynamo_ext.audit.model")]
    assert model
    for m in model:
        bad = {t for t in graph[m] if t.startswith("dynamo_ext.audit.") and not t.startswith("dynamo_ext.audit.model")}
        assert not bad, f"{m} imports {sorted(bad)}"


def oversized(package: Path = PACKAGE) -> list[str]:
    """Folders under ``package`` with more than :data:`MAX_MODULES` modules, and modules over :data:`MAX_LINES` lines."""
    out: list[str] = []
    for folder in sorted({p.parent for p in package.rglob("*.py")}):
        modules = sorted(p.name for p in folder.glob("*.py"))
        if len(modules) > MAX_MODULES:
            where = folder.relative_to(package.parent)
            out.append(f"{where}/ has {len(modules)} modules (at most {MAX_MODULES}): {', '.join(modules)}")
    for path in sorted(package.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            out.append(f"{path.relative_to(package.parent)} has {lines} lines (at most {MAX_LINES})")
    return out


def test_the_size_check_names_a_crowded_folder_and_a_long_module(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for i in range(MAX_MODULES):
        (pkg / f"m{i:02}.py").write_text("x = 1\n" * MAX_LINES)  # at the limits: not named
    (pkg / "sub" / "__init__.py").write_text("")
    assert oversized(pkg) == []
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert oversized(pkg) == [
        f"pkg/ has {MAX_MODULES + 1} modules (at most {MAX_MODULES}): __init__.py, "
        + ", ".join(f"m{i:02}.py" for i in range(MAX_MODULES)),
        f"pkg/sub/long.py has {MAX_LINES + 1} lines (at most {MAX_LINES})",
    ]


def test_no_package_folder_or_module_is_too_big():
    found = oversized()
    assert not found, "too big (cut by role or concern):\n" + "\n".join(found)
