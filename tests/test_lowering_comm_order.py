"""Communication order under our passes and Inductor's: buckets never cross other communication, and graphs with
point-to-point ops or our own communication ops get ordering dependencies Inductor's scheduling passes keep.

Tier 1: hand-built graphs (the plan, the dependencies) and compiles on the fake process group (the generated
code's order, with ``simple_overlap`` on and off where the release has it).  The gloo tests are in
test_lowering_comm_order_gloo.py.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx
from helpers import fake_graph, fake_world
from torch._inductor.utils import run_and_get_code

import dynamo_ext
from dynamo_ext import _compat
from dynamo_ext.fx import collectives as fx_collectives
from dynamo_ext.inductor_lowerings import bucket_op, bucketing, comm_order, options

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
SIMPLE_OVERLAP = [None] if _compat.simple_overlap_enabled() is None else [True, False]


def simple_overlap_patch(enabled: bool) -> dict[str, bool]:
    """An Inductor config patch turning ``simple_overlap`` on or off; ``{}`` where this release has no such pass."""
    if _compat.simple_overlap_enabled() is None:
        return {}
    return {"aten_distributed_optimizations.enable_simple_overlap": enabled}


def _scheduling_passes() -> dict[str, dict[str, Any]]:
    """Inductor config patches: each scheduling pass that may reorder communication, where this release has it.

    Overlap scheduling (``aten_distributed_optimizations.enable_overlap_scheduling``) is left out: on 2.13 it
    estimates costs on a GPU even with the analytical estimator, so it does not compile on this CPU."""
    off = simple_overlap_patch(False)
    out = {"simple_overlap on": simple_overlap_patch(True)} if SIMPLE_OVERLAP != [None] else {}
    out["default passes" + (", simple_overlap off" if off else "")] = off
    out["reorder_for_compute_comm_overlap"] = {"reorder_for_compute_comm_overlap": True, **off}
    return out


@pytest.fixture(autouse=True)
def _default_options():
    saved = options.get_config_copy()
    yield
    options.load_config(saved)


def _reduce(g: torch.fx.Graph, x: torch.fx.Node, group: str = "0") -> torch.fx.Node:
    return g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (x, "sum", group)),))


def _between(kind: str):
    """A graph ``all_reduce(x0); <kind>; all_reduce(x1)`` (``kind`` "" for nothing between)."""

    def build(g: torch.fx.Graph):
        x0, x1, y = g.placeholder("x0"), g.placeholder("x1"), g.placeholder("y")
        outs = [_reduce(g, x0)]
        if kind == "isend":
            outs.append(
                g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.isend.default, (y, 1, 0, "0")),))
            )
        elif kind == "irecv":
            outs.append(
                g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.irecv.default, (y, 1, 0, "0")),))
            )
        elif kind in ("barrier", "constant"):
            token = g.call_function(aten.full.default, ([1], 0.0), {"dtype": torch.float32})
            outs.append(_reduce(g, token))
            if kind == "barrier":  # traced by dist.barrier()'s polyfill
                outs[-1].args[0].meta["stack_trace"] = _BARRIER_TRACE
        elif kind == "other group":
            outs.append(_reduce(g, y, "1"))
        elif kind == "bucket":
            outs.append(g.call_function(bucket_op.bucketed_collective_op(), (y, "all_reduce", [8], "sum", 1, "0")))
        outs.append(_reduce(g, x1))
        g.output(tuple(outs))
        return [((8,), torch.float32)] * 3

    return build


_BARRIER_TRACE = (
    '  File "/home/me/train.py", line 9, in step\n    dist.barrier()\n'
    f'  File "{fx_collectives.BARRIER_POLYFILL[0]}", line 157, in barrier\n    out = _C.all_reduce(token, "sum", name)\n'
)


def _plan(gm: torch.fx.GraphModule) -> list[list[str]]:
    return [[m.collective.args[0].name for m in b] for b in bucketing.plan_buckets(gm.graph)]


@pytest.mark.parametrize("kind", ["isend", "irecv", "barrier", "other group", "bucket"])
def test_communication_between_two_all_reduces_keeps_them_apart(world, kind):
    """NOTE [buckets keep the communication order]: a bucket never moves an all-reduce across another
    communication op; with nothing between, the two merge."""
    assert _plan(fake_graph(_between(""))) == [["x0", "x1"]]
    gm = fake_graph(_between(kind))
    assert _plan(gm) == []
    assert bucketing.bucket_collectives(gm.graph, switchable=True) == 0


def test_a_barrier_is_told_by_where_it_was_traced_not_by_its_input(world):
    """``dist.barrier()``'s all-reduce is no candidate; an all-reduce of a constant the user wrote is one (a pipeline's
    first stage all-reduces a zero loss where the last stage all-reduces its loss: the plans must agree)."""
    gm = fake_graph(_between("barrier"))
    ars = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]
    assert [fx_collectives.is_barrier(n) for n in ars] == [False, True, False]
    assert [bucketing.bucket_key(n) is None for n in ars] == [False, True, False]
    constant = fake_graph(_between("constant"))
    assert not any(fx_collectives.is_barrier(n) for n in constant.graph.nodes)
    assert _plan(constant) == [["x0", "full_default", "x1"]]


def test_the_barrier_polyfill_is_where_the_reader_looks():
    import os

    from dynamo_ext.variables.c10d import rooted

    where = (os.path.abspath(rooted.barrier.__code__.co_filename), rooted.barrier.__name__)
    assert where == fx_collectives.BARRIER_POLYFILL


def _barrier_between(x, y):
    dist.all_reduce(x)
    dist.barrier()
    dist.all_reduce(y)
    return x, y


def test_a_barrier_between_bucketable_all_reduces_stays_between_them(world):
    args = [torch.randn(8), torch.randn(8)]
    with _compat.inductor_config().patch(fx_graph_cache=False):
        out, code = run_and_get_code(torch.compile(_barrier_between, backend="inductor"), *[a.clone() for a in args])
    order = [op for op in _issue_order("\n".join(code)) if op != "wait_tensor"]
    assert order == ["all_reduce_", "all_reduce_", "all_reduce_"]  # x, the barrier, y: no bucket across it
    for o, e in zip(out, _barrier_between(*[a.clone() for a in args])):
        torch.testing.assert_close(o, e)


def test_communication_ops_are_recognised(world):
    gm = fake_graph(_between("bucket"))
    send = fake_graph(_between("isend"))
    kinds = {
        str(n.target): (fx_collectives.is_communication(n), fx_collectives.is_point_to_point(n))
        for g in (gm, send)
        for n in g.graph.nodes
        if n.op == "call_function"
    }
    assert kinds["dynamo_ext.bucketed_collective.default"] == (True, False)
    assert kinds["_c10d_functional.isend.default"] == (True, True)
    assert kinds["_c10d_functional.all_reduce.default"] == (True, False)
    assert kinds["_c10d_functional.wait_tensor.default"] == (False, False)
    registered = {f"{bucket_op.NAMESPACE}::bucketed_collective", "dynamo_ext::one_shot_all_reduce_residual_rms_norm"}
    assert registered == set(fx_collectives.PLUGIN_COMMUNICATION_OPS)


def _ring_rank1(g: torch.fx.Graph):
    """Rank 1 of a ring after bucketing: recv, send, then a bucket of two all-reduces (as the pass leaves it)."""
    a, b, buf = g.placeholder("a"), g.placeholder("b"), g.placeholder("buf")
    recv = g.call_function(c10d.irecv.default, (buf, 0, 0, "0"))
    send = g.call_function(c10d.isend.default, (a, 0, 0, "0"))
    got = g.call_function(c10d.wait_tensor.default, (recv,))
    sent = g.call_function(c10d.wait_tensor.default, (send,))
    c = g.call_function(aten.add.Tensor, (a, g.call_function(aten.sum.default, (got,))))
    packed = g.call_function(aten.cat.default, ([c, b],))
    bucket = g.call_function(bucket_op.bucketed_collective_op(), (packed, "all_reduce", [4, 4], "sum", 1, "0"))
    g.output((bucket, sent))
    return [((4,), torch.float32)] * 3


def test_ordering_dependencies_chain_communication_and_keep_waits_in_place(world):
    gm = fake_graph(_ring_rank1)
    assert comm_order.needs_ordering(gm.graph) == "point-to-point op irecv_default"
    deps = {n.name: [d.name for d in ds] for n, ds in comm_order.ordering_dependencies(gm.graph).items()}
    # the first op on its own input; each op after the one before; the recv's wait after the send it followed
    assert deps == {
        "irecv_default": ["buf"],
        "isend_default": ["irecv_default"],
        "wait_tensor_default": ["isend_default"],
        "bucketed_collective_default": ["isend_default"],
    }


def test_stock_collectives_alone_are_left_to_inductor(world):
    assert comm_order.needs_ordering(fake_graph(_between("other group")).graph) is None
    assert comm_order.needs_ordering(fake_graph(_between("barrier")).graph) is None


def _issue_order(code: str) -> list[str]:
    call = code[code.index("def call") :]
    return re.findall(r"(?:_c10d_functional|dynamo_ext)\.(\w+)\.default\(", call)


def _hoisted(a, b, c):
    """A bucket, then an all-reduce (max: not a member) of an input, which ``simple_overlap`` would hoist above the
    bucket on a rank where the input does not read the bucket's result."""
    x, y = a * 2, b * 3
    dist.all_reduce(x)
    dist.all_reduce(y)
    dist.all_reduce(c, op=dist.ReduceOp.MAX)
    return x, y, c


