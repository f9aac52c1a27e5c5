"""FSDP2 gathers traced once per signature (NOTE [FSDP2 gathers traced once]) on the fake process group.

Stamping must not change what AOTAutograd sees: the forward and backward graphs are compared
node for node with every gather traced.  Numerics against eager FSDP2 on gloo ranks:
``test_fsdp_training_gloo.py`` (every configuration goes through the stamped path).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from fsdp_training import batch, build
from helpers import AotGraphs, graphs_seen_by

import dynamo_ext
from dynamo_ext.variables.fsdp import gather_stamps


class _AotCodes(AotGraphs):
    """The AOT graphs, and how many gather calls were stamped, in which modules."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps = 0
        self.stamped_in: set[str] = set()  # module paths of the stamped calls


def _step(model: torch.nn.Module, inputs: Any, *, stamped: bool, monkeypatch: pytest.MonkeyPatch) -> _AotCodes:
    torch._dynamo.reset()
    backend = _AotCodes()
    # Whole blocks stamped (NOTE [blocks traced once]) would leave no gather of theirs to stamp.
    with monkeypatch.context() as m, dynamo_ext.config.patch(trace_blocks_once=False):
        if not stamped:
            m.setattr(gather_stamps, "signature", lambda *args: None)
        stamp = gather_stamps._stamp

        def counted(tx: Any, *args: Any) -> Any:
            out = stamp(tx, *args)
            if out is not None:
                backend.stamps += 1
                backend.stamped_in.update(path for path, _cls in tx.nn_module_stack.values())
            return out

        m.setattr(gather_stamps, "_stamp", counted)
        out = torch.compile(model, backend=backend, fullgraph=True)(inputs)
        out.float().sum().backward()
    assert len(backend.dynamo) == 1 and len(backend.codes) == 2, (len(backend.dynamo), len(backend.codes))
    return backend


@pytest.mark.parametrize("reshard", [True, False], ids=["regather_in_backward", "keep_unsharded"])
def test_identical_parameters_share_one_traced_gather_and_aot_graphs_are_unchanged(world, monkeypatch, reshard):
    # Three identical blocks (inner width 6: uneven shards, FSDP pads) and a different fourth.
    net = build(4, inners=(6, 6, 6, 8), reshard=reshard)
    x = batch(0, 0)
    stamped = _step(net, x, stamped=True, monkeypatch=monkeypatch)
    traced = _step(net, x, stamped=False, monkeypatch=monkeypatch)
    assert stamped.codes == traced.codes  # AOTAutograd's forward and backward, node for node
    assert stamped.contexts == traced.contexts
    # at least blocks 1 and 2 repeat block 0's group gather (its four parameters in one all-gather)
    assert traced.stamps == 0 and stamped.stamps >= 2, stamped.stamps
    assert any("blocks.1" in path for path in stamped.stamped_in), stamped.stamped_in


def _unrolled(self: Any, x: torch.Tensor) -> torch.Tensor:
    h = self.inp(x)
    h = self.blocks[0](h)
    h = self.blocks[1](h)  # another line than block 0's call: another user stack
    return self.out(h)


def test_a_block_called_from_another_line_is_traced_not_stamped(world, monkeypatch):
    import fsdp_training

    monkeypatch.setattr(fsdp_training.Net, "forward", _unrolled)
    net = build(4)
    x = batch(0, 0)
    stamped = _step(net, x, stamped=True, monkeypatch=monkeypatch)
    traced = _step(net, x, stamped=False, monkeypatch=monkeypatch)
    assert stamped.codes == traced.codes and stamped.contexts == traced.contexts
    # block 1's gathers would carry block 0's stack traces: traced (the root's own may still be stamped)
    assert not any("blocks.1" in path for path in stamped.stamped_in), stamped.stamped_in


