"""Dynamo's precompile cache with the plugin installed (NOTE [frames kept out of the precompile cache])."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dynamo_ext import _compat

pytestmark = pytest.mark.skipif(
    _compat.precompile_cache_classes() is None, reason="this torch release has no Dynamo precompile cache"
)


def _add_one(x):
    return x + 1


def _add_hundred(x):
    return x + 100


def _twice_the_helper(x):
    return helper(x) * 2


helper = _add_one


@pytest.fixture
def helper_restored():
    global helper
    yield
    helper = _add_one


def test_a_replaced_function_recompiles_under_caching_precompile(plugin, helper_restored):
    # Dynamo alone drops the guard on `helper` while caching_precompile is on and keeps running _add_one.
    global helper
    x = torch.zeros(2)
    with torch._dynamo.config.patch(caching_precompile=True):
        compiled = torch.compile(_twice_the_helper, backend="eager")
        assert torch.equal(compiled(x), torch.full((2,), 2.0))
        helper = _add_hundred
        assert torch.equal(compiled(x), torch.full((2,), 200.0))


def test_each_frame_is_left_out_of_the_package_with_the_reason(plugin, caplog):
    x = torch.zeros(2)
    with torch._dynamo.config.patch(caching_precompile=True), caplog.at_level(logging.WARNING):
        torch.compile(_twice_the_helper, backend="eager")(x)
    bypasses = [r.getMessage() for r in caplog.records if "Detected a package bypass" in r.getMessage()]
    assert len(bypasses) == 1
    assert "dynamo-ext is installed" in bypasses[0]
    assert "NOTE [frames kept out of the precompile cache]" in bypasses[0]
    assert not [r for r in caplog.records if "is dropped with caching_precompile" in r.getMessage()]


def test_strict_precompile_raises_dynamos_package_error_with_the_reason(plugin):
    x = torch.zeros(2)
    with torch._dynamo.config.patch(caching_precompile=True, strict_precompile=True):
        with pytest.raises(Exception, match="dynamo-ext is installed") as info:
            torch.compile(_twice_the_helper, backend="eager")(x)
    chain = [info.value, info.value.__cause__, info.value.__context__]
    assert any(isinstance(e, torch._dynamo.exc.PackageError) for e in chain)


def test_without_caching_precompile_nothing_changes(plugin, caplog):
    x = torch.zeros(2)
    with caplog.at_level(logging.WARNING):
        torch.compile(_twice_the_helper, backend="eager")(x)
    assert not [r for r in caplog.records if "package bypass" in r.getMessage()]


_RESTART = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    sys.path.insert(0, "benchmarks")
    from _common import bundled_llama, llama_loss
    import dynamo_ext, dynamo_ext.config
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    dynamo_ext.install()
    dynamo_ext.config.compile_blocks_once = False  # compiled whole: a backend the cache saves
    model, cfg, tokens = bundled_llama(1, fsdp_only=False)
    loss = llama_loss(torch.compile(model, backend="inductor"), cfg, tokens)
    loss.backward()
    torch.compiler.save_cache_artifacts()
    from torch._dynamo.utils import counters
    print(json.dumps({"loss": float(loss), "aot": dict(counters["aot_autograd"])}))
    """
)


@pytest.mark.slow
def test_a_restarted_job_runs_and_hits_aotautograds_cache(tmp_path):
    # Without the plugin's bypass, loading the saved FSDP-over-TP graph failed inside torch.compile() (2.13).
    env = dict(os.environ, TORCH_CACHING_PRECOMPILE="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _RESTART], cwd=root, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0]["loss"] == runs[1]["loss"]
    assert runs[0]["aot"].get("autograd_cache_miss") == 1
    assert runs[1]["aot"].get("autograd_cache_hit") == 1


# NOTE [precompile packages written without the plugin]: a package written in one process, loaded in another.
_STEPS = textwrap.dedent(
    """
    import torch


    def _double(x):
        return x * 2


    def _times_twenty(x):
        return x * 20


    helper = _double


    def step_loaded_before_install(x):
        return helper(x).sum() + 1


    def step_loaded_after_install(x):
        y = helper(x) + 1
        torch._dynamo.graph_break()
        return (helper(y) * y).sum()


    def step_strict(x):
        return helper(x).sum() - 1
    """
)

_STEP_NAMES = ("step_loaded_before_install", "step_loaded_after_install", "step_strict")

_WRITE = textwrap.dedent(
    """
    import sys
    import torch
    import precompile_steps as steps
    if sys.argv[2] == "plugin":
        import dynamo_ext
        dynamo_ext.install()
    x = torch.arange(4.0)
    for name in {names!r}:
        torch.compile(getattr(steps, name), backend="inductor")(x)
    with open(sys.argv[1], "wb") as f:
        f.write(torch.compiler.save_cache_artifacts()[0])
    """
).format(names=_STEP_NAMES)

_READ = textwrap.dedent(
    """
    import json, logging, sys
    import torch
    import dynamo_ext
    import precompile_steps as steps

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            error = record.exc_info[1] if record.exc_info else None
            records.append({"logger": record.name, "message": record.getMessage(),
                            "error": None if error is None else [type(error).__name__, str(error)]})

    for name in ("dynamo_ext.guards.precompile_load", "torch._dynamo.eval_frame"):
        logging.getLogger(name).addHandler(Keep(level=logging.WARNING))
    with open(sys.argv[1], "rb") as f:
        torch.compiler.load_cache_artifacts(f.read())
    x = torch.arange(4.0)
    out = {}
    before = torch.compile(steps.step_loaded_before_install, backend="inductor")
    out["before_install"] = float(before(x))  # helper not replaced yet: the loaded frame is right
    try:
        with torch._dynamo.config.patch(strict_precompile=True):
            dynamo_ext.install()
        out["strict_install"] = None
    except Exception as e:
        out["strict_install"] = [type(e).__name__, str(e)]
    out["installed_after_strict_install"] = dynamo_ext.is_installed()
    dynamo_ext.install()
    after = torch.compile(steps.step_loaded_after_install, backend="inductor")
    steps.helper = steps._times_twenty
    out["values"] = {
        "step_loaded_before_install": [float(before(x)), float(steps.step_loaded_before_install(x))],
        "step_loaded_after_install": [float(after(x)), float(steps.step_loaded_after_install(x))],
    }
    with torch._dynamo.config.patch(strict_precompile=True):
        strict = torch.compile(steps.step_strict, backend="inductor")
        try:
            strict(x)
            out["strict_call"] = None
        except Exception as e:
            out["strict_call"] = type(e).__name__
    out["records"] = records
    print(json.dumps(out))
    """
)


def _run(code, *args, tmp_path, cache):
    env = dict(
        os.environ,
        TORCH_CACHING_PRECOMPILE="1",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / cache),  # each process its own: the artifacts carry the package
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finished(process):
    stdout, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-4000:]
    return stdout


