"""A stamped block keeps the aliasing of its recorded call's arguments (NOTE [a stamp keeps its arguments'
aliasing] in ``dynamo_ext/blocks/trace_aliasing.py``), in one process.

Five identical blocks, each called with two tensors that are one tensor (or views of one base, or a tensor the
block also reads another way) at some calls and not at the others: first at call 0 and 3 (the recorded call
aliased, later ones not), then at calls 1, 2 and 4 (the reverse).  Compiled with blocks stamped, forward,
backward and 3 SGD steps equal eager's, and both patterns stay stamped: block 1 is recorded apart from block
0, and each later block is stamped from the recording of its own pattern.  On 4 gloo ranks with FSDP2:
``test_block_stamp_aliasing_gloo.py``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_sgd_steps_match_eager, stamp_logs
from torch import nn

from dynamo_ext.blocks import trace_aliasing, trace_once

WIDTH, HALF, BLOCKS = 8, 4, 5
# the calls whose two tensors alias: the recorded call (block 0) aliased and later ones not, or the reverse
SCHEDULES = {"first_call_aliased": (0, 3), "later_calls_aliased": (1, 2, 4)}
# block 1 is recorded apart (its arguments alias otherwise than block 0's); 2 and 4 have its pattern, 3 block 0's
STAMPED = [
    "L['self'].layers.2 stamped from L['self'].layers.1",
    "L['self'].layers.3 stamped from L['self'].layers.0",
    "L['self'].layers.4 stamped from L['self'].layers.1",
]


class _Pair(nn.Module):
    """A block reading two tensors, which tells them apart as Python can: ``x is r`` (Dynamo folds it to a
    constant) and, with ``bases``, whether they are views of one base."""

    def __init__(self, width: int = WIDTH, *, bases: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(width, WIDTH)
        self.b = nn.Linear(width, WIDTH)
        self.bases = bases

    def combine(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.a(x)) + self.b(r)
        if x is r:
            out = out * 0.5
        if self.bases and x._base is not None:
            out = out - 1.0
            if x._base is r._base:
                out = out * 2.0
        return out


class _Positional(_Pair):
    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.combine(x, r)


class _Keyword(_Pair):
    def forward(self, x: torch.Tensor, *, r: torch.Tensor) -> torch.Tensor:
        return self.combine(x, r)


class _Packed(_Pair):
    """Called with one tuple, list or dict of the two tensors."""

    def forward(self, pair: Any) -> torch.Tensor:
        x, r = (pair["x"], pair["r"]) if isinstance(pair, dict) else pair
        return self.combine(x, r)


def _one_tensor(h: torch.Tensor, aliased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return h, h if aliased else torch.sin(h)


def _views(h: torch.Tensor, aliased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``[rows, HALF]`` views, of one base or of two (the same sizes, strides and offsets either way)."""
    other = h if aliased else torch.sin(h)
    return h[:, :HALF], other[:, HALF:]


