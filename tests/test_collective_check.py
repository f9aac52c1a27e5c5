"""The collective check in one process: fingerprints, comparison rules, the hook, the config.

The exchange across real ranks is in test_collective_check_gloo.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn
import torch.fx
from helpers import fake_graph

import dynamo_ext
from dynamo_ext import collective_check, config
from dynamo_ext.collective_check import CollectiveSignature, collectives, first_difference, same_collective

c10d = torch.ops._c10d_functional


def test_fingerprint_lists_collectives_only_in_order(world):
    def build(g):
        x, y = g.placeholder("x"), g.placeholder("y")
        a = g.call_function(c10d.all_reduce.default, (g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)), "avg", "0"))
        w = g.call_function(c10d.wait_tensor.default, (a,))
        b = g.call_function(c10d.all_to_all_single.default, (y, [1, 2, 1, 1], [2, 1, 1, 1], "0"))
        s = g.call_function(c10d.isend.default, (x, 1, 0, "0"))  # point-to-point: not compared
        b.meta["stack_trace"] = (
            '  File "/site-packages/torch/x.py", line 3, in f\n    inner()\n'
            '  File "/home/me/train.py", line 12, in step\n    out = all_to_all(y)\n'
        )
        g.output((w, g.call_function(c10d.wait_tensor.default, (b,)), s))
        return [((4, 3), torch.float32), ((5, 2), torch.bfloat16)]

    records = collectives(fake_graph(build), "forward")
    assert [(c.op, c.reduce_op, c.tensors, c.args) for c in records] == [
        ("_c10d_functional.all_reduce", "avg", ("float32[4, 3]",), ()),
        ("_c10d_functional.all_to_all_single", "", ("bfloat16[*, 2]",), ()),  # splits and dim 0 differ per rank
    ]
    assert records[0].group == "0" and records[0].ranks == (0, 1, 2, 3)
    assert records[1].source == "/home/me/train.py:12: out = all_to_all(y)"  # the user's frame, not torch's
    assert records[1].describe() == "forward all_to_all_single(bfloat16[*, 2]) on group '0' (ranks 0\u20133)"


def _c(group="g", ranks=(0, 1), **kw) -> CollectiveSignature:
    base = dict(op="_c10d_functional.all_reduce", reduce_op="sum", tensors=("float32[4]",), args=(), phase="forward")
    base.update(kw)
    return CollectiveSignature(group=group, ranks=ranks, **base)


def test_groups_compare_by_name_when_shared_and_by_rank_pattern_otherwise():
    tp0, tp1, dp0 = _c("tp0", (0, 1)), _c("tp1", (2, 3)), _c("dp0", (0, 2))
    assert same_collective(tp0, tp1, 0, 2)  # rank 0's tp group and rank 2's: same role in a 2x2 mesh
    assert not same_collective(tp0, dp0, 0, 2)  # tp on one rank, dp on the other: a hang
    assert not same_collective(tp0, _c("other", (0, 1)), 0, 1)  # both in {0, 1}, two different groups
    # the issuing line is compared (by file name and line: installs in other directories agree)
    assert not same_collective(tp0, _c("tp0", (0, 1), source="elsewhere.py:3: f(x)"), 0, 1)
    mine, theirs = _c("tp0", (0, 1), source="/a/train.py:3: f(x)"), _c("tp0", (0, 1), source="/b/train.py:3: f(x)")
    assert same_collective(mine, theirs, 0, 1) and mine.site == "train.py:3"
    assert not same_collective(tp0, _c("tp0", (0, 1), phase="backward"), 0, 1)
    assert first_difference([tp0, tp0], [tp0], 0, 1) == 1
    assert first_difference([tp0], [tp0], 0, 1) is None
    assert first_difference([tp0], [_c("tp0", (0, 1), tensors=("float64[4]",))], 0, 1) == 0
    assert CollectiveSignature.from_json(tp0.to_json()) == tp0


def test_hook_checks_forward_and_backward_where_their_context_is_new(world, monkeypatch):
    from dynamo_ext import _compat
    from dynamo_ext.collective_check import stream

    runs: list[list[tuple[str, int]]] = []

    def agree(group_runs, **kwargs):
        runs.append([(c.phase, c.op.split(".")[-1], r.start + i) for r in group_runs for i, c in enumerate(r.records)])
        return {r.group: True for r in group_runs}

    monkeypatch.setattr(stream, "agree", agree)
    monkeypatch.setattr(_compat, "group_is_fake", lambda name: False)  # as if the peers were real
    collective_check.reset()

    def fn(x):
        return dist_nn.all_reduce(x * 2) + funcol.all_gather_tensor(x, 0, dist.group.WORLD)[:4]

    f = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, requires_grad=True)
    for _ in range(4):
        f(x).sum().backward()

    def at(phase, ops, start):
        return [(phase, op, start + i) for i, op in enumerate(ops)]

    forward, backward = ("all_reduce", "all_gather_into_tensor"), ("reduce_scatter_tensor", "all_reduce")
    # (none, forward), (forward, backward), then (backward, forward); every later context was seen.
    # Positions count the compiled collectives run on the group before, checked or not.
    assert runs == [at("forward", forward, 0), at("backward", backward, 2), at("forward", forward, 4)]


def test_fake_groups_and_switched_off_check_meet_no_one(world):
    # On the fake backend there is no peer: the check returns without touching the store.
    collective_check.check_collectives([_c("0", (0, 1, 2, 3))])
    f = torch.compile(lambda x: funcol.all_reduce(x, "sum", dist.group.WORLD), backend="aot_eager")
    torch.testing.assert_close(f(torch.ones(4)), torch.ones(4))
    with config.patch(collective_check=False):
        f = torch.compile(lambda x: funcol.all_reduce(x, "sum", dist.group.WORLD), backend="aot_eager")
        torch.testing.assert_close(f(torch.ones(4)), torch.ones(4))


def test_uninstall_restores_aot_module_simplified():
    from dynamo_ext import _compat

    owner = _compat.aot_backend_module()
    before = owner.aot_module_simplified
    dynamo_ext.install()
    try:
        assert owner.aot_module_simplified is not before
    finally:
        dynamo_ext.uninstall()
    assert owner.aot_module_simplified is before


def test_timeout_env_var_must_be_positive_seconds(monkeypatch):
    monkeypatch.setenv("DYNAMO_EXT_COLLECTIVE_CHECK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DYNAMO_EXT_COLLECTIVE_CHECK_TIMEOUT='soon': expected a positive number"):
        config._seconds_from_env("DYNAMO_EXT_COLLECTIVE_CHECK_TIMEOUT", 300.0)
    monkeypatch.setenv("DYNAMO_EXT_COLLECTIVE_CHECK_TIMEOUT", "12.5")
    assert config._seconds_from_env("DYNAMO_EXT_COLLECTIVE_CHECK_TIMEOUT", 300.0) == 12.5


def test_mismatch_error_is_a_runtime_error():
    assert issubclass(dynamo_ext.CollectiveMismatchError, RuntimeError)
    assert dynamo_ext.CollectiveMismatchError is collective_check.CollectiveMismatchError
