"""The compatibility package: its layout (what callers and tests rely on) and the probes whose other branches
this torch release cannot reach."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import types
from pathlib import Path

import pytest

from dynamo_ext import _compat

MODULES = sorted(m.name for m in pkgutil.iter_modules(_compat.__path__))


def _public_names(module: types.ModuleType) -> list[str]:
    """Names a module defines at top level (functions, classes, assignments), without the private ones."""
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


@pytest.mark.parametrize("name", MODULES)
def test_each_module_is_small_documented_and_re_exported(name):
    """Callers read ``_compat.X`` (and tests patch it there): a probe missing from the package's names would
    fail only when its caller first runs."""
    module = importlib.import_module(f"dynamo_ext._compat.{name}")
    text = Path(module.__file__).read_text(encoding="utf-8")
    assert len(text.splitlines()) < 400, f"_compat/{name}.py has grown past 400 lines: split it by subsystem"
    assert module.__doc__, f"_compat/{name}.py has no module docstring saying what it holds"
    for public in _public_names(module):
        assert getattr(_compat, public, None) is getattr(module, public), f"_compat does not re-export {name}.{public}"
        assert public in _compat.__all__, f"{name}.{public} is missing from _compat.__all__"
        value = getattr(module, public)
        if inspect.isfunction(value) and value.__module__ == module.__name__:  # not a torch name re-exported
            assert value.__doc__, f"_compat.{name}.{public} has no docstring saying what it probes"


def test_package_names_come_from_its_modules():
    """``__all__`` lists exactly the modules' public names: nothing stale, nothing defined in ``__init__``."""
    defined = {n for name in MODULES for n in _public_names(importlib.import_module(f"dynamo_ext._compat.{name}"))}
    assert sorted(_compat.__all__) == sorted(defined)


def test_fsdp_param_groups_both_layouts():
    """2.12+ keep a list of groups; 2.11 one optional group."""
    groups = [object(), object()]
    assert _compat.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_groups=groups)) is groups
    group = object()
    assert _compat.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert _compat.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == []


def test_fsdp_unsharded_spec_both_layouts():
    """2.12+ ``_unsharded_dtensor_spec``; 2.11 only ``_tp_spec``."""
    new, old = object(), object()
    assert _compat.fsdp_unsharded_spec(types.SimpleNamespace(_unsharded_dtensor_spec=new, _tp_spec=old)) is new
    assert _compat.fsdp_unsharded_spec(types.SimpleNamespace(_tp_spec=old)) is old


def test_dtensor_spec_shard_order_absent_is_none():
    assert _compat.dtensor_spec_shard_order(types.SimpleNamespace()) is None
    assert _compat.dtensor_spec_shard_order(types.SimpleNamespace(shard_order=((0, 1),))) == ((0, 1),)


def test_aten_op_probe():
    import torch

    assert _compat.aten_op("add") is torch.ops.aten.add
    assert _compat.aten_op("no_such_op_in_any_release") is None
