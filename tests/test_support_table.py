"""docs/support.md's generated tables are current, and the scan, probes, run records and renderer behind them.

``scripts/support_table.py write`` renders the tables from a scan of ``dynamo_ext/`` and recorded files
(``docs/support/api_presence/``, ``docs/support/runs/``); regenerating them here and comparing makes a new
private torch API use, a new recorded run or probe without a docs update fail the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import support_table  # noqa: E402
from support_docs import render, runs, scan  # noqa: E402

from dynamo_ext._compat import releases  # noqa: E402


@pytest.fixture(scope="module")
def package_scan() -> scan.Scan:
    return scan.scan_package(ROOT)


def test_generated_tables_are_current():
    """Fails after a new private torch API use (or a new record) until ``support_table.py write`` is run."""
    stale = []
    for path, text in support_table.generate().items():
        if path.read_text(encoding="utf-8") != text:
            stale.append(str(path.relative_to(ROOT)))
    assert not stale, (
        f"{', '.join(stale)} not current with the scan of dynamo_ext/ and docs/support/: "
        "run `python scripts/support_table.py write` (`write --check` shows the difference)"
    )


def test_last_verified_release_is_the_newest_recorded_run():
    recorded = runs.load_runs(support_table.RUNS_DIR)
    assert recorded, "docs/support/runs/ holds no recorded run (scripts/other_torch.sh RELEASE records one)"
    newest = max(recorded, key=render.release_key)
    assert releases.LAST_VERIFIED_RELEASE == newest, (
        f"dynamo_ext/_compat/releases/check.py: LAST_VERIFIED_RELEASE is {releases.LAST_VERIFIED_RELEASE} but "
        f"the newest recorded run is {newest}: set it to {newest}, then run `python scripts/support_table.py write`"
    )
    assert support_table.last_verified_release() == releases.LAST_VERIFIED_RELEASE


def test_this_releases_presence_record_matches_a_live_probe(package_scan):
    """The recorded presence of this torch release is what probing it now finds, for every path the scan finds."""
    release = str(torch.__version__).split("+")[0]
    recorded = support_table.load_presence().get(release)
    if recorded is None:
        pytest.skip(f"no presence record of torch {release} in docs/support/api_presence/")
    pairs = [[p, package_scan.modules[p]] for p in package_scan.paths()]
    proc = subprocess.run(
        [sys.executable, str(support_table.PRESENCE_SCRIPT)],
        input=json.dumps(pairs),
        capture_output=True,
        text=True,
        check=True,
    )
    live = json.loads(proc.stdout)["apis"]
    unrecorded = sorted(set(live) - set(recorded["apis"]))
    assert not unrecorded, (
        f"not probed on torch {release}: {unrecorded}; run `python scripts/support_table.py probe --python "
        f"{sys.executable}` (and the other releases' interpreters), then `write`"
    )
    differ = {p: live[p] for p in live if live[p]["present"] != recorded["apis"][p]["present"]}
    assert not differ, f"docs/support/api_presence/{release}.json is wrong for: {differ}"


def test_scan_of_the_package_finds_probes_tables_and_uses_outside_compat(package_scan):
    """A few uses of each kind in the real package: a probe by import, a loop over a literal table, a template
    probe called with a literal, a direct use outside ``_compat``."""
    checks = {p: {s.check for s in sites} for p, sites in package_scan.apis.items()}
    assert checks["torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState"] >= {"hasattr"}
    assert "hasattr" in checks["torch.distributed.distributed_c10d._get_default_group"]  # QUERIES in c10d/queries.py
    assert "hasattr" in checks["torch.ops.aten._fused_rms_norm"]  # _compat.aten_op("_fused_rms_norm")
    assert "signature check" in checks["torch._dynamo.external_utils.call_accumulate_grad"]
    files = {s.file for s in package_scan.apis["torch.utils._pytree.tree_map"]}
    assert files and not any(f.startswith("dynamo_ext/_compat/") for f in files)


# --- the scan, on a package made for it ---

_COMPAT_INIT = """
from .mod import has_op, state_class
from .probes import optional_attr
"""
_PROBES = """
import importlib


