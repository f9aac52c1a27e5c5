"""Identical blocks compiled once (NOTE [blocks compiled once]) on the fake process group.

What the split decides and what the backend sees: one Dynamo graph handed to the backend, one AOTAutograd
compile per distinct block.  Numerics against eager FSDP2 (and FSDP over TP) on gloo ranks:
``test_block_split_gloo.py``, and every gloo test that compiles with ``aot_eager`` or ``inductor`` (the split is
on by default).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from fsdp_training import batch, build
from helpers import CountingBackend

from dynamo_ext.blocks import split as block_split
from dynamo_ext.fx.nodes import container_item


def _aot_compiles() -> int:
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["total"]


def _compile_step(model: torch.nn.Module, x: torch.Tensor, backend: str = "aot_eager") -> tuple[CountingBackend, int]:
    from torch._dynamo.utils import counters

    counters.clear()
    counting = CountingBackend(backend)
    out = torch.compile(model, backend=counting, fullgraph=True)(x)
    out.float().sum().backward()
    return counting, _aot_compiles()


@pytest.mark.parametrize("blocks", [3, 6])
def test_identical_blocks_are_compiled_once_whatever_the_depth(world, caplog, blocks):
    net = build(4, inners=(6,) * blocks)
    with caplog.at_level(logging.INFO, logger=block_split.__name__):
        counting, aot = _compile_step(net, batch(0, 0))
    # Dynamo's one graph reaches the backend once; AOTAutograd compiles the part before the blocks, one block
    # and the part after them (the first call of a counting backend is the frame, not the blocks).
    assert len(counting.graphs) == 1
    assert aot == 3, aot
    assert f"{blocks + 2} submodules, 3 compiled, {blocks - 1} running an identical block's compile" in caplog.text


def test_switch_off_compiles_the_graph_whole(world):
    import dynamo_ext

    net = build(4, inners=(6, 6, 6))
    with dynamo_ext.config.patch(compile_blocks_once=False):
        counting, aot = _compile_step(net, batch(0, 0))
    assert len(counting.graphs) == 1 and aot == 1


def test_a_block_that_differs_gets_its_own_compile(world, caplog):
    net = build(4, inners=(6, 6, 8, 6))  # block 2 is wider: its own compile; blocks 1 and 3 run block 0's
    with caplog.at_level(logging.INFO, logger=block_split.__name__):
        _, aot = _compile_step(net, batch(0, 0))
    assert aot == 4, aot
    assert "6 submodules, 4 compiled, 2 running an identical block's compile" in caplog.text


def test_a_graph_without_repeated_blocks_is_not_split(world):
    net = build(4, inners=(6,))
    _, aot = _compile_step(net, batch(0, 0))
    assert aot == 1


def test_partition_cuts_at_each_block_and_is_the_same_for_other_shapes(world):
    graphs = []

    def keep(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    for hidden in (10, 14):  # another width: other shapes, the same ops, so the same cuts
        torch._dynamo.reset()
        net = build(4, inners=(6, 6, 6), hidden=hidden)
        torch.compile(net, backend=keep, fullgraph=True)(batch(0, 0, hidden=hidden))
    cuts = []
    for gm in graphs:
        partition = block_split.block_partition(gm)
        assert partition is not None
        parts = [partition[n] for n in gm.graph.nodes]
        assert set(parts) == {0, 1, 2, 3, 4}
        # NOTE [values that would cross a cut]: the root's gather of the output projection's weight moved
        # from before the blocks to its reader after them; nothing else left its place
        first_block = parts.index(1)
        moved = [n for n in list(gm.graph.nodes)[:first_block] if partition[n] != 0]
        assert moved and all(partition[n] == 4 for n in moved)
        assert all(partition[u] == 4 for n in moved for u in n.users)
        assert any("tag_activation_checkpoint" in str(n.target) for n in moved)  # FSDP2's gather
        # every node of block i (by its module stack) is in submodule i + 1
        for n in gm.graph.nodes:
            item = container_item(n) if n.op.startswith("call") else None
            if item is not None and item[1].endswith("blocks"):
                assert partition[n] == item[2] + 1, (n, item)
        cuts.append(parts)
    assert cuts[0] == cuts[1]


def test_structural_key_tells_shapes_dtypes_placements_and_aliasing_apart():
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output(graph.call_function(torch.add, (a, b)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    key = block_split.structural_key(gm, [x, y])
    assert key == block_split.structural_key(gm, [torch.randn(2, 3), torch.randn(2, 3)])
    assert key != block_split.structural_key(gm, [x, torch.randn(3, 2)])  # shape
    assert key != block_split.structural_key(gm, [x, y.double()])  # dtype
    assert key != block_split.structural_key(gm, [x, y.t().contiguous().t()])  # stride
    assert key != block_split.structural_key(gm, [x, y.requires_grad_()])  # requires_grad
    assert key != block_split.structural_key(gm, [x, x])  # the same tensor twice: aliasing differs
    other = torch.fx.Graph()
    a, b = other.placeholder("a"), other.placeholder("b")
    other.output(other.call_function(torch.sub, (a, b)))
    assert key != block_split.structural_key(torch.fx.GraphModule(torch.nn.Module(), other), [x, y])  # target


def test_structural_key_tells_dtensor_placements_apart(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (4,))
    graph = torch.fx.Graph()
    graph.output(graph.placeholder("a"))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    t = torch.randn(8, 4)
    shard, replicate = distribute_tensor(t, mesh, [Shard(0)]), distribute_tensor(t, mesh, [Replicate()])
    assert block_split.structural_key(gm, [shard]) == block_split.structural_key(
        gm, [distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])]
    )
    assert block_split.structural_key(gm, [shard]) != block_split.structural_key(gm, [replicate])


def test_uninstall_restores_the_backend_entries():
    import dynamo_ext
    from dynamo_ext import _compat

    entries = (_compat.compile_fx_module().compile_fx, _compat.aot_autograd_backend_class().__call__)
    dynamo_ext.install()
    try:
        assert _compat.aot_autograd_backend_class().__call__ is not entries[1]
    finally:
        dynamo_ext.uninstall()
    assert (_compat.compile_fx_module().compile_fx, _compat.aot_autograd_backend_class().__call__) == entries


def test_dynamic_shape_inputs_are_compiled_whole(world, caplog):
    net = build(4, inners=(6, 6, 6))
    x = batch(0, 0)
    torch._dynamo.mark_dynamic(x, 0)
    with caplog.at_level(logging.INFO, logger=block_split.__name__):
        _, aot = _compile_step(net, x)
    assert aot == 1
    assert "dynamic-shape inputs; compiled whole" in caplog.text


def _compiled_autograd_step(net: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    from dynamo_ext import _compat

    out = torch.compile(net, backend="aot_eager", fullgraph=True)(x)
    with _compat.compiled_autograd(torch.compile(backend="aot_eager", fullgraph=True)):
        out.float().sum().backward()
    return [_compat.local_tensor_of(p.grad).clone() for p in net.parameters()]


@pytest.mark.parametrize("blocks", [3, 6])
def test_compiled_autograd_backward_is_cut_at_its_blocks(world, caplog, blocks):
    from torch._dynamo.utils import counters

    import dynamo_ext

    torch.manual_seed(0)
    net = build(4, inners=(6,) * blocks)
    with caplog.at_level(logging.INFO, logger=block_split.__name__):
        counters.clear()
        grads = _compiled_autograd_step(net, batch(0, 0))
    # NOTE [compiled-autograd backward compiled once per block]: the backward graph copies one AOT backward per
    # forward submodule; the blocks' copies after the first run its compile, whatever the depth
    assert (
        f"compiled-autograd backward, {blocks + 2} submodules, 3 compiled, {blocks - 1} running an identical "
        "block's compile" in caplog.text
    )
    assert counters["aot_autograd"]["total"] == 6  # three forward compiles, three backward ones
    torch._dynamo.reset()
    torch.manual_seed(0)
    whole = build(4, inners=(6,) * blocks)
    with dynamo_ext.config.patch(compile_blocks_once=False):
        expected = _compiled_autograd_step(whole, batch(0, 0))
    assert len(grads) == len(expected) > blocks
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_backward_partition_needs_two_identical_aot_backwards():
    graph = torch.fx.Graph()
    graph.output(graph.call_function(torch.neg, (graph.placeholder("a"),)))
    assert block_split.backward_partition(torch.fx.GraphModule(torch.nn.Module(), graph)) is None


def test_structural_key_matches_closures_over_the_same_objects_and_symbolic_sizes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def closure(held: Any) -> Any:
        def fn(t: torch.Tensor) -> torch.Tensor:
            return t + held

        return fn

    def graph_calling(fn: Any) -> torch.fx.GraphModule:
        graph = torch.fx.Graph()
        graph.output(graph.call_function(fn, (graph.placeholder("a"),)))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    one, other = torch.ones(()), torch.ones(())
    x = torch.randn(2, 3)
    # compiled autograd makes one prologue closure per copied backward, over the same compiled function's parts
    assert block_split.structural_key(graph_calling(closure(one)), [x]) == block_split.structural_key(
        graph_calling(closure(one)), [x]
    )
    assert block_split.structural_key(graph_calling(closure(one)), [x]) != block_split.structural_key(
        graph_calling(closure(other)), [x]
    )
    mode = FakeTensorMode(shape_env=ShapeEnv())
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    def symbolic(t: torch.Tensor, source: str) -> torch.Tensor:
        from torch._dynamo.source import LocalSource

        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
        return mode.from_tensor(t, source=LocalSource(source), symbolic_context=ctx)

    gm = graph_calling(torch.neg)
    a, b = symbolic(torch.randn(2, 3), "a"), symbolic(torch.randn(5, 3), "b")
    assert block_split.structural_key(gm, [a]) == block_split.structural_key(gm, [a.detach()])  # same symbol
    # another symbol of the same range: the same key, symbols named by position (compile_blocks shares the
    # compile only where the guards hold renamed: test_block_symbols.py)
    assert block_split.structural_key(gm, [a]) == block_split.structural_key(gm, [b])


def test_the_cut_backward_keeps_the_boxed_calling_convention():
    from dynamo_ext.blocks.split_backward import FlatBackward

    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output((graph.call_function(torch.add, (a, b)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x, y = torch.randn(3), torch.randn(3)
    args = [x, y]
    (out,) = FlatBackward(gm, sizes=[]).boxed(gm)(args)
    # compiled autograd's inputs come in one list the graph clears, so each can be freed after its last use
    assert args == [] and torch.equal(out, x + y)
    # a size symbol the cut needs as an input of its own is read from its tensor at each call
    graph = torch.fx.Graph()
    t, n = graph.placeholder("t"), graph.placeholder("t_size_0")
    graph.output((graph.call_function(torch.mul, (t, n)),))
    sized = torch.fx.GraphModule(torch.nn.Module(), graph)
    args = [torch.ones(5)]
    (out,) = FlatBackward(sized, sizes=[(0, 0, False)]).boxed(sized)(args)
    assert args == [] and torch.equal(out, torch.full((5,), 5.0))


def test_a_tuple_read_on_both_sides_of_the_blocks_stays_with_its_items():
    # NOTE [values that would cross a cut]: an item read only after the blocks would move to its reader, but the
    # tuple it comes from is read before the blocks too and stays: the item goes back, a cut carries no tuple
    # (AOTAutograd refuses a submodule output that is a tuple).
    import operator

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    parts = graph.call_function(torch.split, (x, 2))
    first = graph.call_function(operator.getitem, (parts, 0))
    second = graph.call_function(operator.getitem, (parts, 1))
    before = graph.call_function(torch.relu, (first,))
    block = graph.call_function(torch.add, (before, 1))
    after = graph.call_function(torch.mul, (second, block))
    graph.output(after)
    nodes = list(graph.nodes)
    partition = {n: 0 for n in nodes}
    partition.update({block: 1, after: 2, nodes[-1]: 2})
    block_split._sink_into_consumers(nodes, partition)
    assert (partition[parts], partition[first], partition[second]) == (0, 0, 0), partition
    # a value read after the blocks only still moves there
    graph2 = torch.fx.Graph()
    y = graph2.placeholder("y")
    late = graph2.call_function(torch.neg, (y,))
    mid = graph2.call_function(torch.add, (y, 1))
    end = graph2.call_function(torch.mul, (late, mid))
    graph2.output(end)
    nodes2 = list(graph2.nodes)
    partition2 = {y: 0, late: 0, mid: 1, end: 2, nodes2[-1]: 2}
    block_split._sink_into_consumers(nodes2, partition2)
    assert partition2[late] == 2, partition2
