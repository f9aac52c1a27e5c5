"""Block reuse (NOTE [block reuse]) on the fake process group: what the graph holds, what is refused, the log."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from fsdp_training import batch, build
from helpers import CountingBackend, assert_sgd_steps_match_eager

import dynamo_ext
from dynamo_ext import _compat
from dynamo_ext.blocks import reuse as block_reuse
from dynamo_ext.fx.nodes import is_invoke_subgraph

pytestmark = pytest.mark.skipif(_compat.graph_region_tracker_class() is None, reason="no graph deduplication")


def _trace(inners: tuple[int, ...], *, reuse: bool) -> torch.fx.GraphModule:
    net = build(4, inners=inners)
    backend = CountingBackend()
    with dynamo_ext.config.patch(block_reuse=reuse):
        torch.compile(net, backend=backend, fullgraph=True)(batch(0, 0))
    assert len(backend.graphs) == 1
    return backend.graphs[0]


def _calls(gm: torch.fx.GraphModule) -> Counter[str]:
    return Counter(str(n.args[0].target) for n in gm.graph.nodes if is_invoke_subgraph(n))


def _block_nodes(gm: torch.fx.GraphModule, block: str) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op.startswith("call") and (block_reuse.block_of(n) or "").endswith(block)]


def test_identical_blocks_traced_into_one_subgraph_and_a_different_block_inline(world, caplog):
    with caplog.at_level(logging.INFO, logger="dynamo_ext.blocks.reuse"):
        gm = _trace((6, 6, 6, 8), reuse=True)
    calls = _calls(gm)
    body, uses = calls.most_common(1)[0]
    assert uses == 3, calls  # blocks 0-2: one subgraph, called three times
    sub = getattr(gm, body)
    ops = [n for n in sub.graph.nodes if n.op == "call_function"]
    assert any(n.target is torch.relu for n in ops), sub.graph  # the block's compute is inside
    # FSDP2's gathers (autograd.Function inside a checkpoint) and their collectives stay outside.
    assert not any(n.op == "get_attr" or "c10d" in str(n.target) for n in sub.graph.nodes), sub.graph
    # Block 3 (inner width 8) is traced inline: its relu is in the outer graph, and the log says why.
    assert any(n.target is torch.relu for n in _block_nodes(gm, "blocks.3")), gm.graph
    inline = [r.getMessage() for r in caplog.records if "traced inline" in r.getMessage()]
    assert len(inline) == 1 and "blocks.3" in inline[0], inline
    assert "match no other block" in inline[0], inline


def test_off_by_default_every_block_inline(world):
    assert dynamo_ext.config.block_reuse is False
    gm = _trace((6, 6, 6), reuse=False)
    assert not _calls(gm)
    assert sum(n.target is torch.relu for n in gm.graph.nodes) == 3


def test_region_refusals_name_collectives_subclasses_and_higher_order_ops(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (4,))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.ones(2)
    d = graph.placeholder("d")
    d.meta["example_value"] = distribute_tensor(torch.ones(2), mesh, [Replicate()])
    body = graph.get_attr("body")
    plain = graph.call_function(torch.relu, (x,))
    plain.meta["example_value"] = torch.ones(2)
    on_dtensor = graph.call_function(torch.relu, (d,))
    hop = graph.call_function(torch.ops.higher_order.tag_activation_checkpoint, (body, x))
    gather = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 4, "0"))
    assert block_reuse.region_refusal(plain) is None
    assert block_reuse.region_refusal(on_dtensor) == block_reuse.SUBCLASS
    assert block_reuse.region_refusal(hop) == block_reuse.HIGHER_ORDER_OP
    assert block_reuse.region_refusal(gather) == block_reuse.COLLECTIVE


def test_uninstall_restores_dynamo(world):
    patched = {
        "regions": (_compat.graph_region_tracker_class(), "get_identical_regions"),
        "dedup": (_compat.output_graph_class(), "dedup_pass"),
        "compile": (_compat.dynamo_convert_frame(), "_compile"),
        "backward": (_compat.compiled_autograd_module(), "extract_bw_module"),
    }
    assert all(hasattr(getattr(owner, name), "__wrapped__") for owner, name in patched.values())
    dynamo_ext.uninstall()
    try:
        assert not any(hasattr(getattr(owner, name), "__wrapped__") for owner, name in patched.values())
    finally:
        dynamo_ext.install()


def test_inductor_gradients_with_reused_blocks_match_eager(plugin, tmp_path, monkeypatch):
    # NOTE [subgraph outputs that alias inputs]: without the copy Inductor overwrote the last block's saved input.
    import copy

    from fsdp_training import Net

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # compile here, not from another run's cache
    torch.manual_seed(0)
    net = Net(inners=(6, 6, 6))
    ref = copy.deepcopy(net)
    with dynamo_ext.config.patch(block_reuse=True):
        model = torch.compile(net, backend="inductor", fullgraph=True)
        inputs = [torch.randn(4, 10, generator=torch.Generator().manual_seed(step)) for step in range(2)]
        assert_sgd_steps_match_eager(model, net, ref, inputs)
