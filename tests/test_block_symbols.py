"""Blocks whose inputs differ only in their size symbols (NOTE [blocks that differ only in their size symbols]).

The key names symbols by position; a compile is shared across other symbols only when every guard on its own
symbols holds renamed, each then recorded as a guard of the frame.  Against eager on gloo ranks:
``test_block_split_gloo.py::test_torchtitan_style_llama_split_matches_eager[compiled_autograd]`` (each block's
saved RNG state has its own size symbol there).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from dynamo_ext.blocks import split as block_split
from dynamo_ext.blocks.symbols import carry_guards, input_symbols


def _symbolic(mode: FakeTensorMode, rows: int, name: str) -> torch.Tensor:
    from torch._dynamo.source import LocalSource

    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC])
    return mode.from_tensor(torch.zeros(rows, dtype=torch.uint8), source=LocalSource(name), symbolic_context=ctx)


def _identity() -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.call_function(torch.clone, (graph.placeholder("a"),)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_keys_name_symbols_by_position():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    a, b = _symbolic(mode, 5056, "a"), _symbolic(mode, 5056, "b")
    (sa,), (sb,) = input_symbols([a]), input_symbols([b])
    assert sa != sb  # a symbol of its own each, as compiled autograd gives each block's RNG state
    gm = _identity()
    assert block_split.structural_key(gm, [a]) == block_split.structural_key(gm, [b])
    assert block_split.structural_key(gm, [a, b]) != block_split.structural_key(gm, [a, a])  # two symbols, one


def test_guards_on_the_compiled_symbols_must_hold_renamed_and_are_recorded():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    env = mode.shape_env
    a, b, c = _symbolic(mode, 16, "a"), _symbolic(mode, 24, "b"), _symbolic(mode, 20, "c")
    (sa,), (sb,), (sc,) = input_symbols([a]), input_symbols([b]), input_symbols([c])
    assert a.shape[0] % 8 == 0  # a guard on a's symbol, as a compile for `a` may have added
    before = len(env.guards)
    assert carry_guards([b], [sa], [sb])  # 24 % 8 == 0: the guard holds for b's symbol, and now guards it
    assert any(g.expr.free_symbols == {sb} for g in env.guards[before:])
    before = len(env.guards)
    assert not carry_guards([c], [sa], [sc])  # 20 % 8 != 0: c gets a compile of its own
    assert len(env.guards) == before  # and the frame no guard on c's symbol: all checked before any is recorded
