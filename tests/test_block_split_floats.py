"""A float Dynamo makes dynamic stays dynamic when the graph is cut at its blocks (NOTE [dynamic floats in the
block split]) and when blocks are stamped (NOTE [a stamp keeps Dynamo's automatic dynamic]).

A float read in every block that changes each step (a module-level scale, a block's attribute, a float argument)
makes stock Dynamo recompile once and then treat the float as an input (automatic dynamic); an int attribute too
with ``allow_unspec_int_on_nn_module``.  The plugin, whose backend entry cuts that graph at its blocks and whose
trace stamps blocks 1.. from block 0's, must compile as many graphs as stock for the same program and give
eager's values; before the fixes, the split pinned each value (a guard ``G['GAIN'] == 2.0``): 7 graphs in 6
steps, and a stamped block's changed attribute was pinned again by the recompile (3 graphs where stock has 2).
"""

from __future__ import annotations

import contextlib
import logging
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import dynamo_ext
from dynamo_ext.blocks import split as block_split
from dynamo_ext.blocks import trace_once

GAIN = 1.0
STEPS = 6


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = 1.0
        self.n = 1

    def forward(self, h: torch.Tensor, s: float) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * GAIN * self.scale * s * self.n + h


class Net(torch.nn.Module):
    """A part before the blocks, three identical blocks, a part after them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, s: float) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, s)
        return self.out(h)


def _set(net: Net, changing: str, step: int, monkeypatch: pytest.MonkeyPatch) -> float:
    """Change ``changing`` for ``step``; the scalar argument of the call."""
    value = 1.0 + 0.5 * step
    if changing == "global":
        monkeypatch.setattr(sys.modules[__name__], "GAIN", value)
    elif changing == "attribute":
        for layer in net.layers:
            layer.scale = value
    elif changing == "one block's attribute":
        net.layers[1].scale = value
    elif changing == "int attribute":
        for layer in net.layers:
            layer.n = 1 + step
    return {"argument": value, "int argument": 2 + step}.get(changing, 0.5)


def _config(changing: str) -> contextlib.AbstractContextManager:
    # Dynamo specializes a module's int attributes unless told otherwise: then each value is a recompile, in
    # stock as with the plugin; with this it makes a changed one dynamic, as a float.
    return torch._dynamo.config.patch(allow_unspec_int_on_nn_module=changing == "int attribute")


def _steps(changing: str, monkeypatch: pytest.MonkeyPatch, *, plugin: bool) -> tuple[int, int, list[torch.Tensor]]:
    """Run ``STEPS`` compiled steps (forward and backward) with ``changing`` changed each step: Dynamo's graphs,
    its unique graphs, and each step's output and gradients, checked against eager on the way."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 8)
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(net, backend=backend)
    if plugin:
        dynamo_ext.install()
    try:
        values = []
        for step in range(STEPS):
            s = _set(net, changing, step, monkeypatch)
            net.zero_grad()
            eager = net(x, s)
            eager.square().sum().backward()
            expected = [eager.detach(), *(p.grad.clone() for p in net.parameters())]
            net.zero_grad()
            out = compiled(x, s)
            out.square().sum().backward()
            got = [out.detach(), *(p.grad.clone() for p in net.parameters())]
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            values += got
    finally:
        if plugin:
            dynamo_ext.uninstall()
    return backend.frame_count, counters["stats"]["unique_graphs"], values


@pytest.mark.parametrize("trace_blocks_once", [False, True], ids=["traced", "stamped"])
@pytest.mark.parametrize(
    "changing", ["global", "attribute", "one block's attribute", "int attribute", "argument", "int argument"]
)
@pytest.mark.parametrize("compile_blocks_once", [False, True], ids=["whole", "split"])
def test_a_changing_scalar_compiles_as_often_as_stock(
    monkeypatch, caplog, changing, trace_blocks_once, compile_blocks_once
):
    """``trace_blocks_once`` off: every block traced; on (the default): blocks 1.. stamped from block 0's trace
    (checked), whose automatic-dynamic record must then hold block ``i``'s values as a trace of it would.
    ``compile_blocks_once`` on (the default): the graph cut at its blocks (checked)."""
    with _config(changing):
        stock_graphs, stock_unique, stock_values = _steps(changing, monkeypatch, plugin=False)
    assert stock_graphs < STEPS, "the scalar must go dynamic in stock for this test to mean anything"
    with (
        _config(changing),
        dynamo_ext.config.patch(trace_blocks_once=trace_blocks_once, compile_blocks_once=compile_blocks_once),
        caplog.at_level(logging.INFO, logger=block_split.__name__),
        caplog.at_level(logging.DEBUG, logger=trace_once.__name__),
    ):
        graphs, unique, values = _steps(changing, monkeypatch, plugin=True)
    split = "5 submodules, 3 compiled, 2 running an identical block's compile" in caplog.text
    assert split == compile_blocks_once
    assert (" stamped from L['self'].layers." in caplog.text) == trace_blocks_once
    assert (graphs, unique) == (stock_graphs, stock_unique)
    for a, b in zip(values, stock_values, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class PinnedBlock(torch.nn.Module):
    """A block reading its float twice: as a tensor op (made a tensor op on the float's input) and as the fill value
    of ``full_like`` (no tensor form: the tensorify pass pins the float while compiling, with a guard)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * self.scale + torch.full_like(h, self.scale * 2)


def _pinned_steps(*, plugin: bool, shared: bool = False) -> tuple[int, list[torch.Tensor]]:
    """Three compiled steps with the blocks' floats changed each step: each block its own value, or (``shared``)
    one value for all; Dynamo's graphs (restarts included) and the outputs, checked against eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(PinnedBlock() for _ in range(3)))
    x = torch.randn(4, 8)
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(net, backend=backend)
    if plugin:
        dynamo_ext.install()
    try:
        outs = []
        for step in range(3):
            for i, block in enumerate(net):
                block.scale = 1.0 + step + (0.0 if shared else 0.25 * i)
            out = compiled(x)
            torch.testing.assert_close(out, net(x))
            outs.append(out)
    finally:
        if plugin:
            dynamo_ext.uninstall()
    return backend.frame_count, outs


def test_a_compile_that_pinned_its_float_is_not_shared(caplog):
    """Blocks 1 and 2 are identical but for their float, which the tensorify pass pins: torch 2.13 while compiling
    (a guard added; block 2 must not run block 1's compile, it would compute with block 1's value), 2.15 by
    restarting Dynamo (the blocks' floats pinned in one restart, as stock: the backend counts the restart too)."""
    stock_graphs, _ = _pinned_steps(plugin=False)
    with (
        dynamo_ext.config.patch(trace_blocks_once=False),
        caplog.at_level(logging.INFO, logger="dynamo_ext.blocks"),
    ):
        graphs, _ = _pinned_steps(plugin=True)
    assert graphs == stock_graphs
    assert "3 submodules, 3 compiled, 0 running" in caplog.text


def test_a_pinned_float_of_stamped_blocks_compiles_as_often_as_stock():
    """Blocks stamped from block 0's trace (the default), their float the same in every block and changed each
    step.  2.15's tensorify pass pins it by restarting Dynamo and keeps the pinned floats' symbols for the next
    compile, where each block's float must be made dynamic under the same translator as a trace makes it (the
    frame's root: it records them per code), or the next step restarts once more (before: 6 graphs where stock
    has 5)."""
    stock_graphs, _ = _pinned_steps(plugin=False, shared=True)
    graphs, _ = _pinned_steps(plugin=True, shared=True)
    assert graphs == stock_graphs
