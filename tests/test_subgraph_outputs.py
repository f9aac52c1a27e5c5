"""NOTE [subgraph outputs that alias inputs]: ``invoke_subgraph`` bodies return copies, not their own inputs.

Stands apart from block reuse: torch's own regional compilation
(``torch.compiler.nested_compile_region``, ``torch._dynamo.config.use_graph_deduplication``)
with ``backend="inductor"`` gave wrong gradients on 2.13 without the plugin's pass.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_sgd_steps_match_eager
from torch import nn

from dynamo_ext import _compat

pytestmark = pytest.mark.skipif(_compat.invoke_subgraph_op() is None, reason="no invoke_subgraph")

HIDDEN, INNER, BATCH = 10, 6, 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, INNER, bias=False)
        self.down = nn.Linear(INNER, HIDDEN, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class _RegionBlock(_Block):
    @torch.compiler.nested_compile_region
    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Mlp(nn.Module):
    """``[B, HIDDEN] -> [B, HIDDEN]``: an input projection, 3 identical residual blocks, an output projection."""

    def __init__(self, region: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.blocks = nn.ModuleList([(_RegionBlock if region else _Block)() for _ in range(3)])
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


@pytest.mark.parametrize("regions", ["nested_compile_region", "graph_deduplication"])
def test_inductor_gradients_of_regional_compilation_match_eager(plugin, regions, tmp_path, monkeypatch):
    """Without the pass Inductor reused a block's input buffer while the saved activation still read it: the
    last block's ``up.weight`` gradient was off (by 0.04 on 2.13)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # compile here, not from another run's cache
    torch.manual_seed(0)
    net = _Mlp(region=regions == "nested_compile_region")
    ref = copy.deepcopy(net)
    dedup = regions == "graph_deduplication"
    with torch._dynamo.config.patch(use_graph_deduplication=dedup, track_nodes_for_deduplication=dedup):
        model = torch.compile(net, backend="inductor", fullgraph=True)
        inputs = [torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(step)) for step in range(2)]
        assert_sgd_steps_match_eager(model, net, ref, inputs)


def test_subgraph_outputs_that_alias_inputs_become_copies():
    from torch.fx.experimental.proxy_tensor import make_fx

    from dynamo_ext.inductor_lowerings.subgraph_outputs import copy_aliased_outputs

    def body(x, w):
        return (x @ w, x, w.t())

    x, w = torch.randn(2, 3), torch.randn(3, 3)
    gm = make_fx(body)(x, w)  # aten ops with meta["val"], as a post-grad graph holds
    assert copy_aliased_outputs(gm) == 2  # x itself and the view w.t()
    out = gm(x, w)
    assert out[1].data_ptr() != x.data_ptr() and torch.equal(out[1], x)
    assert out[2].data_ptr() != w.data_ptr() and torch.equal(out[2], w.t())
    assert copy_aliased_outputs(gm) == 0
