"""AsyncCollectiveTensor inputs of a compiled region keep their autograd edge (fake process group).

NOTE [grad-requiring AsyncCollectiveTensor inputs]: stock AOTAutograd (2.13) fakifies such an input
without ``requires_grad``, so the compiled region drops the gradient to the ACT's producer.  The fake
process group's collectives return garbage, so these tests check the autograd structure; the values
are compared with eager on gloo ranks (test_async_collective_inputs_gloo.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dynamo_ext
from dynamo_ext import _compat, async_collective_inputs, config

LOGGER = "dynamo_ext.async_collective_inputs"


def _act(w: torch.Tensor) -> torch.Tensor:
    """``w`` (a leaf ``[8, 4]``) as a partial sum reduce-scattered asynchronously: an ACT ``[2, 4]`` requiring grad."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = init_device_mesh("cpu", (4,))
    x = DTensor.from_local(w * 1.0, mesh, [Partial()], run_check=False)
    x = x.redistribute(mesh, [Shard(0)], async_op=True).to_local()
    assert isinstance(x, AsyncCollectiveTensor) and x.requires_grad
    return x


def _grad_into(x: torch.Tensor) -> list[torch.Tensor]:
    """The gradients that reach ``x`` in backward (a hook on the ACT, before ``to_local``'s backward)."""
    seen: list[torch.Tensor] = []
    x.register_hook(lambda g: seen.append(g.detach().clone()))
    return seen


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_act_input_alone_keeps_its_gradient(world, backend, caplog):
    w = torch.randn(8, 4, requires_grad=True)
    x = _act(w)
    seen = _grad_into(x)
    fn = torch.compile(lambda x: x * 2 + x.sin(), backend=backend, fullgraph=True)
    with caplog.at_level("INFO", logger=LOGGER):
        out = fn(x)
    # Stock: an inference graph, and backward raises "element 0 of tensors does not require grad".
    assert out.requires_grad
    out.sum().backward()
    xd = x.detach().clone()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], 2 + xd.cos())
    assert w.grad is not None and w.grad.shape == (8, 4)
    logged = any("position(s) [0]" in r.getMessage() for r in caplog.records if r.name == LOGGER)
    assert logged == _compat.aot_unwraps_async_collective_inputs()  # 2.11 keeps ACT inputs: nothing to restore


def test_act_input_of_a_block_with_parameters_keeps_its_gradient(world):
    torch.manual_seed(0)
    block = nn.Linear(4, 4)
    w = torch.randn(8, 4, requires_grad=True)
    x = _act(w)
    seen = _grad_into(x)
    out = torch.compile(block, backend="aot_eager", fullgraph=True)(x)
    out.sum().backward()
    # Stock: a graph differentiated for the parameters only; the ACT receives no gradient (autograd
    # materializes zeros for it, which to_local's backward cannot take here).
    assert block.weight.grad is not None
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], torch.ones(2, 4) @ block.weight.detach())
    assert w.grad is not None


def test_act_input_under_no_grad_compiles_an_inference_graph(world):
    w = torch.randn(8, 4, requires_grad=True)
    x = _act(w)
    with torch.no_grad():
        out = torch.compile(lambda x: x * 2, backend="aot_eager", fullgraph=True)(x)
    assert not out.requires_grad


def test_restore_requires_grad_changes_only_fakes_that_lost_it():
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    plain, kept = torch.zeros(2), torch.zeros(2, requires_grad=True)
    act = AsyncCollectiveTensor(torch.zeros(2))
    act.requires_grad_(True)
    fakes = [plain, kept, act, 3]
    assert async_collective_inputs.grad_requiring_acts([torch.zeros(1), act, 3], AsyncCollectiveTensor) == [1]
    changed = async_collective_inputs.restore_requires_grad(fakes, [0, 1, 2, 3], AsyncCollectiveTensor)
    assert changed == [0] and plain.requires_grad


def test_uninstall_restores_process_inputs():
    import torch._functorch.aot_autograd as aot_autograd

    before = aot_autograd.process_inputs
    dynamo_ext.install()
    try:
        wrapped = aot_autograd.process_inputs is not before
        assert wrapped == _compat.aot_unwraps_async_collective_inputs()
    finally:
        dynamo_ext.uninstall()
    assert aot_autograd.process_inputs is before


def test_a_cache_entry_compiled_without_the_plugin_is_not_reused(tmp_path, monkeypatch):
    from helpers import fake_world

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counters = _compat.dynamo_counters()

    def run() -> torch.Tensor:
        torch._dynamo.reset()
        counters.clear()
        w = torch.randn(8, 4, requires_grad=True)
        out = torch.compile(lambda x: x * 2 + x.sin(), backend="inductor", fullgraph=True)(_act(w))
        if out.requires_grad:
            out.sum().backward()  # a training entry is saved once its backward is compiled
        return out

    # The collective check compiles graphs with subclass inputs outside AOTAutograd's cache; off, the cache is used.
    with fake_world(4), config.patch(collective_check=False):
        stock = run()
        saved = counters["aot_autograd"]["autograd_cache_saved"]
        dynamo_ext.install()
        try:
            fixed = run()
            hits = counters["aot_autograd"]["autograd_cache_hit"]
            warm = run()  # a warm restart with the plugin: its own entry is reused
            warm_hits = counters["aot_autograd"]["autograd_cache_hit"]
        finally:
            dynamo_ext.uninstall()
    if _compat.aot_unwraps_async_collective_inputs():
        assert not stock.requires_grad and saved == 1  # stock's inference graph went into the cache
    assert fixed.requires_grad and hits == 0
    assert warm.requires_grad and warm_hits == 1
