"""pytest plugin for gpu_check's "tests" phase: a per-test watchdog and results written as they come.

    python -m pytest -p gpu_check_pytest -m gpu tests/test_kernel_*.py   # scripts/ on PYTHONPATH

- Every ``InProcessRanks`` and every ``PeerBuffers`` the tests make is registered with the
  watchdog (NOTE [gpu_check watchdog] in ``gpu_check_watchdog.py``); a test that makes no progress for
  ``GPU_CHECK_TEST_TIMEOUT_S`` seconds (default 120; progress: the test starting, each call of the
  in-process ranks) is ended with their barrier states printed.
- Each test's outcome goes to the JSON file ``GPU_CHECK_PART`` as soon as it is known
  (``{"tests": {nodeid: outcome}, "hung_test": nodeid, "watchdog": report}``), so a session the
  watchdog ends keeps the outcomes before it and names the test that hung.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from gpu_check_watchdog import JsonPart, Watchdog

_part = JsonPart(os.environ.get("GPU_CHECK_PART"))
_watchdog: Watchdog | None = None
_current_test = ""


def _register_instances(watchdog: Watchdog) -> None:
    """Wrap the constructors of the in-process ranks and of peer buffers so the watchdog sees each one."""
    from dynamo_ext.inductor_lowerings.kernels import harness
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import PeerBuffers

    post_init = harness.InProcessRanks.__post_init__

    def registered_post_init(self: Any) -> None:
        post_init(self)
        watchdog.watch(self, f"in-process ranks (W={self.world_size}, {self.device})")

    harness.InProcessRanks.__post_init__ = registered_post_init  # type: ignore[method-assign]
    run = harness.InProcessRanks.run

    def beating_run(self: Any, fn: Any, *, kernel: Any) -> Any:
        watchdog.beat(f"test {_current_test} (in-process ranks, W={self.world_size})")
        return run(self, fn, kernel=kernel)

    harness.InProcessRanks.run = beating_run  # type: ignore[method-assign]

    from_handle = PeerBuffers._from_handle.__func__  # type: ignore[attr-defined]

    def registered_from_handle(cls: type, symm: Any, device: Any) -> Any:
        peers = from_handle(cls, symm, device)
        watchdog.watch(peers, f"symmetric-memory peers (rank {peers.rank} of {peers.world_size})")
        return peers

    PeerBuffers._from_handle = classmethod(registered_from_handle)  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    global _watchdog
    timeout = float(os.environ.get("GPU_CHECK_TEST_TIMEOUT_S", "120"))
    _watchdog = Watchdog(timeout, name="tests", on_fire=lambda report: _part.set(watchdog=report))
    _part.set(tests={}, timeout_s=timeout)


def pytest_collection_finish(session: pytest.Session) -> None:
    _part.set(collected=[item.nodeid for item in session.items])
    if _watchdog is not None and not session.config.option.collectonly:
        _register_instances(_watchdog)
        _watchdog.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    global _current_test
    _current_test = item.nodeid
    if _watchdog is not None:
        _watchdog.beat(f"test {item.nodeid}")
    _part.set(hung_test=item.nodeid)  # cleared when the test reports its end
    yield
    if _watchdog is not None:
        _watchdog.disarm()  # pytest's own work between tests is not watched
    _part.data.pop("hung_test", None)
    _part.write()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        outcome = report.outcome
        if report.when != "call" and report.outcome == "failed":
            outcome = f"error in {report.when}"
        _part.data.setdefault("tests", {})[report.nodeid] = outcome
        _part.write()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _watchdog is not None:
        _watchdog.stop()
