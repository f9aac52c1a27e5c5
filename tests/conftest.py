"""Shared fixtures: a fake 4-rank world with the plugin installed, Dynamo reset around each test, and the
README's main command run once per session."""

from __future__ import annotations

import os
import sys

# NOTE [Inductor compiles in-process in the suite]: by default Inductor starts a pool of compile
# worker processes (one per core) in every process that compiles, each importing torch again: on the
# 2-core CI machine, 4 gloo ranks start 4 pools for a few tiny kernels.  One compile thread compiles
# the same kernels in the calling process (the generated code is the same).  The environment variable
# reaches the ranks and the audit's subprocesses (they inherit it and import torch afresh); this process
# read Inductor's config already (the audit's pytest plugin imports it), so it is set there too.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._inductor.config  # noqa: E402

torch._inductor.config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])

sys.path.insert(0, os.path.dirname(__file__))

from helpers import fake_world  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def plugin():
    """The plugin installed for one test, uninstalled after it."""
    import dynamo_ext

    dynamo_ext.install()
    try:
        yield dynamo_ext
    finally:
        dynamo_ext.uninstall()


@pytest.fixture
def world():
    """A fake process group of 4 ranks (this process is rank 0) and the plugin installed."""
    import dynamo_ext

    with fake_world(4):
        dynamo_ext.install()
        try:
            yield
        finally:
            dynamo_ext.uninstall()


@pytest.fixture(scope="session")
def readme_main_command_run():
    """The README's main command, run once per session in a brand-new virtual environment (``readme_run.py``)."""
    from readme_run import run_readme_main_command

    return run_readme_main_command()