@pytest.mark.parametrize("passes", list(_scheduling_passes()))
def test_a_collective_stays_after_a_bucket_under_every_scheduling_pass(world, passes, caplog):
    """NOTE [communication order under Inductor's passes]: without the ordering dependencies, 2.15's
    ``simple_overlap`` issues the max all-reduce first on this rank (a rank that reads the bucket's result
    there issues it last: the gloo test shows the wrong numbers)."""
    caplog.set_level(logging.INFO, logger=comm_order.__name__)
    patch = {"fx_graph_cache": False, **_scheduling_passes()[passes]}
    args = [torch.randn(8), torch.randn(8), torch.randn(8)]
    with _compat.inductor_config().patch(patch):
        _, code = run_and_get_code(torch.compile(_hoisted, backend="inductor"), *[a.clone() for a in args])
    order = [op for op in _issue_order("\n".join(code)) if op != "wait_tensor"]
    assert order == ["bucketed_collective", "all_reduce_"]
    [line] = [r.getMessage() for r in caplog.records if r.name == comm_order.__name__]
    assert "communication kept in program order: 1 ordering dependencies" in line
    assert "bucketed_collective" in line


def test_switched_off_by_option(world):
    options.keep_communication_order = False
    gm = fake_graph(_ring_rank1)
    before = str(gm.graph)
    assert comm_order.keep_communication_order(gm.graph) == 0
    assert str(gm.graph) == before


