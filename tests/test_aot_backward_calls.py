"""NOTE [AOT backward copies traced as one call] (``dynamo_ext/blocks/aot_backward_calls.py``).

Dynamo's graph of a compiled-autograd backward is the one tracing op by op gives (node for node, with the same
metadata and fake values) and the gradients are bitwise the same; a region that cannot be one call stays as it is;
an outlined graph run without Dynamo computes what it did; nothing is outlined when no Dynamo trace follows.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import pytest
import torch
import torch.fx
from helpers import compiled_llama_loss

import dynamo_ext.config
from dynamo_ext import _compat
from dynamo_ext.blocks import aot_backward_calls


def _counting_outline(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the regions each ``outline`` call makes."""
    counts: list[int] = []
    original = aot_backward_calls.outline

    def outline(gm: torch.fx.GraphModule) -> int:
        counts.append(original(gm))
        return counts[-1]

    monkeypatch.setattr(aot_backward_calls, "outline", outline)
    return counts


def _llama_backward(mesh: Any, outlined: bool, compiler: Any = None) -> tuple[list[torch.fx.GraphModule], list[Any]]:
    """The bundled Llama's (FSDP over TP, 2 layers) compiled-autograd backward: Dynamo's graphs and the gradients'
    local values."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model, loss = compiled_llama_loss(mesh)
    compiler = compiler or (lambda gm: torch.compile(gm, backend=backend))
    try:
        with dynamo_ext.config.patch(outline_aot_backward=outlined), _compat.compiled_autograd(compiler):
            loss.backward()
    finally:
        torch._dynamo.reset()
    return graphs, [_compat.local_tensor_of(p.grad) for p in model.parameters()]


def _normalized(text: Any) -> str:
    """What differs between two compiles in one process, not between the graphs: object addresses and ids, FX's
    file names and their line numbers, compiled autograd's AOTAutograd-backward ids (``aot5_mm``)."""
    text = re.sub(r" at 0x[0-9a-f]+", "", str(text))
    text = re.sub(r'"<eval_with_key>\.\d+", line \d+', '"<eval_with_key>", line N', text)
    text = re.sub(r"CompiledFunctionBackward\d+", "CompiledFunctionBackward", re.sub(r"\d{9,}", "<id>", text))
    return re.sub(r"\baot\d+_", "aot_", text)


def _node_facts(gm: torch.fx.GraphModule) -> list[tuple[Any, ...]]:
    """Each node's op, target, arguments (as node positions), metadata and fake value, normalized.

    Node names are left out (Dynamo's names for ``getitem`` nodes count up over the nodes it made, the outlined
    regions' included), and so is the name half of ``source_fn_stack`` (the node's name when Dynamo made it);
    ``ac_graph_id`` counts up in a process.
    """
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    kept = [f for f in _compat.kept_node_meta_fields() if f not in ("source_fn_stack", "ac_graph_id")]
    facts = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            value = (type(value).__name__, tuple(map(str, value.shape)), tuple(map(str, value.stride())), value.dtype)
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{position[n]}")
        facts.append(
            (
                node.op,
                _normalized(node.target),
                _normalized(args),
                sorted(node.meta),
                _normalized(node.meta.get("stack_trace")),
                [_normalized(target) for _, target in node.meta.get("source_fn_stack", [])],
                {f: _normalized(node.meta[f]) for f in kept if f in node.meta},
                _normalized(value),
            )
        )
    return facts


