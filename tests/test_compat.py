"""The compatibility package: its layout (what callers and tests rely on) and the probes whose other branches
this torch release cannot reach."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import types
import warnings
from pathlib import Path

import pytest

from dynamo_ext import _compat
from dynamo_ext._compat import releases

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


# --- the release check install() makes (dynamo_ext/_compat/releases) ---

_FAKE_LISTING = (
    "torch._dynamo: !no_such_api_in_any_release reset\n    probed_name_no_release_has\ntorch.no_such_module_x:\n"
)


@pytest.fixture
def fresh_release_check(monkeypatch):
    """The once-per-process flag cleared, and a listing with two absent APIs and a module no release has."""
    from dynamo_ext._compat.releases import check

    monkeypatch.setattr(check, "_warned", False)
    monkeypatch.setattr(check.private_apis, "PRIVATE_APIS", _FAKE_LISTING)
    return check


def test_a_newer_torch_warns_once_naming_the_missing_apis(fresh_release_check):
    with pytest.warns(UserWarning) as caught:
        message = releases.check_torch_release("2.16.0")
    assert [str(w.message) for w in caught] == [message]
    assert message.startswith(
        f"dynamo-ext: torch 2.16.0 is newer than {releases.LAST_VERIFIED_RELEASE}, the last release its tests"
    )
    assert (
        "It lacks 3 private torch APIs the plugin uses: torch._dynamo.no_such_api_in_any_release (used directly), "
        in message
    )
    assert "torch._dynamo.probed_name_no_release_has (probed: its feature is off)" in message
    assert "torch.no_such_module_x (used directly)" in message
    assert "torch._dynamo.reset" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert releases.check_torch_release("2.16.0") is None  # once per process


@pytest.mark.parametrize("version", ["2.11.0", "2.15.0", "2.15.4+cu132", releases.LAST_VERIFIED_RELEASE])
def test_verified_releases_do_not_warn(fresh_release_check, version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert releases.check_torch_release(version) is None
    assert fresh_release_check._warned is False


def test_a_newer_torch_with_every_api_present_still_warns(fresh_release_check, monkeypatch):
    monkeypatch.setattr(fresh_release_check.private_apis, "PRIVATE_APIS", "torch._dynamo: reset !config\n")
    with pytest.warns(UserWarning, match=r"torch 2\.16\.0a0\+git123 is newer than .* Every private torch API it uses"):
        releases.check_torch_release("2.16.0a0+git123")


def test_install_on_a_newer_torch_warns_and_installs(fresh_release_check, monkeypatch):
    import torch

    import dynamo_ext

    monkeypatch.setattr(torch, "__version__", "2.16.0")
    assert not dynamo_ext.is_installed()
    try:
        with pytest.warns(UserWarning, match="torch 2.16.0 is newer than") as caught:
            dynamo_ext.install()
        assert dynamo_ext.is_installed()
        (ours,) = [w for w in caught if w.category is UserWarning and "is newer than" in str(w.message)]
        assert ours.filename == __file__  # points at the caller of install()
        dynamo_ext.uninstall()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            dynamo_ext.install()  # a second install in the process: no second warning
    finally:
        dynamo_ext.uninstall()


def test_missing_private_apis_agrees_with_the_recorded_probe():
    """The runtime check resolves the generated listing as ``scripts/support_docs/presence.py`` did on this release."""
    import json

    import torch

    release = str(torch.__version__).split("+")[0]
    record = Path(__file__).resolve().parents[1] / "docs" / "support" / "api_presence" / f"{release}.json"
    if not record.is_file():
        pytest.skip(f"no presence record of torch {release}")
    apis = json.loads(record.read_text())["apis"]
    listed = {f"{m}.{n}" if n else m for m, n, _ in releases.check._entries(releases.private_apis.PRIVATE_APIS)}
    assert listed and listed <= set(apis), f"listed but not probed here: {sorted(listed - set(apis))}"
    missing = {p for p, _ in releases.missing_private_apis()}
    assert missing == {p for p in listed if not apis[p]["present"]}