def _ring(a, b, buf):
    rank = dist.get_rank()
    if rank % 2 == 0:
        dist.send(a, dst=rank + 1)
        dist.recv(buf, src=rank + 1)
    else:
        dist.recv(buf, src=rank - 1)
        dist.send(a, dst=rank - 1)
    c = a + buf.sum()
    dist.all_reduce(c)
    dist.all_reduce(b)
    return c, b


@pytest.mark.parametrize("rank", [0, 1])
def test_ring_compiles_with_its_communication_in_program_order(rank):
    """Each rank's generated code issues its sends, receives and the bucket in its program's order."""
    with fake_world(2, rank):
        dynamo_ext.install()
        try:
            with _compat.inductor_config().patch(fx_graph_cache=False):
                args = [torch.randn(4), torch.randn(4), torch.zeros(4)]
                _, code = run_and_get_code(torch.compile(_ring, backend="inductor"), *args)
        finally:
            dynamo_ext.uninstall()
    order = [op for op in _issue_order("\n".join(code)) if op != "wait_tensor"]
    p2p = ["isend", "irecv"] if rank == 0 else ["irecv", "isend"]
    assert order == [*p2p, "bucketed_collective"]


@pytest.mark.parametrize("kind", ["isend", "irecv"])
def test_a_point_to_point_op_between_collectives_changes_the_data_flow(kind):
    """Ranks with a send or receive between two all-reduces plan two buckets where ranks without one plan one, so
    their data flows differ and the collective check merges on none of them (NOTE [buckets only where ranks
    agree]); a send on one rank where another receives keeps the flows equal."""
    from dynamo_ext.collective_check import data_flow

    plain, p2p = data_flow(fake_graph(_between(""))), data_flow(fake_graph(_between(kind)))
    assert plain != p2p
    assert data_flow(fake_graph(_between("isend"))) == data_flow(fake_graph(_between("irecv")))
