"""The one FX collective reader (NOTE [one collective reader]) and the one rank-range formatter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx
from helpers import CountingBackend, fake_graph

from dynamo_ext.fx import collectives as fx_collectives
from dynamo_ext.rank_ranges import format_ranks

c10d = torch.ops._c10d_functional
_USER_STACK = (
    '  File "/site-packages/torch/x.py", line 3, in f\n    inner()\n'
    '  File "/home/me/train.py", line 12, in step\n    out = reduce(x)\n'
)


def _build(g: torch.fx.Graph) -> list:
    x, y = g.placeholder("x"), g.placeholder("y")
    a = g.call_function(c10d.all_reduce.default, (x, "avg", "0"))
    a.meta["stack_trace"] = _USER_STACK
    b = g.call_function(c10d.reduce_scatter_tensor.default, (y, "sum", 4, "0"))
    s = g.call_function(c10d.isend.default, (x, 1, 7, "0"))  # tag 7: the group is still group_name
    relu = g.call_function(torch.ops.aten.relu.default, (x,))
    waits = [g.call_function(c10d.wait_tensor.default, (n,)) for n in (a, b)]
    g.output((*waits, s, relu))
    return [((4, 3), torch.float32), ((8, 2), torch.bfloat16)]


def test_reader_answers_op_group_bytes_waits_and_line(world):
    gm = fake_graph(_build)
    found = list(fx_collectives.iter_collectives(gm))
    assert [(c.op, c.kind, c.group, c.reduce_op, c.point_to_point) for c in found] == [
        ("_c10d_functional.all_reduce", "all_reduce", "0", "avg", False),
        ("_c10d_functional.reduce_scatter_tensor", "reduce_scatter", "0", "sum", False),
        ("_c10d_functional.isend", "p2p", "0", "", True),
    ]
    ar, rs, _ = found
    assert ar.ranks == (0, 1, 2, 3)
    assert (ar.bytes_in, ar.bytes_out) == (4 * 3 * 4, 4 * 3 * 4)
    assert (rs.bytes_in, rs.bytes_out) == (8 * 2 * 2, 2 * 2 * 2)
    assert (fx_collectives.tensor_shape(rs.output), fx_collectives.tensor_dtype(rs.input)) == ([2, 2], "bfloat16")
    assert rs.arguments["group_size"] == 4
    assert [w.target for w in ar.waits] == [c10d.wait_tensor.default] and ar.waits[0].args == (ar.node,)
    assert ar.user_frame == ("/home/me/train.py", 12, "step", "out = reduce(x)")
    assert rs.user_frame is None
    waits = [n for n in gm.graph.nodes if n.target is c10d.wait_tensor.default]
    assert all(fx_collectives.is_wait(w) and not fx_collectives.is_collective(w) for w in waits)
    assert fx_collectives.read(waits[0]) is None
    assert [n.name for n in gm.graph.nodes if fx_collectives.is_collective(n)] == [c.node.name for c in found]


def test_names_read_from_a_graph_equal_those_read_from_its_text(world):
    """The audit reads the graph when one is logged and its text otherwise: both give the same sequence."""
    gm = fake_graph(_build)
    text = gm.print_readable(False)
    assert fx_collectives.collective_names(gm) == ["all_reduce", "reduce_scatter_tensor", "isend"]
    assert fx_collectives.names_in_text(text) == fx_collectives.collective_names(gm)

    backend = CountingBackend()

    def step(x):
        y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
        return funcol.all_gather_single(y + 1, 0, dist.group.WORLD)

    torch.compile(step, backend=backend, fullgraph=True)(torch.ones(4))
    (dynamo_gm,) = backend.graphs
    names = fx_collectives.collective_names(dynamo_gm)
    assert names == ["all_reduce", "all_gather_into_tensor"]
    assert fx_collectives.names_in_text(dynamo_gm.print_readable(False)) == names


def test_collectives_inside_higher_order_op_subgraphs_are_read_where_called(world):
    def build(g):
        x = g.placeholder("x")
        g.output(
            g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (x, "sum", "0")),))
        )
        return [((2,), torch.float32)]

    wrap = getattr(torch.ops.higher_order, "wrap", None)
    if wrap is None:
        pytest.skip("no torch.ops.higher_order.wrap in this torch")
    root = torch.nn.Module()
    root.body = fake_graph(build)
    g = torch.fx.Graph()
    g.output(g.call_function(wrap, (g.get_attr("body"), g.placeholder("x"))))
    outer = torch.fx.GraphModule(root, g)
    assert list(fx_collectives.iter_collectives(outer)) == []
    assert [c.op for c in fx_collectives.iter_collectives(outer, into_subgraphs=True)] == [
        "_c10d_functional.all_reduce"
    ]


@pytest.mark.parametrize(
    "ranks, text",
    [
        ((0, 1, 2, 3), "0\u20133"),
        ((2, 0), "0, 2"),
        ((0, 1), "0, 1"),
        ((), "-"),
        ((5, 0, 1, 2, 2), "0\u20132, 5"),
    ],
)
def test_one_rank_range_format(ranks, text):
    assert format_ranks(ranks) == text


def test_the_audit_and_the_collective_check_format_ranks_alike():
    from dynamo_ext.audit.gate import diff
    from dynamo_ext.audit.model import ranges
    from dynamo_ext.collective_check import exchange, fingerprint

    for module in (ranges, diff, exchange, fingerprint):
        assert module.format_ranks is format_ranks, module.__name__
