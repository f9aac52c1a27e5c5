"""Identical blocks traced once by Dynamo and stamped (NOTE [blocks traced once]), in one process.

A stamped block must leave what tracing it leaves: the same Dynamo graph (node names aside), the same
AOTAutograd forward and backward graphs with the same module stacks and stack traces, and guards that
recompile on what a traced block's guards recompile on.  Numerics against eager FSDP2 and FSDP over TP on gloo
ranks: ``test_block_split_gloo.py`` and ``test_fsdp_training_gloo.py`` (on by default; they assert blocks were
stamped).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from fsdp_training import batch, build
from helpers import AotGraphs, graphs_seen_by, module_paths
from torch import nn

import dynamo_ext
import dynamo_ext._compat as compat
from dynamo_ext.blocks import trace_guards, trace_once


def _step(model: nn.Module, x: torch.Tensor, *, once: bool) -> AotGraphs:
    torch._dynamo.reset()
    graphs = AotGraphs()
    with dynamo_ext.config.patch(trace_blocks_once=once, compile_blocks_once=False):
        out = torch.compile(model, backend=graphs, fullgraph=True)(x)
        out.float().sum().backward()
    return graphs


def _by_position(gm: torch.fx.GraphModule) -> str:
    """``gm``'s code with every node named by its position: what tracing and stamping must agree on."""
    names = {n.name: f"n{i}" for i, n in enumerate(gm.graph.nodes)}
    return re.sub(r"\b[A-Za-z_]\w*\b", lambda m: names.get(m.group(0), m.group(0)), gm.code)


def _node_facts(gm: torch.fx.GraphModule) -> list[tuple[Any, ...]]:
    """Each node's blocks and fake value: metadata, the graph input whose storage it shares, if any, and for a
    value read outside the block that made it (a block's result, an argument it mutates) its version."""
    inputs: dict[Any, int] = {}
    facts = []
    for i, n in enumerate(gm.graph.nodes):
        v = n.meta.get("example_value")
        value = None
        if isinstance(v, torch.Tensor):
            storage = compat.storage_of(v)
            if n.op == "placeholder":
                inputs.setdefault(storage, i)
            crossing = any(module_paths(u)[:1] != module_paths(n)[:1] for u in n.users)
            meta = (type(v), tuple(v.shape), v.stride(), v.dtype, v.requires_grad)
            value = (*meta, inputs.get(storage), v._version if crossing else None)
        facts.append((module_paths(n), value))
    return facts


def _stamped(lines: list[str]) -> list[str]:
    return [line for line in lines if " stamped from " in line]


def _assert_same_as_traced(model: nn.Module, x: torch.Tensor, caplog: Any) -> list[str]:
    """Compile ``model``'s step with every block traced and with blocks stamped; assert the graphs agree;
    return the stamping log lines."""
    traced = _step(model, x, once=False)
    with caplog.at_level(logging.DEBUG, logger=trace_once.__name__):
        stamped = _step(model, x, once=True)
    assert len(traced.dynamo) == len(stamped.dynamo) == 1
    assert _by_position(stamped.dynamo[0]) == _by_position(traced.dynamo[0])
    assert _node_facts(stamped.dynamo[0]) == _node_facts(traced.dynamo[0])
    assert stamped.codes == traced.codes  # AOTAutograd's forward and backward, node for node
    assert stamped.contexts == traced.contexts  # with each node's block and user stack
    return [r.getMessage() for r in caplog.records if r.name == trace_once.__name__]


def test_stamped_fsdp_over_tp_llama_gives_the_traced_graphs(world, caplog):
    from torch.distributed.device_mesh import init_device_mesh

    from dynamo_ext.audit.targets import example_llama as ex

    cfg = ex.Config(n_layers=3)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = ex.parallelize(ex.Decoder(cfg), mesh)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    lines = _assert_same_as_traced(model, tokens, caplog)
    stamped = _stamped(lines)
    assert len(stamped) == 2, lines
    assert stamped[0].startswith("L['fn'].layers.1 stamped from L['fn'].layers.0"), stamped


