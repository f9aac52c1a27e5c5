"""Every private torch API ``dynamo_ext/`` uses, found by reading its source (``ast``); nothing is imported.

A torch path (``torch._dynamo.exc.unimplemented``, ``torch.ops._c10d_functional.all_reduce.default``) is
private when a name after ``torch`` starts with ``_`` and is not a dunder.  The scan follows what binds such a
path to a name or makes one, in every module of the package:

- imports (``import torch._guards``, ``from torch._dynamo import exc as _exc``, ``import ... as``);
- ``importlib.import_module("torch...")``, ``_compat.optional_attr("torch...", "name")``;
- attribute chains from a bound name (``_exc.unimplemented``, ``torch._C._current_autograd_node``),
  ``getattr(x, "name"[, default])``, ``hasattr(x, "name")`` and ``patches.setattr(x, "name", ...)``;
- assignments (``c10d = torch.ops._c10d_functional``), loops over literal tables (``for module, name in
  QUERIES``, a module's constant or another module's), f-strings of string constants;
- calls of the package's own functions: what a function returns (``_compat.inductor_config()`` is
  ``torch._inductor.config``) and the lookups it makes with its arguments (``_compat.aten_op("x")`` reads
  ``torch.ops.aten.x``), instantiated at each call whose arguments are string literals.

NOTE [how _compat probes an API]
Each use gets the check around it, read from the code: ``import attempt`` (``optional_attr``, or an import
in a ``try`` that catches ``ImportError``), ``hasattr`` (``hasattr``, ``getattr`` with a default, or a read
in a ``try`` that catches ``AttributeError``), ``signature check`` (``inspect.signature``,
``dataclasses.fields``, or its ``__code__``/``__wrapped__``/``__deprecated__`` read; ``X.__dict__.get(name)``
is a ``hasattr`` of ``X.name``), ``behaviour check``
(called inside a ``try`` that catches ``TypeError``, or in a function whose docstring says it is probed by
behaviour or by calling it), else ``direct``: used as if every release had it.

What the scan cannot name is reported, not guessed: a lookup whose module or name is not a literal the scan
can follow (``getattr(torch.ops._c10d_functional, name)`` inside ``has_functional_op``) is an
:class:`Unresolved` site with its pattern (``torch.ops._c10d_functional.<name>``), and inside ``_compat`` a
private attribute read on an object whose class the code does not name (``mesh._dim_group_names``) is an
object attribute, listed by name.  Annotations and ``if TYPE_CHECKING:`` blocks are not uses.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Union

CHECKS = ("import attempt", "hasattr", "signature check", "behaviour check", "direct")
COMPAT = "dynamo_ext._compat"
PACKAGE = "dynamo_ext"

_IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException", "*"})
_ATTRIBUTE_ERRORS = frozenset({"AttributeError", "Exception", "BaseException", "*"})
_CALL_ERRORS = frozenset({"TypeError", "Exception", "BaseException", "*"})
# A dunder read off a torch object that inspects its form: the object gets a signature check.
_FORM_DUNDERS = frozenset({"__code__", "__signature__", "__wrapped__", "__deprecated__", "__dict__"})
# Dunders that stand for the object itself in such a read (``cls.__init__.__code__``).
_PASS_DUNDERS = frozenset({"__init__", "__func__"})
_BEHAVIOUR_DOC = re.compile(r"probed\s+by\s+(behaviou?r|calling)", re.I)
_MAX_LOOP_ITEMS = 200


@dataclasses.dataclass(frozen=True, order=True)
class Site:
    """Where an API is used: the file (relative to the repository), line, enclosing function
    (``dynamo_ext._compat.fsdp.fsdp_state_class``; the module's name at module level) and the check
    around the use (one of :data:`CHECKS`); ``via`` names the package function that made the lookup
    when it was made on the caller's behalf (``dynamo_ext._compat.distributed.has_functional_op``)."""

    file: str
    line: int
    function: str
    check: str
    via: str = ""


@dataclasses.dataclass(frozen=True, order=True)
class Unresolved:
    """A lookup of a torch path the scan cannot name: ``pattern`` has ``<param>`` where a name is not known."""

    file: str
    line: int
    function: str
    pattern: str


@dataclasses.dataclass
class Scan:
    """What :func:`scan_package` found: ``apis`` by torch path, private ``object_attrs`` read in ``_compat``
    by attribute name, and the lookups it could not name."""

    apis: dict[str, set[Site]] = dataclasses.field(default_factory=dict)
    modules: dict[str, str] = dataclasses.field(default_factory=dict)  # the longest prefix imported as a module
    object_attrs: dict[str, set[Site]] = dataclasses.field(default_factory=dict)
    unresolved: set[Unresolved] = dataclasses.field(default_factory=set)

    def paths(self) -> list[str]:
        """The private torch paths found, sorted."""
        return sorted(self.apis)


# --- values the evaluator tracks ---


@dataclasses.dataclass(frozen=True)
class Torch:
    """An object reached from ``torch`` by imports and attribute reads; ``via``: the package function it came
    from; ``module``: the longest prefix of ``path`` the code imports as a module (the rest are attributes)."""

    path: str
    via: str = ""
    module: str = "torch"


@dataclasses.dataclass(frozen=True)
class Str:
    value: str


@dataclasses.dataclass(frozen=True)
class Seq:
    """A tuple or list literal: each item's possible values."""

    items: tuple[tuple[Value, ...], ...]


@dataclasses.dataclass(frozen=True)
class Ref:
    """A module or function of the package, or a standard-library name (``importlib.import_module``)."""

    name: str


@dataclasses.dataclass(frozen=True)
class Param:
    """A name the scan does not know: a parameter of the function walked (``open``: its callers may name it)
    or a value nothing names (not ``open``)."""

    name: str
    open: bool = True


@dataclasses.dataclass(frozen=True)
class Tmpl:
    """A torch path with parameters in it (``torch.ops.aten.`` + ``name``); :data:`_MODULE_END` follows the
    part the code imports as a module."""

    parts: tuple[str | Param, ...]
    via: str = ""


Value = Union[Torch, Str, Seq, Ref, Param, Tmpl]  # noqa: UP007  (a runtime alias on Python 3.10)
Alts = tuple[Value, ...]


def is_private(path: str) -> bool:
    """Whether a dotted torch path goes through a private name (``_x``, not ``__x__``)."""
    parts = path.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.endswith("__") for p in parts[1:])