def _view_or_not(h: torch.Tensor, aliased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``h``, or a view of all of it (the same sizes and strides), and another tensor."""
    return h.view(h.shape) if aliased else h, torch.sin(h)


class _Stack(nn.Module):
    """``h = layer(...)`` for each block, with the two tensors ``operands(h, aliased)`` passed as ``call``
    passes them."""

    def __init__(self, block: Callable[[], nn.Module], operands: Any, call: Any, aliased: tuple[int, ...]) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList([block() for _ in range(BLOCKS)])
        self.operands, self.call, self.aliased = operands, call, aliased

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            h = self.call(layer, *self.operands(h, i in self.aliased))
        return h


WAYS: dict[str, tuple[Callable[[], nn.Module], Any, Any]] = {
    "positional": (_Positional, _one_tensor, lambda layer, x, r: layer(x, r)),
    "keyword": (_Keyword, _one_tensor, lambda layer, x, r: layer(x, r=r)),
    "tuple": (_Packed, _one_tensor, lambda layer, x, r: layer((x, r))),
    "list": (_Packed, _one_tensor, lambda layer, x, r: layer([x, r])),
    "views_of_one_base": (lambda: _Positional(HALF), _views, lambda layer, x, r: layer(x, r)),
}


def _item(i: int) -> str:
    """Block ``i``'s name in the trace-once log's refusals."""
    return f"L['self']._modules['layers']._modules['{i}']"


def _compare(model: nn.Module, *, backend: str = "aot_eager") -> list[str]:
    """Forward, backward and 3 SGD steps of ``model`` compiled (blocks stamped) against an eager copy; returns
    the stamp lines (``"<block> stamped from <block>"``)."""
    torch.manual_seed(1)
    ref = copy.deepcopy(model)
    inputs = [torch.randn(3, WIDTH) for _ in range(3)]
    with stamp_logs() as stamps:
        assert_sgd_steps_match_eager(torch.compile(model, backend=backend, fullgraph=True), model, ref, inputs)
    return [line.split(" (")[0] for line in stamps]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("way", list(WAYS))
def test_stamps_keep_the_recorded_aliasing(world, way, schedule):
    block, operands, call = WAYS[way]
    torch.manual_seed(0)
    assert _compare(_Stack(block, operands, call, SCHEDULES[schedule])) == STAMPED


@pytest.mark.parametrize("operands", [_views, _view_or_not], ids=["views_of_one_base", "a_view_or_not"])
def test_a_block_reading_a_views_base_is_not_recorded(world, caplog, operands):
    # whether a lone argument is a view is not in the key (NOTE [a stamp keeps its arguments' aliasing]): a block
    # reading ``x._base`` is traced at every call
    torch.manual_seed(0)
    width = HALF if operands is _views else WIDTH
    block = lambda: _Positional(width, bases=True)  # noqa: E731
    model = _Stack(block, operands, WAYS["positional"][2], SCHEDULES["first_call_aliased"])
    with caplog.at_level(logging.DEBUG, logger=trace_once.__name__):
        assert _compare(model) == []
    messages = [r.getMessage() for r in caplog.records]
    assert f"{_item(0)} traced and not recorded: it reads a tensor's _base" in messages, messages


def test_a_dict_argument_is_traced(world, caplog):
    torch.manual_seed(0)
    model = _Stack(_Packed, _one_tensor, lambda layer, x, r: layer({"x": x, "r": r}), SCHEDULES["first_call_aliased"])
    with caplog.at_level(logging.DEBUG, logger=trace_once.__name__):
        assert _compare(model) == []
    assert any("traced: an argument is a" in r.getMessage() for r in caplog.records)


def test_the_log_says_why_a_block_is_recorded_apart(world, caplog):
    torch.manual_seed(0)
    model = _Stack(_Positional, _one_tensor, WAYS["positional"][2], SCHEDULES["first_call_aliased"])
    with caplog.at_level(logging.DEBUG, logger=trace_once.__name__):
        _compare(model)
    messages = [r.getMessage() for r in caplog.records]
    assert (
        f"{_item(1)} recorded apart from L['self'].layers.0: its arguments alias otherwise (no aliasing; there: "
        "arguments 0 and 1 are one tensor)"
    ) in messages, messages


def test_inductor_stamps_keep_the_recorded_aliasing(world):
    torch.manual_seed(0)
    model = _Stack(_Keyword, _one_tensor, WAYS["keyword"][2], SCHEDULES["first_call_aliased"])
    assert _compare(model, backend="inductor") == STAMPED


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_stamp_whose_arguments_alias_otherwise_is_refused(world, caplog, monkeypatch, schedule):
    # the key without the aliasing (as before NOTE [a stamp keeps its arguments' aliasing]): the stamp's own check
    # refuses every block whose arguments alias otherwise than block 0's, and the numbers stay eager's
    monkeypatch.setattr(trace_aliasing, "pattern", lambda output, leaves: ())
    torch.manual_seed(0)
    model = _Stack(_Positional, _one_tensor, WAYS["positional"][2], SCHEDULES[schedule])
    with caplog.at_level(logging.DEBUG, logger=trace_once.__name__):
        stamped = _compare(model)
    refused = [r.getMessage() for r in caplog.records if "aliases another argument otherwise" in r.getMessage()]
    aliased = SCHEDULES[schedule]
    otherwise = [i for i in range(1, BLOCKS) if (i in aliased) != (0 in aliased)]
    assert [line.split(" ")[0] for line in refused] == [_item(i) for i in otherwise], refused
    assert refused[0].startswith(
        f"{_item(otherwise[0])} traced, the recording of L['self'].layers.0 not used: argument 1 aliases another "
        "argument otherwise than in the recorded call"
    ), refused
    assert stamped == ["L['self'].layers.3 stamped from L['self'].layers.0"], stamped


# ---- an argument the block also reaches another way ----------------------------------------------------
GLOBAL = torch.randn(3, WIDTH, requires_grad=True)


class _ReadsGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.a(x)) + 0.5 * GLOBAL
        return out * 0.5 if x is GLOBAL else out


class _State:
    first: torch.Tensor


class _ReadsState(nn.Module):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x)) + 0.5 * self.state.first


class _Reaching(nn.Module):
    """``h = h + layer(h)``, or at the ``aliased`` calls ``layer`` of the tensor the blocks also read: the global
    ``GLOBAL`` (a graph input) or ``state.first`` (set in this forward: a pending mutation holds it)."""

    def __init__(self, how: str, aliased: tuple[int, ...]) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.state = _State()
        blocks = [_ReadsGlobal() if how == "global" else _ReadsState(self.state) for _ in range(BLOCKS)]
        self.layers = nn.ModuleList(blocks)
        self.how, self.aliased = how, aliased

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        self.state.first = other = GLOBAL if self.how == "global" else torch.sin(h)
        for i, layer in enumerate(self.layers):
            h = h + layer(other if i in self.aliased else h)
        return h


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("how", ["global", "held_by_a_pending_mutation"])
def test_an_argument_the_block_reaches_otherwise_keeps_the_recorded_aliasing(world, how, schedule):
    torch.manual_seed(0)
    stamped = _compare(_Reaching(how, SCHEDULES[schedule]))
    if how == "global":
        assert stamped == STAMPED
    else:
        # a block that reads a tensor made before it other than through its arguments is not recorded: only a
        # call passing the state's own tensor is, and a later such call stamped from it
        assert (
            stamped
            == {
                "first_call_aliased": ["L['self'].layers.3 stamped from L['self'].layers.0"],
                "later_calls_aliased": [STAMPED[0], STAMPED[2]],
            }[schedule]
        )