@pytest.fixture(scope="module")
def restarts(tmp_path_factory):
    """For each writer (stock: no plugin; plugin: installed), what a second process with the plugin reads."""
    tmp_path = tmp_path_factory.mktemp("precompile_restart")
    (tmp_path / "precompile_steps.py").write_text(_STEPS)
    writers = {
        w: _run(_WRITE, str(tmp_path / w), w, tmp_path=tmp_path, cache=f"write_{w}") for w in ("stock", "plugin")
    }
    for process in writers.values():
        _finished(process)
    readers = {w: _run(_READ, str(tmp_path / w), tmp_path=tmp_path, cache=f"read_{w}") for w in writers}
    return {w: json.loads(_finished(p).strip().splitlines()[-1]) for w, p in readers.items()}


def _refusals(run):
    return [r["message"] for r in run["records"] if r["logger"] == "dynamo_ext.guards.precompile_load"]


@pytest.mark.parametrize("writer", ["stock", "plugin"])
def test_a_restarted_job_with_the_plugin_calls_the_replaced_function(restarts, writer):
    # Written without the plugin, the loaded frames ran the old helper: 13.0 where eager gives 121.0 (2.13, 2.15).
    run = restarts[writer]
    assert run["before_install"] == 13.0
    for name, (compiled, eager) in run["values"].items():
        assert compiled == eager, f"{writer}-written package, {name}: {compiled} against eager's {eager}"
    assert run["values"]["step_loaded_before_install"][1] == 121.0


def test_a_package_written_without_the_plugin_is_bypassed_with_the_reason(restarts):
    refusals = _refusals(restarts["stock"])
    # One package loaded before install() (unloaded there), one loaded after (bypassed as it loads).
    assert len(refusals) == 2, refusals
    assert "step_loaded_before_install (" in refusals[0] and "holds 1 saved frame(s)" in refusals[0]
    assert "step_loaded_after_install (" in refusals[1] and "holds 2 saved frame(s)" in refusals[1]
    for message in refusals:
        assert message.startswith("Detected a package bypass: dynamo-ext is installed")
        assert "written without the plugin" in message
        assert "NOTE [precompile packages written without the plugin]" in message
        assert "write it in a process with dynamo-ext installed" in message


def test_a_package_written_with_the_plugin_is_read_without_a_refusal(restarts):
    run = restarts["plugin"]
    assert _refusals(run) == []
    assert run["strict_install"] is None
    assert not [r for r in run["records"] if "Failed to load entry" in r["message"]]


def test_strict_precompile_refuses_a_package_written_without_the_plugin(restarts):
    run = restarts["stock"]
    # install() refuses a package loaded before it, and installs nothing.
    assert run["strict_install"][0] == "PackageError"
    assert "step_loaded_before_install" in run["strict_install"][1]
    assert "written without the plugin" in run["strict_install"][1]
    assert run["installed_after_strict_install"] is False
    # torch.compile() reads the refusal as a package that failed to load, and traces again.
    failed = [r for r in run["records"] if r["message"] == "Failed to load entry from dynamo cache"]
    assert len(failed) == 1
    assert failed[0]["error"][0] == "PackageError"
    assert "step_strict (" in failed[0]["error"][1] and "written without the plugin" in failed[0]["error"][1]
    # The trace is one of the plugin's frames, which strict_precompile refuses too.
    assert run["strict_call"] == "PackageError"