@pytest.mark.parametrize("tp", [False, True], ids=["fsdp2", "fsdp_over_tp_a_mesh_per_block"])
def test_fsdp2_blocks_are_stamped_and_a_block_that_differs_is_traced(world, caplog, tp):
    # the fourth block is wider: other shapes, other guards.  With TP each block's hooks hold a mesh object of
    # their own (``mesh2d["tp"]`` per block), equal to the others.
    net = build(4, inners=(6, 6, 6, 8), tp=tp)
    lines = _assert_same_as_traced(net, batch(0, 0, tp=tp), caplog)
    assert len(_stamped(lines)) == 2, lines
    refused = [line for line in lines if "blocks.3" in line or "['3']" in line]
    assert refused and "traced, the recording of" in refused[0] and "differs from the recorded block's" in refused[0]


def test_switch_off_traces_every_block(world, caplog):
    net = build(4, inners=(6, 6, 6))
    with caplog.at_level(logging.DEBUG, logger=trace_once.__name__):
        _step(net, batch(0, 0), once=False)
    assert not [r for r in caplog.records if r.name == trace_once.__name__]


class _Counting:
    """A backend counting Dynamo's compiles."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.compiles += 1
        return gm


class _Block(nn.Module):
    def __init__(self, width: int, scale: float = 1.0) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _compiles_after_each_change(net: _Stack, x: torch.Tensor, *, once: bool) -> list[int]:
    """Compile counts after a series of changes to blocks after the first, each undone after the next call."""
    torch._dynamo.reset()
    backend = _Counting()
    counts = []
    with dynamo_ext.config.patch(trace_blocks_once=once):
        compiled = torch.compile(net, backend=backend)
        compiled(x)
        compiled(x)
        counts.append(backend.compiles)
        net.layers[2].scale = 2.0  # a Python attribute its forward reads (block 0's trace guarded its own)
        compiled(x)
        counts.append(backend.compiles)
        net.layers[2].scale = 1.0
        compiled(x)  # the first compile's guards hold again
        counts.append(backend.compiles)
        old = net.layers[1].up.bias
        net.layers[1].up.bias = nn.Parameter(old.detach().clone(), requires_grad=False)  # another tensor kind
        compiled(x)
        counts.append(backend.compiles)
        net.layers[1].up.bias = old
        handle = net.layers[3].register_forward_pre_hook(lambda m, args: None)
        compiled(x)
        counts.append(backend.compiles)
        handle.remove()
    return counts


def test_a_stamped_block_recompiles_where_a_traced_block_does(world):
    torch.manual_seed(0)
    net = _Stack([_Block(8) for _ in range(4)])
    x = torch.randn(3, 8)
    traced = _compiles_after_each_change(net, x, once=False)
    stamped = _compiles_after_each_change(net, x, once=True)
    assert stamped == traced
    assert traced[:4] == [1, 2, 2, 3], traced


def _eager_and_compiled(model: nn.Module, x: torch.Tensor, caplog: Any) -> list[str]:
    """Loss and gradients of ``model`` compiled (blocks stamped) equal eager's; returns the stamping log."""
    torch._dynamo.reset()
    expected = model(x).square().sum()
    expected.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with caplog.at_level(logging.DEBUG, logger=trace_once.__name__):
        loss = torch.compile(model, backend="aot_eager")(x).square().sum()
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for got, w in zip([p.grad for p in model.parameters()], want):
        torch.testing.assert_close(got, w)
    return [r.getMessage() for r in caplog.records if r.name == trace_once.__name__]


