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
