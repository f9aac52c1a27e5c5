"""The collective check on graphs AOTAutograd's cache serves (a warm restart), in one process.

A "restart" here is ``torch._dynamo.reset()`` with the same cache directory:
AOTAutograd's cache is read from disk, so the second compile hits it as a new
process would.  The graphs hold collectives but no compute, so Inductor
compiles no kernel (fast).  The check's exchange is replaced by a recorder
(as in test_collective_check.py); the exchange across real ranks after a warm
restart is in test_collective_check_cache_gloo.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn
from torch._dynamo.utils import counters

from dynamo_ext import _compat, collective_check
from dynamo_ext.collective_check import stream


@pytest.fixture
def checked_runs(world, monkeypatch, tmp_path):
    """What the check compares on each new context: ``(phase, op, site)`` per collective; a fresh cache directory."""
    from torch._inductor.utils import fresh_cache

    runs: list[list[tuple[str, str, str]]] = []

    def agree(group_runs, **kwargs):
        runs.append([(c.phase, c.op.split(".")[-1], c.site) for r in group_runs for c in r.records])
        return {r.group: True for r in group_runs}

    monkeypatch.setattr(stream, "agree", agree)
    monkeypatch.setattr(_compat, "group_is_fake", lambda name: False)  # as if the peers were real
    _restart()  # the cache counters and Dynamo's state start empty, whatever ran before in this process
    with (
        fresh_cache(dir=str(tmp_path)),
        torch._functorch.config.patch(enable_autograd_cache=True),
        torch._inductor.config.patch(fx_graph_cache=True),
    ):
        yield runs


def _restart() -> None:
    """A new Dynamo state and check state in this process, as a relaunched job has (the cache directory stays)."""
    torch._dynamo.reset()
    collective_check.reset()
    counters.clear()


def _gather(x):
    return funcol.all_gather_tensor_autograd(x, 0, dist.group.WORLD)  # backward: a reduce-scatter


def _gather_again(x):
    return funcol.all_gather_tensor_autograd(x, 0, dist.group.WORLD)  # the same graph, another line


def _gather_no_grad(x):
    return funcol.all_gather_tensor(x, 0, dist.group.WORLD)  # an inference graph: no backward


def _train(fn, steps: int = 2) -> None:
    f = torch.compile(fn, backend="inductor", fullgraph=True)
    x = torch.ones(4, requires_grad=True)
    for _ in range(steps):
        f(x).sum().backward()


def _cache_counts() -> tuple[int, int]:
    return counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_miss"]


def _record_files() -> list[str]:
    root = _compat.records_dir()
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".json")]


def test_warm_compile_hits_the_aot_cache_and_checks_the_same_forward_and_backward(checked_runs):
    _train(_gather)
    cold = list(checked_runs)
    assert _cache_counts() == (0, 1)
    line = f"test_collective_check_cache.py:{_gather.__code__.co_firstlineno + 1}"
    forward, backward = [("forward", "all_gather_into_tensor", line)], [("backward", "reduce_scatter_tensor", line)]
    assert cold == [forward, backward, forward]  # (none, fw), (fw, bw), (bw, fw): then every context was seen

    _restart()
    checked_runs.clear()
    _train(_gather)
    assert _cache_counts() == (1, 0)  # served by AOTAutograd's cache ...
    assert checked_runs == cold  # ... and the check still compares the forward's and the backward's collectives


def test_warm_inference_graph_is_checked(checked_runs):
    torch.compile(_gather_no_grad, backend="inductor")(torch.ones(4))
    cold = list(checked_runs)
    assert [[op for _, op, _ in run] for run in cold] == [["all_gather_into_tensor"]]

    _restart()
    checked_runs.clear()
    torch.compile(_gather_no_grad, backend="inductor")(torch.ones(4))
    assert _cache_counts() == (1, 0)
    assert checked_runs == cold


def test_records_follow_the_issuing_line_which_the_aot_cache_key_leaves_out(checked_runs):
    # Two graphs equal but for their lines: one AOTAutograd cache entry, two sets of records.
    _train(_gather_again, steps=1)
    _restart()
    _train(_gather, steps=1)
    assert _cache_counts() == (0, 1)  # the entry of _gather_again's graph had no records for this line
    assert len(_record_files()) == 2

    for fn in (_gather, _gather_again):
        _restart()
        checked_runs.clear()
        _train(fn, steps=1)
        assert _cache_counts() == (1, 0)
        line = f"test_collective_check_cache.py:{fn.__code__.co_firstlineno + 1}"
        assert {site for run in checked_runs for _, _, site in run} == {line}, fn.__name__


def test_a_hit_without_records_compiles_the_graph_again_and_keeps_records(checked_runs):
    _train(_gather, steps=1)
    cold = list(checked_runs)
    (path,) = _record_files()
    os.unlink(path)

    _restart()
    checked_runs.clear()
    _train(_gather, steps=1)
    assert _cache_counts() == (0, 1)  # never a hit without records: compiled again, checked
    assert checked_runs == cold
    assert _record_files() == [path]

    _restart()
    checked_runs.clear()
    _train(_gather, steps=1)
    assert _cache_counts() == (1, 0)
    assert checked_runs == cold


def test_stale_records_are_not_used(checked_runs):
    import json

    _train(_gather, steps=1)
    (path,) = _record_files()
    with open(path) as f:
        data = json.load(f)
    data["forward"][0][2] = [0, 1]  # the group's ranks as another launch had them
    with open(path, "w") as f:
        json.dump(data, f)

    _restart()
    _train(_gather, steps=1)
    assert _cache_counts() == (0, 1)
    with open(path) as f:
        assert json.load(f)["forward"][0][2] == [0, 1, 2, 3]  # rewritten by the compile


def test_uninstall_restores_the_aot_cache_lookup():
    import dynamo_ext

    cache = _compat.aot_cache_class()
    assert cache is not None  # torch 2.11 to 2.15 all have the lookup the check wraps
    before = cache.__dict__["_lookup"]
    dynamo_ext.install()
    try:
        assert cache.__dict__["_lookup"] is not before
    finally:
        dynamo_ext.uninstall()
    assert cache.__dict__["_lookup"] is before


class _UserFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def _reduce(x):
    return dist_nn.all_reduce(x)  # the plugin's own autograd.Function: AOTAutograd may cache it


def _graphs(fn, x) -> list:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(x)
    return graphs


def test_only_the_plugins_own_autograd_functions_are_let_into_the_aot_cache(world):
    from dynamo_ext.aot_cache_policy import only_our_autograd_functions

    x = torch.ones(4, requires_grad=True)
    assert [only_our_autograd_functions(g) for g in _graphs(_reduce, x)] == [True]
    assert [only_our_autograd_functions(g) for g in _graphs(lambda t: _UserFunction.apply(_reduce(t)), x)] == [False]
    assert [only_our_autograd_functions(g) for g in _graphs(_UserFunction.apply, x)] == [False]
    assert [only_our_autograd_functions(g) for g in _graphs(_gather, x)] == [False]  # no Function: nothing to allow


def test_warm_graph_with_the_plugins_autograd_function_hits_the_aot_cache(checked_runs):
    _train(_reduce, steps=1)
    cold = list(checked_runs)
    assert _cache_counts()[1] >= 1  # compiled (after other tests, sometimes twice: the second may hit the first)
    assert [[(phase, op) for phase, op, _ in run] for run in cold] == [
        [("forward", "all_reduce")],
        [("backward", "all_reduce")],
    ]

    _restart()
    checked_runs.clear()
    _train(_reduce, steps=1)
    hits, misses = _cache_counts()
    assert hits >= 1 and misses == 0
    assert checked_runs == cold