def test_dynamo_graph_and_gradients_are_those_of_the_op_by_op_trace(world, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # one mesh: the same group names
    counts = _counting_outline(monkeypatch)
    graphs, grads = _llama_backward(mesh, outlined=True)
    assert counts and counts[-1] >= 4, counts  # two blocks, the parts before and after them
    traced, traced_grads = _llama_backward(mesh, outlined=False)
    assert len(graphs) == len(traced) == 1
    assert not any(isinstance(n.target, aot_backward_calls._Region) for n in graphs[0].graph.nodes)
    facts, traced_facts = _node_facts(graphs[0]), _node_facts(traced[0])
    assert len(facts) == len(traced_facts) > 500
    for i, (got, expected) in enumerate(zip(facts, traced_facts, strict=True)):
        assert got == expected, (i, got, expected)
    for a, b in zip(grads, traced_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nothing_outlined_when_no_dynamo_trace_follows(world, monkeypatch):
    """A compiler that runs compiled autograd's graph as it is (no ``torch.compile``) gets it unchanged."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    counts = _counting_outline(monkeypatch)
    seen: list[torch.fx.GraphModule] = []

    def as_is(gm: torch.fx.GraphModule) -> Any:
        seen.append(gm)
        return gm

    _, grads = _llama_backward(mesh, outlined=True, compiler=as_is)
    _, traced_grads = _llama_backward(mesh, outlined=False)
    assert not counts
    assert any(_normalized(n.name).startswith("aot_") for n in seen[0].graph.nodes)
    for a, b in zip(grads, traced_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_switch_off_outlines_nothing(world, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh

    counts = _counting_outline(monkeypatch)
    _llama_backward(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), outlined=False)
    assert not counts


# ---- outline() on graphs made by hand ------------------------------------------------------------------------------


def _copied_graph(*, constant: bool = False, reader_between: bool = False, unbacked: bool = False) -> Any:
    """``aot0_*`` nodes as compiled autograd names its copies: ``(x * 2 + y).relu()``, and ``x - 1`` after it."""
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    mul = graph.create_node("call_function", torch.ops.aten.mul.Tensor, (x, 2), name="aot0_mul")
    if unbacked:
        mul.meta["unbacked_bindings"] = {}
    if reader_between:
        graph.create_node("call_function", torch.ops.aten.neg.default, (mul,), name="neg")
    add_input = graph.get_attr("aot0_const") if constant else y
    add = graph.create_node("call_function", torch.ops.aten.add.Tensor, (mul, add_input), name="aot0_add")
    relu = graph.create_node("call_function", torch.ops.aten.relu.default, (add,), name="aot0_relu")
    sub = graph.create_node("call_function", torch.ops.aten.sub.Tensor, (x, 1), name="sub")
    graph.output((relu, sub))
    root = torch.nn.Module()
    root.register_buffer("aot0_const", torch.ones(3))
    return torch.fx.GraphModule(root, graph)


def test_outlined_graph_run_without_dynamo_computes_the_same():
    gm = _copied_graph()
    x, y = torch.randn(3), torch.randn(3)
    expected = gm(x, y)
    assert aot_backward_calls.outline(gm) == 1
    calls = [n for n in gm.graph.nodes if isinstance(n.target, aot_backward_calls._Region)]
    assert len(calls) == 1 and [n.target for n in calls[0].users] == [operator.getitem]
    assert not any(n.name.startswith("aot0_") for n in gm.graph.nodes)
    for got, want in zip(gm(x, y), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ({"constant": True}, "aot0_const is a get_attr node"),
        ({"reader_between": True}, "neg, between the region's nodes, reads one of its values"),
        ({"unbacked": True}, "aot0_mul makes data-dependent sizes"),
    ],
    ids=["get_attr", "reader_between", "unbacked"],
)
def test_region_that_cannot_be_one_call_stays_and_says_why(case, reason, caplog):
    gm = _copied_graph(**case)
    before = [(n.name, n.target) for n in gm.graph.nodes]
    with caplog.at_level("INFO", logger=aot_backward_calls.__name__):
        assert aot_backward_calls.outline(gm) == 0
    assert [(n.name, n.target) for n in gm.graph.nodes] == before
    assert f"AOT backward 0 traced op by op: {reason}" in caplog.text


def test_inlined_without_a_recorded_fake_run_runs_the_region_on_the_fakes():
    """A call whose fake run is gone (a restarted trace) gets its nodes back with fake values computed again."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    gm = _copied_graph()
    x, y = torch.randn(3), torch.randn(3)
    expected = gm(x, y)
    aot_backward_calls.outline(gm)
    mode = FakeTensorMode()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["example_value"] = mode.from_tensor(torch.randn(3))
    (call,) = [n for n in gm.graph.nodes if isinstance(n.target, aot_backward_calls._Region)]
    aot_backward_calls._inline_call(gm.graph, call)
    gm.recompile()
    copies = [n for n in gm.graph.nodes if n.name.startswith("aot0_")]
    aten = torch.ops.aten
    assert [n.target for n in copies] == [aten.mul.Tensor, aten.add.Tensor, aten.relu.default]
    for node in copies:
        assert isinstance(node.meta["example_value"], FakeTensor) and node.meta["example_value"].shape == (3,)
        assert node.meta["source_fn_stack"] == [(node.name, node.target)]
    assert not any(n.target is operator.getitem for n in gm.graph.nodes)
    for got, want in zip(gm(x, y), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