def optional_attr(module, name):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
"""
_MOD = '''
import importlib
import inspect

import torch
import torch._guards
from torch._dynamo import exc as _exc

from .probes import optional_attr

unimplemented = _exc.unimplemented
_FSDP = "torch.distributed.fsdp._fully_shard"
TABLE = (("torch.distributed.distributed_c10d", "_get_default_group"), ("torch.distributed", "get_rank"))


def state_class():
    return optional_attr(f"{_FSDP}._fsdp_state", "FSDPState")


def symm():
    try:
        return importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return None


def route():
    mod = symm()
    return getattr(mod, "enable_symm_mem_for_group", None)


def has_op(name):
    try:
        getattr(torch.ops._c10d_functional, name)
    except AttributeError:
        return False
    return True


def accumulate():
    fn = optional_attr("torch._dynamo.external_utils", "call_accumulate_grad")
    return list(inspect.signature(fn).parameters)


def divide(group):
    fn = optional_attr("torch.distributed.fsdp._fully_shard._fsdp_collectives", "_get_gradient_divide_factors")
    try:
        return fn(group, 1)
    except TypeError:
        return fn(group)


def hash_files(paths):
    """Probed by calling it."""
    return torch._inductor.custom_graph_pass.get_hash_for_files(paths)


def group_names(mesh):
    return getattr(mesh, "_dim_group_names", None)


def spec_of(x):
    return x._spec


def compile_id():
    return torch._guards.CompileContext.current_compile_id()


def own_pickler_reducer():
    cls = optional_attr("torch._inductor.codecache", "FxGraphCachePickler")
    return getattr(cls, "__dict__", {}).get("reducer_override")


def all_present():
    needed = [("torch._dynamo.package", "load_guards_state"), ("torch._C._dynamo.eval_frame", "_reset_entries")]
    return all(optional_attr(m, n) is not None for m, n in needed)
'''
_USER = """
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree

from dynamo_ext import _compat
from dynamo_ext._compat import mod

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

c10d = torch.ops._c10d_functional


def mapped(x):
    return pytree.tree_map(str, x)


def ops_present():
    return _compat.has_op("all_reduce") and mod.has_op("wait_tensor")


def op_present(name):
    return _compat.has_op(name)


def op_named_elsewhere():
    return op_present(input())


def queries():
    for module, name in mod.TABLE:
        _compat.optional_attr(module, name)


def gather():
    return c10d.all_gather_into_tensor.default


def annotated(x: torch._subclasses.FakeTensor) -> torch._ops.OpOverload:
    return x
