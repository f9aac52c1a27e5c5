"""NOTE [original node meta read once per code object]: Dynamo's retrace of a compiled-autograd graph
looks the original graph up once per code object, and the nodes it makes carry the same metadata."""

from __future__ import annotations

import collections
import re
from typing import Any

import pytest
import torch
import torch._dynamo.output_graph as output_graph

from dynamo_ext import _compat, retrace_meta
from dynamo_ext._patching import Patcher

_META = ("stack_trace", "seq_nr", "nn_module_stack", "source_fn_stack", "original_aten", "recompute")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16)]
    return torch.nn.Sequential(*layers)


def _backward_graph(patched: bool) -> tuple[torch.fx.GraphModule, collections.Counter[Any], list[torch.Tensor]]:
    """Dynamo's graph of a compiled-autograd backward, the original-graph lookups per code object, the grads."""
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    lookups: collections.Counter[Any] = collections.Counter()
    context = output_graph.code_context
    original_get_context = context.get_context

    def get_context(code: Any) -> Any:
        lookups[code] += 1
        return original_get_context(code)

    patches = Patcher()
    patches.setattr(context, "get_context", get_context)
    if patched:
        retrace_meta.install(patches)
    try:
        model = _model()
        x = torch.randn(8, 16, requires_grad=True)
        loss = model(x).square().mean()
        with _compat.compiled_autograd(torch.compile(backend=capture)):
            loss.backward()
    finally:
        patches.undo_all()
        torch._dynamo.reset()
    assert len(graphs) == 1, [g.graph for g in graphs]
    return graphs[0], lookups, [p.grad for p in model.parameters()] + [x.grad]


def _facts(gm: torch.fx.GraphModule) -> list[tuple[Any, ...]]:
    facts = []
    for n in gm.graph.nodes:
        val = n.meta.get("example_value")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        meta = tuple((k, re.sub(r"<eval_with_key>\.\d+", "<eval_with_key>", repr(n.meta.get(k)))) for k in _META)
        facts.append((n.op, n.name, str(n.target), shape, tuple(sorted(n.meta)), meta))
    return facts


def test_retrace_keeps_every_nodes_metadata():
    stock, _, stock_grads = _backward_graph(patched=False)
    ours, _, our_grads = _backward_graph(patched=True)
    assert len(list(ours.graph.nodes)) > 50
    assert _facts(ours) == _facts(stock)
    assert any(n.meta.get("stack_trace") for n in ours.graph.nodes)  # there is metadata to compare
    for a, b in zip(our_grads, stock_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_original_graph_looked_up_once_per_code_object():
    def graph_module_lookups(lookups: collections.Counter[Any]) -> int:
        """Lookups of the compiled-autograd graph module's code (FX names its file ``<eval_with_key>.N``)."""
        return max(n for code, n in lookups.items() if code.co_filename.startswith("<eval_with_key>"))

    stock, stock_lookups, _ = _backward_graph(patched=False)
    ours, our_lookups, _ = _backward_graph(patched=True)
    calls = sum(1 for n in stock.graph.nodes if n.op == "call_function")
    assert graph_module_lookups(stock_lookups) >= calls // 2  # about once per node traced from it
    # once, then once again after each call into other code (here: each gradient accumulation)
    assert graph_module_lookups(our_lookups) * 5 <= graph_module_lookups(stock_lookups), (stock_lookups, our_lookups)
    assert len(list(ours.graph.nodes)) == len(list(stock.graph.nodes))


def test_install_wraps_create_proxy_and_undo_restores_it():
    tracer_class = _compat.subgraph_tracer_class()
    before = tracer_class.__dict__["_create_proxy"]
    patches = Patcher()
    retrace_meta.install(patches)
    assert tracer_class.__dict__["_create_proxy"] is not before
    assert tracer_class.__dict__["_create_proxy"].__wrapped__ is before
    patches.undo_all()
    assert tracer_class.__dict__["_create_proxy"] is before


@pytest.mark.parametrize("has_cur_code", [True, False])
def test_tracer_without_cur_code_is_left_alone(has_cur_code: bool):
    """On a release whose tracer has no ``_cur_code`` the wrapper only calls the original."""
    calls = []

    class Tracer:
        def _create_proxy(self, kind: str) -> str:
            calls.append(kind)
            return "proxy"

    class TxCode:
        f_code = test_tracer_without_cur_code_is_left_alone.__code__

    tracer = Tracer()
    tracer.output_graph = type("OG", (), {"current_tx": TxCode()})()
    if has_cur_code:
        tracer._cur_code = None
    patches = Patcher()
    patches.setattr(_compat, "subgraph_tracer_class", lambda: Tracer)
    try:
        retrace_meta.install(patches)
        assert tracer._create_proxy("call_function") == "proxy"
    finally:
        patches.undo_all()
    assert calls == ["call_function"]
    if has_cur_code:
        assert tracer._cur_code is TxCode.f_code
    else:
        assert "_cur_code" not in tracer.__dict__