def test_plain_blocks_are_stamped_and_match_eager(world, caplog):
    torch.manual_seed(0)
    lines = _eager_and_compiled(_Stack([_Block(8) for _ in range(4)]), torch.randn(3, 8), caplog)
    # block 0 reads the input, which needs no gradient, the others an activation that does: block 1 is the
    # recording the last two are stamped from
    assert _stamped(lines) == [
        "L['self'].layers.2 stamped from L['self'].layers.1 (5 nodes, 29 guards carried over)",
        "L['self'].layers.3 stamped from L['self'].layers.1 (5 nodes, 29 guards carried over)",
    ], lines


def test_a_block_with_another_constant_is_traced(world, caplog):
    torch.manual_seed(0)
    blocks = [_Block(8), _Block(8), _Block(8, scale=0.5), _Block(8)]
    lines = _eager_and_compiled(_Stack(blocks), torch.randn(3, 8), caplog)
    assert any("['2'] traced, the recording of" in line and ".scale" in line for line in lines), lines
    assert [line.split(" ")[0] for line in _stamped(lines)] == ["L['self'].layers.3"], lines


class _IntBlock(_Block):
    """A block reading an int attribute: Dynamo specializes a module's int (its guard carries a recompile hint)."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.n = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.n


def test_a_block_reading_an_int_attribute_is_stamped_and_recompiles_as_traced(world, caplog):
    torch.manual_seed(0)
    net = _Stack([_IntBlock(8) for _ in range(4)])
    x = torch.randn(3, 8)
    assert len(_stamped(_eager_and_compiled(net, x, caplog))) == 2

    def compiles(once: bool) -> list[int]:
        torch._dynamo.reset()
        backend = _Counting()
        counts = []
        with dynamo_ext.config.patch(trace_blocks_once=once):
            compiled = torch.compile(net, backend=backend)
            for n in (2, 3, 4, 2):
                net.layers[2].n = n
                torch.testing.assert_close(compiled(x), net(x))
                counts.append(backend.compiles)
        return counts

    assert compiles(once=True) == compiles(once=False) == [1, 2, 3, 3]


class _InPlaceBlock(_Block):
    """A block mutating its argument in place and returning a view of an activation it made."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        h = self.up(x)
        h[:, :2] = 0.0  # in place on an activation of its own
        return (x + self.down(torch.relu(h))).t().t()


class _InPlaceStack(_Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * 1.0)  # the caller's tensor is not mutated


def test_blocks_mutating_their_argument_are_stamped_as_traced(world, caplog):
    # a stamp reuses the recorded fake values of what a block makes and dies in it, and runs again what shares
    # storage with its argument or its result (NOTE [fake values a stamp reuses])
    torch.manual_seed(0)
    model = _InPlaceStack([_InPlaceBlock(8) for _ in range(4)])
    lines = _eager_and_compiled(model, torch.randn(3, 8), caplog)
    assert len(_stamped(lines)) == 2, lines
    caplog.clear()
    lines = _assert_same_as_traced(model, torch.randn(3, 8), caplog)
    assert len(_stamped(lines)) == 2, lines