def test_fsdp_over_tp_llama_aot_graphs_are_unchanged(world, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh

    from dynamo_ext.audit.targets import example_llama as ex

    cfg = ex.Config(n_layers=2)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = ex.parallelize(ex.Decoder(cfg), mesh)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    stamped = _step(model, tokens, stamped=True, monkeypatch=monkeypatch)
    traced = _step(model, tokens, stamped=False, monkeypatch=monkeypatch)
    assert stamped.codes == traced.codes
    assert stamped.contexts == traced.contexts
    assert stamped.stamps >= 1, stamped.stamps  # block 1's group gather (9 parameters) repeats block 0's


class _Tracked:
    """Stands for a tensor's tracker: ``as_proxy().node``."""

    def __init__(self, node: torch.fx.Node) -> None:
        self.node = node

    def as_proxy(self) -> Any:
        return self


class _Result:
    """Stands for the tuple tracker a gather call returns: ``items``."""

    def __init__(self, *nodes: torch.fx.Node) -> None:
        self.items = [_Tracked(n) for n in nodes]


def test_a_call_reading_a_value_from_before_it_is_not_recorded(caplog):
    graph = torch.fx.Graph()
    local, other = graph.placeholder("local"), graph.placeholder("other")
    first = graph.call_function(torch.add, (local, 1))
    mixed = graph.call_function(torch.mul, (first, other))
    shards = [_Tracked(local)]
    with caplog.at_level(logging.DEBUG, logger=gather_stamps.__name__):
        assert gather_stamps._checked((first, mixed), shards, _Result(mixed), False, {}) is None
        assert gather_stamps._checked((first,), shards, _Result(first), True, {}) is None
        assert gather_stamps._checked((first,), shards, _Result(local), False, {}) is None
    reasons = [r.getMessage() for r in caplog.records]
    assert any("reads ['other'] from before the call" in r for r in reasons), reasons
    assert any("lifted a graph input" in r for r in reasons), reasons
    assert any("not a tuple of its own nodes" in r for r in reasons), reasons
    recording = gather_stamps._checked((first,), shards, _Result(first), False, {})
    assert recording is not None and recording.nodes == (first,) and recording.outputs == (first,)
    # a group gather: two shards read, two results
    two = graph.call_function(torch.add, (other, 2))
    recording = gather_stamps._checked((first, two), [_Tracked(local), _Tracked(other)], _Result(two, first), False, {})
    assert recording is not None and recording.locals == (local, other) and recording.outputs == (two, first)


def test_symbolic_shard_sizes_are_not_stamped():
    graph = torch.fx.Graph()
    node = graph.placeholder("local")
    node.meta["example_value"] = torch.empty(4, 3)
    assert gather_stamps.signature(len, [_Tracked(node)], (2, "g")) is not None
    assert gather_stamps.signature(len, [_Tracked(node)], (2, ["unhashable"])) is None
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        sym = mode.shape_env.create_unbacked_symint()
        node.meta["example_value"] = torch.empty(sym, 3)
    assert gather_stamps.signature(len, [_Tracked(node)], (2, "g")) is None
    assert gather_stamps.signature(len, [_Tracked(graph.placeholder("whole"))], (2, "g")) is None  # no fake value


def test_a_saved_tensor_hook_sees_no_tensor_of_the_trace(world, monkeypatch):
    # Stamped calls compute their fake values by running them; checkpoint then saves its (fake) inputs.
    # A user's pack hook around the first, compiling call must see only what the compiled step saves.
    from fsdp_training import saved_bytes

    seen = {}
    for stamped in (True, False):
        torch._dynamo.reset()
        with monkeypatch.context() as m:
            if not stamped:
                m.setattr(gather_stamps, "signature", lambda *args: None)
            net = build(4, reshard=True)
            seen[stamped] = saved_bytes(net, torch.compile(net, backend="aot_eager", fullgraph=True), batch(0, 0))
    assert seen[True] == seen[False], seen


def test_a_frames_gather_recordings_go_with_its_graph(world, monkeypatch):
    """The gather recordings of a frame do not keep its graph alive (they live on it: NOTE [recordings live on
    the graph] in ``dynamo_ext/blocks/trace_once.py``)."""
    import gc

    graphs = graphs_seen_by(monkeypatch, gather_stamps, "_frame_recordings")
    backend = _step(build(3, inners=(6, 6, 6)), batch(0, 0), stamped=True, monkeypatch=monkeypatch)
    assert graphs and backend.stamps > 0, "no gather call went through the stamping path"
    del backend
    torch._dynamo.reset()
    gc.collect()
    assert [r() for r in graphs] == [None]
