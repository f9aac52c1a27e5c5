"""Grad mode and autocast regions in a graph cut at its blocks (NOTE [grad mode and autocast across cuts]).

transformers' Llama computes its rotary embedding under ``torch.no_grad()`` with autocast off between the part
before the blocks (FSDP2's root all-gather) and the first layer; the split moves values made before the blocks
and read only after them to their reader (NOTE [values that would cross a cut]), which put submodules out of
graph order, and ``split_module`` refused the graph with an ``AssertionError`` ("autocast or set_grad_enabled
require monotonically increasing partitions"): every compile failed.  Single process, ``aot_eager``; gradients
against eager.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from dynamo_ext.blocks import split as block_split


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * rope + h


class Net(torch.nn.Module):
    """``scale`` is made before the blocks and read only after them; ``where`` says where: before a ``no_grad`` and
    autocast-off region (as transformers' Llama), inside it, or with the whole forward under autocast."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.out_scale = torch.nn.Parameter(torch.randn(8))
        self.freq = torch.nn.Parameter(torch.randn(8), requires_grad=False)
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))

    def rope(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        scale = self.out_scale.exp() if self.where == "before_no_grad" else None
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            if self.where == "in_no_grad":
                scale = self.out_scale.exp()
            rope = torch.cos(self.freq * 2.0)
        return rope, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "autocast_around":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                scale = self.out_scale.exp()
                h = x
                for layer in self.layers:
                    h = layer(h, self.freq)
                return (h * scale).float()
        rope, scale = self.rope()
        h = x
        for layer in self.layers:
            h = layer(h, rope)
        return h * scale


def _grads(net: Net) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in net.parameters()]


def _check_against_eager(net: Net) -> list[torch.fx.GraphModule]:
    """Eager, then the compiled step (``aot_eager``, the split on by default): loss and gradients equal; the graphs
    Dynamo handed the backend."""
    x = torch.randn(4, 8)
    eager = net(x)
    eager.sum().backward()
    expected = _grads(net)
    net.zero_grad(set_to_none=True)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    out = torch.compile(net, backend=backend, fullgraph=True)(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    for got, want in zip(_grads(net), expected, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want)
    return graphs


def _exp_partition(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """The submodule of ``scale``'s ``exp`` and the last submodule."""
    partition = block_split.block_partition(gm)
    assert partition is not None
    (exp,) = [n for n in gm.graph.nodes if n.target in ("exp", torch.exp)]
    return partition[exp], max(partition.values())


@pytest.mark.parametrize("where", ["before_no_grad", "autocast_around"])
def test_a_region_that_spans_the_cuts_is_carried_into_each_submodule(plugin, caplog, where):
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger=block_split.__name__):
        (gm,) = _check_against_eager(Net(where))
    assert "5 submodules, 4 compiled" in caplog.text, caplog.text  # cut, the last two blocks sharing a compile
    assert "compiled whole" not in caplog.text
    part, last = _exp_partition(gm)
    assert part == last  # moved to its reader after the blocks, as without the region


def test_a_node_made_under_no_grad_stays_under_no_grad(plugin, caplog):
    """Moved after the blocks, ``exp`` would run with grad enabled: ``out_scale`` would get a gradient eager does
    not give it."""
    torch.manual_seed(0)
    net = Net("in_no_grad")
    with caplog.at_level(logging.INFO, logger=block_split.__name__):
        (gm,) = _check_against_eager(net)
    assert net.out_scale.grad is None
    assert "5 submodules" in caplog.text
    assert _exp_partition(gm)[0] == 0  # not moved


def test_a_graph_split_module_cannot_cut_is_compiled_whole(plugin, caplog):
    """``compile_blocks`` hands back None, logged with ``split_module``'s reason, where the cut fails (here a
    partition whose submodules read each other's values, a cycle); the backend entry then compiles it whole."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.sin, (x,))
    b = graph.call_function(torch.cos, (a,))
    c = graph.call_function(torch.add, (b, a))
    graph.output(c)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    partition = {n: 0 for n in graph.nodes}
    partition[b] = 1  # 0 -> 1 -> 0
    with caplog.at_level(logging.WARNING, logger=block_split.__name__):
        assert block_split.compile_blocks(gm, partition, [torch.randn(3)], lambda g, i: g.forward) is None
    assert "cannot be cut at its blocks (RuntimeError: cycle exists between partitions!); compiled whole" in caplog.text