"""


def test_scan_names_each_use_and_the_check_around_it(tmp_path):
    pkg = tmp_path / "dynamo_ext"
    (pkg / "_compat").mkdir(parents=True)
    files = {"__init__.py": "", "_compat/__init__.py": _COMPAT_INIT, "_compat/probes.py": _PROBES}
    files |= {"_compat/mod.py": _MOD, "user.py": _USER}
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    found = scan.scan_package(tmp_path)
    checks = {p: sorted({s.check for s in sites}) for p, sites in found.apis.items()}
    assert checks == {
        "torch._guards": ["direct"],
        "torch._guards.CompileContext.current_compile_id": ["direct"],
        "torch._dynamo": ["direct"],
        "torch._dynamo.exc": ["direct"],
        "torch._dynamo.exc.unimplemented": ["direct"],
        "torch.distributed.fsdp._fully_shard._fsdp_state": ["import attempt"],
        "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState": ["hasattr"],
        "torch.distributed._symmetric_memory": ["import attempt"],
        "torch.distributed._symmetric_memory.enable_symm_mem_for_group": ["hasattr"],
        "torch._dynamo.external_utils": ["import attempt"],
        "torch._dynamo.external_utils.call_accumulate_grad": ["hasattr", "signature check"],
        "torch.distributed.fsdp._fully_shard._fsdp_collectives": ["import attempt"],
        "torch.distributed.fsdp._fully_shard._fsdp_collectives._get_gradient_divide_factors": [
            "behaviour check",
            "hasattr",
        ],
        "torch._inductor.custom_graph_pass.get_hash_for_files": ["behaviour check", "direct"],
        "torch.utils._pytree": ["direct"],
        "torch.utils._pytree.tree_map": ["direct"],
        "torch.ops._c10d_functional": ["direct"],
        "torch.ops._c10d_functional.all_reduce": ["hasattr"],
        "torch.ops._c10d_functional.wait_tensor": ["hasattr"],
        "torch.ops._c10d_functional.all_gather_into_tensor.default": ["direct"],
        "torch.distributed.distributed_c10d._get_default_group": ["hasattr"],
        "torch._dynamo.package": ["import attempt"],
        "torch._dynamo.package.load_guards_state": ["hasattr"],
        "torch._C._dynamo.eval_frame": ["import attempt"],
        "torch._C._dynamo.eval_frame._reset_entries": ["hasattr"],
        "torch._inductor.codecache": ["import attempt"],
        "torch._inductor.codecache.FxGraphCachePickler": ["hasattr", "signature check"],
        "torch._inductor.codecache.FxGraphCachePickler.reducer_override": ["hasattr"],
    }
    (site,) = found.apis["torch.ops._c10d_functional.all_reduce"]
    assert (site.file, site.function, site.via) == (
        "dynamo_ext/user.py",
        "dynamo_ext.user.ops_present",
        "dynamo_ext._compat.mod.has_op",
    )
    assert found.modules["torch._dynamo.exc.unimplemented"] == "torch._dynamo"
    assert found.modules["torch.distributed._symmetric_memory.enable_symm_mem_for_group"] == (
        "torch.distributed._symmetric_memory"
    )
    assert {n: sorted({s.check for s in sites}) for n, sites in found.object_attrs.items()} == {
        "_dim_group_names": ["hasattr"],
        "_spec": ["direct"],
    }
    assert [(u.function, u.pattern) for u in found.unresolved] == [
        ("dynamo_ext.user.op_named_elsewhere", "torch.ops._c10d_functional.<name>")
    ]


# --- presence, runs and the tables ---


def test_presence_probe_resolves_modules_attributes_and_misses():
    from support_docs import presence

    assert presence.resolve("torch._dynamo.exc.unimplemented", "torch._dynamo") == {
        "present": True,
        "module": "torch._dynamo.exc",
    }
    # The package's attribute ``code_context`` is an object, not the module the code imports by that name.
    assert presence.resolve("torch._dynamo.code_context.code_context", "torch._dynamo.code_context")["present"]
    assert presence.resolve("torch.ops._c10d_functional.all_reduce", "torch")["module"] == "torch.ops._c10d_functional"
    missing = presence.resolve("torch._dynamo.no_such_name_anywhere.x", "torch._dynamo")
    assert missing["present"] is False and missing["missing"] == "torch._dynamo.no_such_name_anywhere"
    assert "no_such_name_anywhere" in missing["error"]


def _junit(tmp_path: Path) -> Path:
    """A real pytest JUnit XML (xunit1, as scripts/other_torch.sh asks for) of one pass, failure and skip."""
    test = tmp_path / "test_sample.py"
    test.write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2, 'one is not two'\n\n"
        "def test_skipped():\n    pytest.skip('no cuda here')\n"
    )
    xml = tmp_path / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:dynamo_ext_audit", str(test)]
    cmd += [f"--junitxml={xml}", "-o", "junit_family=xunit1", f"--rootdir={tmp_path}"]
    subprocess.run(cmd, cwd=tmp_path, capture_output=True, check=False)
    return xml


def _corpus(tmp_path: Path, backend: str, ok: bool) -> Path:
    rows = [
        {"case": "public_a", "fullgraph": True, "match": True},
        {"case": "public_b", "fullgraph": ok, "match": True, "fullgraph_error": "graph break in foo"},
        {"case": "ext_ours", "fullgraph": True, "match": True},
    ]
    path = tmp_path / f"corpus_{backend}.json"
    path.write_text(json.dumps({"plugin": "dynamo_ext", "backend": backend, "world": 4, "rows": rows}))
    return path


def test_a_recorded_run_renders_its_counts_and_failures(tmp_path):
    record = runs.make_record(
        torch_version="2.15.0+cu132",
        pytest_args=["tests/test_sample.py"],
        pytest_exit=1,
        junit=_junit(tmp_path),
        corpus={
            "aot_eager": (1, _corpus(tmp_path, "aot_eager", ok=False)),
            "eager": (0, _corpus(tmp_path, "eager", True)),
        },
        ours={"ext_ours"},
        repo=ROOT,
        date="2026-12-01",
    )
    assert record["pytest"]["totals"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert record["pytest"]["full"] is False and record["release"] == "2.15.0"
    text = render.results_region({"2.15.0": record}, ["2.13.0", "2.15.0"])
    header, rule, recorded, tests, public, ours, *_ = text.split("\n\n")[1].splitlines()
    assert header == "| | 2.13.0 | 2.15.0 |"
    assert recorded.startswith("| run recorded | **no recorded run** | 2026-12-01, `")
    assert "torch 2.15.0+cu132" in recorded
    assert tests.endswith("| – | partial run: `tests/test_sample.py`: 1 passed, 1 failed, 0 errors, 1 skipped |"), tests
    assert public.endswith("| – | 1/2, 2/2 |") and ours.endswith("| – | 1/1, 1/1 |")
    assert "`test_sample.py::test_bad` (failed): AssertionError: one is not two" in text
    assert "corpus `public_b` (aot_eager): graph break in foo" in text
    assert "Partial runs (not the whole suite): 2.15.0." in text
    assert "no cuda" not in text  # skips are counted, not listed as failures


def test_a_run_that_did_not_finish_says_so(tmp_path):
    record = runs.make_record(
        torch_version="2.16.0",
        pytest_args=[],
        pytest_exit=137,
        junit=tmp_path / "absent.xml",
        corpus={"aot_eager": (1, None)},
        ours=set(),
        repo=ROOT,
    )
    assert record["pytest"]["full"]
    text = render.results_region({"2.16.0": record}, [])
    assert "whole default suite; no JUnit XML: pytest did not finish (exit 137)" in text
    assert "| no result (exit 1), not run |" in text


def test_splice_replaces_only_its_region():
    begin = render._BEGIN.format(name="x")
    end = render._END.format(name="x")
    page = f"intro\n{begin}\nold\n{end}\nnotes by hand\n"
    assert render.splice(page, "x", "new table") == f"intro\n{begin}\nnew table\n{end}\nnotes by hand\n"
    with pytest.raises(ValueError, match="no generated region 'y': add the lines"):
        render.splice(page, "y", "table")


def test_private_api_listing_marks_direct_uses(package_scan):
    presence = support_table.load_presence()[releases.LAST_VERIFIED_RELEASE]
    text = render.private_apis_module(package_scan, presence)
    assert f'RELEASE = "{releases.LAST_VERIFIED_RELEASE}"' in text
    entries = text.split('PRIVATE_APIS = """')[1]
    # Probed by import, signature and behaviour (``_compat.fsdp_group_hook_codes``); used directly outside _compat.
    (fsdp_state,) = [
        line for line in entries.splitlines() if line.startswith("torch.distributed.fsdp._fully_shard._fsdp_state:")
    ]
    assert " _register_group_forward_hooks" in fsdp_state and " !FSDPState._pre_backward" in fsdp_state