def _tmpl_text(t: Tmpl) -> str:
    return "".join(p if isinstance(p, str) else f"<{p.name}>" for p in t.parts).replace(_MODULE_END, "")


_MODULE_END = "\x00"


def _make_path(parts: Iterable[str | Param], via: str) -> Value | None:
    merged: list[str | Param] = []
    for p in parts:
        if isinstance(p, str) and merged and isinstance(merged[-1], str):
            merged[-1] += p
        else:
            merged.append(p)
    if all(isinstance(p, str) for p in merged):
        text = "".join(str(p) for p in merged)
        module = text.rpartition(_MODULE_END)[0].replace(_MODULE_END, "")
        path = text.replace(_MODULE_END, "")
        if path != "torch" and not path.startswith("torch."):
            return None
        return Torch(path, via, module or "torch")
    return Tmpl(tuple(merged), via)


def _extend(value: Value, attr: str | Param) -> Value | None:
    """``value.attr`` for a torch path or template; None for anything else."""
    if isinstance(value, Torch):
        rest = value.path[len(value.module) :]
        return _make_path((value.module, _MODULE_END, rest, ".", attr), value.via)
    if isinstance(value, Tmpl):
        return _make_path((*value.parts, ".", attr), value.via)
    return None


def _unknown_object(values: Alts, node: ast.expr) -> bool:
    """Whether ``node`` is an object the scan cannot name (not a torch path, not the package's, not ``self``)."""
    if isinstance(node, ast.Name) and node.id in ("self", "cls"):
        return False
    return not any(isinstance(v, Torch | Tmpl | Ref) for v in values)


def _class_dict_owner(func: ast.expr) -> ast.expr | None:
    """``X`` when ``func`` is ``X.__dict__.get`` or ``getattr(X, "__dict__", ...).get``, else None."""
    if not (isinstance(func, ast.Attribute) and func.attr == "get"):
        return None
    d = func.value
    if isinstance(d, ast.Attribute) and d.attr == "__dict__":
        return d.value
    if (
        isinstance(d, ast.Call)
        and isinstance(d.func, ast.Name)
        and d.func.id == "getattr"
        and len(d.args) >= 2
        and isinstance(d.args[1], ast.Constant)
        and d.args[1].value == "__dict__"
    ):
        return d.args[0]
    return None