class _CountingBlock(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1  # state the call leaves behind
        return super().forward(x)


def test_a_block_that_leaves_a_mutation_is_traced_every_time(world, caplog):
    torch.manual_seed(0)
    model = _Stack([_CountingBlock(8) for _ in range(3)])
    lines = _eager_and_compiled(model, torch.randn(3, 8), caplog)
    assert not _stamped(lines), lines
    assert any("leaves" in line and "mutated" in line for line in lines), lines
    assert [b.calls for b in model.layers] == [2, 2, 2]  # eager's call and the compiled one


class _Rescaled(_Stack):
    """Sets block ``index``'s ``scale`` before calling the blocks: a pending mutation of that block."""

    def __init__(self, blocks: list[nn.Module], index: int) -> None:
        super().__init__(blocks)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.layers[self.index].scale = 3.0
        return super().forward(x)


def test_a_block_with_a_pending_mutation_is_traced(world, caplog):
    torch.manual_seed(0)
    model = _Rescaled([_Block(8) for _ in range(3)], index=2)
    lines = _eager_and_compiled(model, torch.randn(3, 8), caplog)
    assert any("['2'] traced, the recording of" in line and "pending mutations" in line for line in lines), lines


def test_a_block_traced_with_a_pending_mutation_is_not_stamped_from(world, caplog):
    # block 1's trace reads its pending scale, with no guard on it
    torch.manual_seed(0)
    model = _Rescaled([_Block(8) for _ in range(4)], index=1)
    lines = _eager_and_compiled(model, torch.randn(3, 8), caplog)
    assert any("['1'] traced and not recorded" in line and "pending mutations" in line for line in lines), lines
    # block 2 is recorded instead, block 3 stamped from it: scale 1.0, as eager (checked above)
    assert [line.split(" (")[0] for line in _stamped(lines)] == ["L['self'].layers.3 stamped from L['self'].layers.2"]


def test_hook_keys_are_matched_module_by_module():
    a, b = _Block(4), _Block(4)
    a.up.register_forward_hook(lambda *args: None)
    with pytest.raises(trace_guards.StampError, match="module up has 0 _forward_hooks, the recorded block 1"):
        trace_guards.hook_key_map(a, b)
    b.up.register_forward_hook(lambda *args: None)
    keys = trace_guards.hook_key_map(a, b)
    assert keys == {next(iter(a.up._forward_hooks)): next(iter(b.up._forward_hooks))}


def test_renaming_stops_at_a_path_step():
    assert trace_guards.mentions("L['m'].layers.1.up", "L['m'].layers.1")
    assert not trace_guards.mentions("L['m'].layers.10.up", "L['m'].layers.1")
    assert trace_guards.mentions("list(dict.keys(L['m'].layers.1))[0]", "L['m'].layers.1")


class _RotaryBlock(_Block):
    """A block called as transformers' decoder layers are: keyword arguments, a tuple of tensors, a None."""

    def forward(
        self, x: torch.Tensor, *, position: tuple[torch.Tensor, torch.Tensor], mask: Any = None
    ) -> torch.Tensor:
        cos, sin = position
        return super().forward(x * cos + x.flip(-1) * sin)


class _RotaryStack(_Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[-1], dtype=x.dtype) / x.shape[-1]
        position = (angles.cos(), angles.sin())
        for layer in self.layers:
            x = layer(x, position=position, mask=None)
        return x


def test_blocks_called_with_keyword_and_tuple_arguments_are_stamped(world, caplog):
    torch.manual_seed(0)
    lines = _eager_and_compiled(_RotaryStack([_RotaryBlock(8) for _ in range(4)]), torch.randn(3, 8), caplog)
    assert [line.split(" ")[0] for line in _stamped(lines)] == ["L['self'].layers.2", "L['self'].layers.3"], lines


def test_uninstall_restores_what_stamping_patches():
    from torch._dynamo.side_effects import SideEffects
    from torch._dynamo.variables import UnspecializedNNModuleVariable, builder

    def entries() -> tuple[Any, ...]:
        return (
            UnspecializedNNModuleVariable.call_function,
            SideEffects.store_attr,
            SideEffects.mutation,
            builder.make_dupe_guard,
        )

    before = entries()
    dynamo_ext.install()
    try:
        assert all(now is not then for now, then in zip(entries(), before))
    finally:
        dynamo_ext.uninstall()
    assert entries() == before


def test_a_frames_recordings_go_with_its_graph(monkeypatch):
    """The recordings of a frame's blocks do not keep its graph alive (NOTE [recordings live on the graph])."""
    import gc

    graphs = graphs_seen_by(monkeypatch, trace_once, "_frame_recordings")
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    dynamo_ext.install()
    try:
        with dynamo_ext.config.patch(trace_blocks_once=True, compile_blocks_once=False):
            torch.compile(model, backend="eager", fullgraph=True)(torch.randn(2, 8))
    finally:
        dynamo_ext.uninstall()
    assert graphs, "no block call went through the stamping path"
    torch._dynamo.reset()
    gc.collect()
    assert [r() for r in graphs] == [None]