@dataclasses.dataclass
class _Function:
    module: str
    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    params: tuple[str, ...]
    defaults: dict[str, str]  # the parameters whose default is a string literal


@dataclasses.dataclass
class _Summary:
    returns: Alts = ()
    templates: list[tuple[Tmpl, str]] = dataclasses.field(default_factory=list)


class Project:
    """The package's modules, parsed once; module-level bindings and function summaries computed on demand."""

    def __init__(self, root: Path, package: str = PACKAGE) -> None:
        self.root = root
        self.files: dict[str, Path] = {}
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            self.files[".".join(parts)] = path
        self.trees = {m: ast.parse(p.read_text(encoding="utf-8"), filename=str(p)) for m, p in self.files.items()}
        self.functions: dict[str, _Function] = {}
        for module, tree in self.trees.items():
            self._index(module, module, tree.body)
        self._envs: dict[str, dict[str, Alts]] = {}
        self._summaries: dict[str, _Summary] = {}
        self._busy: set[str] = set()

    def _index(self, module: str, prefix: str, body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                positional = [*a.posonlyargs, *a.args]
                params = tuple(x.arg for x in [*positional, *a.kwonlyargs])
                pairs = [*zip(positional[len(positional) - len(a.defaults) :], a.defaults)]
                pairs += [(x, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                defaults = {
                    x.arg: d.value for x, d in pairs if isinstance(d, ast.Constant) and isinstance(d.value, str)
                }
                name = f"{prefix}.{node.name}"
                self.functions[name] = _Function(module, name, node, params, defaults)
            elif isinstance(node, ast.ClassDef):
                self._index(module, f"{prefix}.{node.name}", node.body)

    def rel(self, module: str) -> str:
        return self.files[module].relative_to(self.root).as_posix()

    def star_names(self, module: str) -> list[str]:
        """What ``from module import *`` binds: the string constants of the module's top-level ``__all__`` list
        or tuple (the package's modules all set one); nothing for a module outside the package."""
        tree = self.trees.get(module)
        for node in tree.body if tree is not None else []:
            if isinstance(node, ast.Assign) and any(getattr(x, "id", None) == "__all__" for x in node.targets):
                if isinstance(node.value, ast.List | ast.Tuple):
                    return [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return []

    def is_package(self, module: str) -> bool:
        return self.files[module].name == "__init__.py"

    def env(self, module: str) -> dict[str, Alts]:
        """The module's top-level names and what they are bound to (function bodies not walked)."""
        if module in self._envs:
            return self._envs[module]
        if module in self._busy:
            return {}
        self._busy.add(module)
        walker = _Walker(self, module, module, record=None, env={})
        walker.body(self.trees[module].body, top_level=True)
        self._busy.discard(module)
        self._envs[module] = walker.env
        return walker.env

    def summary(self, qualname: str) -> _Summary:
        """What a package function returns, and the torch lookups it makes with its parameters."""
        if qualname in self._summaries:
            return self._summaries[qualname]
        fn = self.functions.get(qualname)
        if fn is None or qualname in self._busy:
            return _Summary()
        self._busy.add(qualname)
        out = _Summary()
        env = dict(self.env(fn.module))
        env.update({p: (Param(p),) for p in fn.params})
        walker = _Walker(self, fn.module, qualname, record=None, env=env, summary=out)
        walker.body(fn.node.body)
        self._busy.discard(qualname)
        self._summaries[qualname] = out
        return out


class _Walker:
    """Walks statements, binding names to values; with ``record``, adds every private use it meets."""

    def __init__(
        self,
        project: Project,
        module: str,
        function: str,
        *,
        record: Scan | None,
        env: dict[str, Alts],
        summary: _Summary | None = None,
        doc: str = "",
    ) -> None:
        self.p = project
        self.module = module
        self.function = function
        self.record = record
        self.env = env
        self.summary = summary
        self.caught: list[frozenset[str]] = []
        self.behaviour_doc = bool(_BEHAVIOUR_DOC.search(doc))
        self.in_compat = module == COMPAT or module.startswith(COMPAT + ".")

    # --- recording ---

    def _caught(self, names: frozenset[str]) -> bool:
        return any(c & names for c in self.caught)

    def use(self, values: Alts, node: ast.AST, check: str) -> None:
        """Record each private torch path among ``values`` (templates: in the summary, or as unresolved)."""
        for v in values:
            if isinstance(v, Torch) and is_private(v.path):
                if self.record is not None:
                    site = Site(self.p.rel(self.module), node.lineno, self.function, check, v.via)  # type: ignore[attr-defined]
                    self.record.apis.setdefault(v.path, set()).add(site)
                    if len(v.module) > len(self.record.modules.get(v.path, "")):
                        self.record.modules[v.path] = v.module
            elif isinstance(v, Tmpl):
                params = [p for p in v.parts if isinstance(p, Param)]
                if all(p.open for p in params):  # its callers name it: in the summary, instantiated at each call
                    if self.summary is not None:
                        self.summary.templates.append((v, check))
                elif (
                    self.record is not None
                    and isinstance(v.parts[0], str)
                    and is_private(v.parts[0].replace(_MODULE_END, "") + "x")
                ):
                    pattern = _tmpl_text(v)
                    self.record.unresolved.add(
                        Unresolved(self.p.rel(self.module), node.lineno, self.function, pattern)  # type: ignore[attr-defined]
                    )

    def object_attr(self, name: str, node: ast.AST, check: str) -> None:
        if self.record is None or not self.in_compat or not name.startswith("_") or name.endswith("__"):
            return
        site = Site(self.p.rel(self.module), node.lineno, self.function, check)  # type: ignore[attr-defined]
        self.record.object_attrs.setdefault(name, set()).add(site)

    def read_check(self) -> str:
        return "hasattr" if self._caught(_ATTRIBUTE_ERRORS) else "direct"

    def import_check(self) -> str:
        return "import attempt" if self._caught(_IMPORT_ERRORS) else "direct"

    # --- statements ---

    def body(self, stmts: list[ast.stmt], *, top_level: bool = False) -> None:
        for s in stmts:
            self.stmt(s, top_level=top_level)

    def bind(self, target: ast.expr, values: Alts) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = values
        elif isinstance(target, ast.Tuple | ast.List):
            seqs = [v for v in values if isinstance(v, Seq) and len(v.items) == len(target.elts)]
            for i, t in enumerate(target.elts):
                self.bind(t, tuple(x for s in seqs for x in s.items[i]))
        else:
            self.expr(target)

    def stmt(self, s: ast.stmt, *, top_level: bool = False) -> None:
        if isinstance(s, ast.Import):
            for a in s.names:
                if a.asname:
                    self.env[a.asname] = self.module_value(a.name)
                else:
                    top = a.name.partition(".")[0]
                    self.env[top] = self.module_value(top)
                self.use(self.module_value(a.name), s, self.import_check())
        elif isinstance(s, ast.ImportFrom):
            base = self.resolve_from(s)
            for a in s.names:
                if a.name == "*":
                    for name in self.p.star_names(base):
                        self.env[name] = self.attr_values(self.module_value(base), name)
                    continue
                value = self.attr_values(self.module_value(base), a.name)
                self.env[a.asname or a.name] = value
                self.use(self.module_value(base), s, self.import_check())
                self.use(value, s, self.import_check())
        elif isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef):
            for d in s.decorator_list:
                self.expr(d)
            for d in [*s.args.defaults, *(k for k in s.args.kw_defaults if k is not None)]:
                self.expr(d)
            if top_level or self.summary is not None:
                self.env[s.name] = (Ref(f"{self.function}.{s.name}"),)
            else:  # a nested def: walked as part of the enclosing function
                inner = dict(self.env)
                a = s.args
                for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                    inner[x.arg] = ()
                saved = self.env
                self.env = inner
                self.body(s.body)
                self.env = saved
                self.env[s.name] = ()
        elif isinstance(s, ast.ClassDef):
            for d in [*s.decorator_list, *s.bases, *(k.value for k in s.keywords)]:
                self.expr(d)
            if top_level:
                saved = self.env
                self.env = dict(saved)
                self.body([b for b in s.body if not isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef)])
                self.env = saved
                self.env[s.name] = (Ref(f"{self.function}.{s.name}"),)
            else:
                self.env[s.name] = ()
        elif isinstance(s, ast.Assign):
            values = self.expr(s.value)
            for t in s.targets:
                self.bind(t, values)
        elif isinstance(s, ast.AnnAssign):
            if s.value is not None:
                self.bind(s.target, self.expr(s.value))
        elif isinstance(s, ast.AugAssign):
            self.expr(s.value)
            if isinstance(s.target, ast.Name):
                self.env[s.target.id] = ()
        elif isinstance(s, ast.If):
            self.expr(s.test)
            if "TYPE_CHECKING" not in ast.unparse(s.test):
                self.body(s.body, top_level=top_level)
            self.body(s.orelse, top_level=top_level)
        elif isinstance(s, ast.Try):
            names: set[str] = set()
            for h in s.handlers:
                if h.type is None:
                    names.add("*")
                else:
                    types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
                    names |= {ast.unparse(t).rpartition(".")[2] for t in types}
            self.caught.append(frozenset(names))
            self.body(s.body, top_level=top_level)
            self.caught.pop()
            for h in s.handlers:
                self.body(h.body, top_level=top_level)
            self.body(s.orelse, top_level=top_level)
            self.body(s.finalbody, top_level=top_level)
        elif isinstance(s, ast.For | ast.AsyncFor):
            self.loop(s)
        elif isinstance(s, ast.Return):
            values = self.expr(s.value) if s.value is not None else ()
            if self.summary is not None:
                self.summary.returns += tuple(v for v in values if isinstance(v, Torch | Tmpl))
        elif isinstance(s, ast.With | ast.AsyncWith):
            for item in s.items:
                self.expr(item.context_expr)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, ())
            self.body(s.body, top_level=top_level)
        else:
            for child in ast.iter_child_nodes(s):
                if isinstance(child, ast.stmt):
                    self.stmt(child, top_level=top_level)
                elif isinstance(child, ast.expr):
                    self.expr(child)
                elif isinstance(child, ast.ExceptHandler | ast.match_case):
                    for c in ast.iter_child_nodes(child):
                        if isinstance(c, ast.stmt):
                            self.stmt(c)

    def loop(self, s: ast.For | ast.AsyncFor) -> None:
        items = self.items(self.expr(s.iter))
        if items is None or len(items) > _MAX_LOOP_ITEMS:
            self.bind(s.target, ())
            self.body(s.body)
        else:
            for item in items:
                self.bind(s.target, item)
                self.body(s.body)
        self.body(s.orelse)

    @staticmethod
    def items(values: Alts) -> list[Alts] | None:
        """The items of the sequences among ``values``, or None when none is a known sequence."""
        seqs = [v for v in values if isinstance(v, Seq)]
        if not seqs or len(seqs) != len(values):
            return None
        return [item for s in seqs for item in s.items]

    # --- names ---

    def resolve_from(self, s: ast.ImportFrom) -> str:
        if not s.level:
            return s.module or ""
        here = self.module.split(".")
        if not self.p.is_package(self.module):
            here = here[:-1]
        base = here[: len(here) - s.level + 1]
        return ".".join([*base, *([s.module] if s.module else [])])

    def module_value(self, name: str) -> Alts:
        if name == "torch" or name.startswith("torch."):
            return (Torch(name, module=name),)
        return (Ref(name),)

    def attr_values(self, values: Alts, attr: str) -> Alts:
        out: list[Value] = []
        for v in values:
            if isinstance(v, Torch | Tmpl):
                x = _extend(v, attr)
                if x is not None:
                    out.append(x)
            elif isinstance(v, Ref):
                if v.name in self.p.files:
                    env = self.p.env(v.name)
                    if attr in env:
                        out.extend(env[attr])
                        continue
                    sub = f"{v.name}.{attr}"
                    out.append(Ref(sub))
                else:
                    out.append(Ref(f"{v.name}.{attr}"))
        return tuple(out)

    # --- expressions ---

    def chain(self, node: ast.expr) -> Alts:
        """The values of an attribute chain, recording only what is not part of it (calls, subscripts)."""
        if isinstance(node, ast.Attribute):
            base = self.chain(node.value)
            if node.attr in _PASS_DUNDERS:
                return base
            if node.attr.startswith("__") and node.attr.endswith("__"):
                if node.attr in _FORM_DUNDERS:
                    self.use(base, node, "signature check")
                return ()
            if _unknown_object(base, node.value):
                self.object_attr(node.attr, node, self.read_check())
            return self.attr_values(base, node.attr)
        return self.expr(node)

    def expr(self, node: ast.expr | None) -> Alts:
        if node is None:
            return ()
        if isinstance(node, ast.Constant):
            return (Str(node.value),) if isinstance(node.value, str) else ()
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            return (Ref(node.id),) if node.id in ("getattr", "hasattr", "setattr") else ()
        if isinstance(node, ast.Attribute):
            values = self.chain(node)
            self.use(values, node, self.read_check())
            return values
        if isinstance(node, ast.Tuple | ast.List):
            items = tuple(self.expr(e) for e in node.elts)
            return (Seq(items),)
        if isinstance(node, ast.JoinedStr):
            return self.fstring(node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.expr(node.left), self.expr(node.right)
            return tuple(
                Str(a.value + b.value) for a in left for b in right if isinstance(a, Str) and isinstance(b, Str)
            )
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.NamedExpr):
            values = self.expr(node.value)
            self.bind(node.target, values)
            return values
        if isinstance(node, ast.Lambda):
            saved = self.env
            self.env = dict(saved)
            for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                self.env[a.arg] = ()
            self.expr(node.body)
            self.env = saved
            return ()
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            saved = self.env
            self.env = dict(saved)
            self.comprehension(node, 0)
            self.env = saved
            return ()
        if isinstance(node, ast.IfExp):
            self.expr(node.test)
            return self.expr(node.body) + self.expr(node.orelse)
        if isinstance(node, ast.BoolOp):
            out: Alts = ()
            for v in node.values:
                out += self.expr(v)
            return out
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.expr(child)
            elif isinstance(child, ast.comprehension):
                self.expr(child.iter)
        return ()

    def comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp, i: int) -> None:
        """Walk generator ``i`` and those after it, then the element: once per item of a known sequence, so
        names unpacked from one item stay together (``for module, name in TABLE``)."""
        if i == len(node.generators):
            if isinstance(node, ast.DictComp):
                self.expr(node.key)
                self.expr(node.value)
            else:
                self.expr(node.elt)
            return
        gen = node.generators[i]
        items = self.items(self.expr(gen.iter))
        for item in [()] if items is None or len(items) > _MAX_LOOP_ITEMS else items:
            self.bind(gen.target, item)
            for cond in gen.ifs:
                self.expr(cond)
            self.comprehension(node, i + 1)

    def fstring(self, node: ast.JoinedStr) -> Alts:
        texts = [""]
        for part in node.values:
            if isinstance(part, ast.Constant):
                texts = [t + str(part.value) for t in texts]
            elif isinstance(part, ast.FormattedValue):
                strs = [v.value for v in self.expr(part.value) if isinstance(v, Str)]
                if not strs:
                    return ()
                texts = [t + s for t in texts for s in strs]
        return tuple(Str(t) for t in texts)

    def names(self, node: ast.expr | None) -> Alts:
        """Possible names of a ``getattr``-like literal: strings, or a parameter in a summary."""
        return tuple(v for v in self.expr(node) if isinstance(v, Str | Param))

    def call(self, node: ast.Call) -> Alts:
        func = self.expr(node.func)
        refs = {v.name for v in func if isinstance(v, Ref)}
        args, kw = node.args, {k.arg: k.value for k in node.keywords if k.arg}
        if refs & {"getattr", "hasattr"} and len(args) >= 2:
            obj = self.chain(args[0])
            names = self.names(args[1])
            for a in args[2:]:
                self.expr(a)
            check = "hasattr" if ("hasattr" in refs or len(args) > 2) else self.read_check()
            if isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
                if args[1].value in _FORM_DUNDERS:
                    self.use(obj, node, "signature check")
                    return ()
                if _unknown_object(obj, args[0]):
                    self.object_attr(args[1].value, node, check)
            out = tuple(x for v in obj for n in names if (x := _extend(v, n.value if isinstance(n, Str) else n)))
            if not names:
                out = tuple(x for v in obj if isinstance(v, Torch | Tmpl) and (x := _extend(v, Param("?", open=False))))
            self.use(out, node, check)
            return out if "getattr" in refs else ()
        if refs & {"setattr", "patches.setattr"} or (
            isinstance(node.func, ast.Attribute) and node.func.attr == "setattr" and len(args) >= 2
        ):
            obj = self.chain(args[0])
            out = tuple(
                x for v in obj for n in self.names(args[1]) if isinstance(n, Str) and (x := _extend(v, n.value))
            )
            self.use(out, node, "direct")
            for a in args[2:]:
                self.expr(a)
            return ()
        owner = _class_dict_owner(node.func)
        if owner is not None and args:  # ``X.__dict__.get("name")``: whether X itself defines it
            self.use(
                tuple(
                    x
                    for v in self.chain(owner)
                    for n in self.names(args[0])
                    if (x := _extend(v, n.value if isinstance(n, Str) else n))
                ),
                node,
                "hasattr",
            )
        arg_values = [self.expr(a) for a in args]
        kw_values = {k: self.expr(v) for k, v in kw.items()}
        out: list[Value] = []
        for ref in refs:
            if ref == "importlib.import_module" and arg_values:
                mods = tuple(
                    m
                    for v in arg_values[0]
                    if (
                        m := _make_path((v.value if isinstance(v, Str) else v, _MODULE_END), "")
                        if isinstance(v, Str | Param)
                        else None
                    )
                )
                self.use(mods, node, self.import_check())
                out += mods
            elif ref in ("inspect.signature", "dataclasses.fields", "dataclasses.is_dataclass") and arg_values:
                self.use(
                    self.chain(args[0]) if isinstance(args[0], ast.Attribute) else arg_values[0],
                    node,
                    "signature check",
                )
            elif ref in self.p.functions:
                out += self.call_function(ref, node, arg_values, kw_values)
        torch_funcs = tuple(v for v in func if isinstance(v, Torch))
        if torch_funcs and (self._caught(_CALL_ERRORS) or self.behaviour_doc):
            self.use(torch_funcs, node, "behaviour check")
        return tuple(out)

    def call_function(self, name: str, node: ast.Call, args: list[Alts], kwargs: dict[str, Alts]) -> list[Value]:
        """A package function's return values and its torch lookups, instantiated with this call's arguments."""
        fn = self.p.functions[name]
        summary = self.p.summary(name)
        if not summary.templates and not summary.returns:
            return []
        bound: dict[str, Alts] = {k: (Str(v),) for k, v in fn.defaults.items()}
        bound.update(zip(fn.params, args))
        bound.update({k: v for k, v in kwargs.items() if k in fn.params})
        via = name if not self.in_compat else ""

        def instantiate(t: Tmpl) -> list[Value]:
            options: list[tuple[str | Param, ...]] = [()]
            for part in t.parts:
                if isinstance(part, str):
                    options = [o + (part,) for o in options]
                    continue
                given = [
                    v.value if isinstance(v, Str) else v for v in bound.get(part.name, ()) if isinstance(v, Str | Param)
                ]
                if not given:
                    given = [Param(part.name, open=False)]
                options = [o + (g,) for o in options for g in given]
            out = [_make_path(o, t.via or via) for o in options]
            return [v for v in out if v is not None]

        for t, check in summary.templates:
            self.use(tuple(instantiate(t)), node, check)
        out: list[Value] = []
        for r in summary.returns:
            if isinstance(r, Tmpl):
                out += instantiate(r)
            else:
                out.append(dataclasses.replace(r, via=r.via or via))
        return out


def scan_package(root: Path, package: str = PACKAGE) -> Scan:
    """Every private torch API the package under ``root`` uses (see the module docstring)."""
    project = Project(root, package)
    found = Scan()
    for module in project.trees:
        walker = _Walker(project, module, module, record=found, env={})
        walker.body(project.trees[module].body, top_level=True)
    for fn in project.functions.values():
        env = dict(project.env(fn.module))
        env.update({p: (Param(p),) for p in fn.params})
        doc = ast.get_docstring(fn.node) or ""
        walker = _Walker(project, fn.module, fn.qualname, record=found, env=env, doc=doc)
        walker.body(fn.node.body)
    return found
