"""FSDP2 module groups (``fully_shard([norm, out])``) traced, fake 4-rank group in one process.

What is checked here is what a graph contains and the FSDP2 state it leaves
behind; the numbers against eager FSDP2 are checked on gloo ranks
(``tests/test_fsdp_training_gloo.py``, the ``group*`` settings).
"""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, all_gathers
from torch import nn

from dynamo_ext import _compat, graph_breaks

pytestmark = pytest.mark.skipif(
    _compat.fsdp_group_hook_codes() is None, reason="this torch release's FSDP2 module-group hooks are not traced"
)


class _Head(nn.Module):
    """``[B, 8] -> [B, 8]``: a projection, then a final norm and an output projection (one FSDP2 group)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 8, bias=False)
        self.skip_norm = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h if self.skip_norm else self.norm(h))


def _sharded() -> _Head:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = _Head()
    mesh = init_device_mesh("cpu", (4,))
    fully_shard(net.inp, mesh=mesh)
    fully_shard([net.norm, net.out], mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _gathers(backend: CountingBackend) -> int:
    return all_gathers(backend.graphs)


def _left_sharded(net: _Head) -> None:
    """The state a finished FSDP2 forward leaves: the group's pass closed, sharded parameters registered."""
    from torch.distributed.tensor import DTensor

    state = net.out._get_fsdp_state()
    assert state is net.norm._get_fsdp_state()  # one state for the group
    assert state._modules_to_run_forward == set()
    assert state._state_ctx.iter_forward_root is None
    for module in (net.inp, net.norm, net.out):
        for name, p in module._parameters.items():
            if p is None:  # out has no bias
                continue
            assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), (module, name, type(p))


def test_group_is_one_graph_with_one_all_gather_per_param_group(world):
    net = _sharded()
    backend = CountingBackend()
    compiled = torch.compile(net, backend=backend, fullgraph=True)
    compiled(torch.randn(2, 8))
    compiled(torch.randn(2, 8))
    assert backend.frame_count == 1  # the group's set and the forward root are guarded: no recompile
    # as eager FSDP2 (NOTE [FSDP2 gathers per group]): the root's inp weight and bias in one all-gather; the
    # group's norm weight, bias and out weight in one, at norm
    assert _gathers(backend) == 2
    _left_sharded(net)


def test_forward_root_finishes_a_group_pass_that_skips_a_module(world):
    net = _sharded()
    net.skip_norm = True  # the pass starts at out and never reaches norm: the root's post-forward closes it
    backend = CountingBackend()
    torch.compile(net, backend=backend, fullgraph=True)(torch.randn(2, 8))
    assert backend.frame_count == 1 and _gathers(backend) == 2
    _left_sharded(net)


def test_group_module_called_outside_the_root_forward_is_a_named_graph_break(world):
    net = _sharded()
    net(torch.randn(2, 8))  # eager: FSDP2's lazy init picks the root
    h = torch.randn(2, 8)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=graph_breaks.FSDP_UNTRACED.gb_type) as info:
        torch.compile(lambda t: net.out(t), backend="eager", fullgraph=True)(h)
    assert "called outside its root module's forward" in str(info.value)


def test_registry_matches_functions_by_code_and_rejects_bad_keys():
    from dynamo_ext.variables import registry

    def made(k: int):
        def inner() -> int:
            return k

        return inner

    first, second = made(1), made(2)
    key = first.__code__
    registry.register_variable(key, lambda tx, value, source: None, match="code")
    try:
        assert registry.lookup(second) is not None  # another closure of the same def
        with pytest.raises(ValueError, match="code inner already has a dynamo-ext variable builder"):
            registry.register_variable(key, lambda tx, value, source: None, match="code")
    finally:
        registry.unregister_variable(key, match="code")
    assert registry.lookup(second) is None
    with pytest.raises(TypeError, match=r"register_variable\(match='code'\) needs a code object, got"):
        registry.register_variable(first, lambda tx, value, source: None, match="code")


def test_group_pass_started_by_eager_fsdp2_hooks_is_a_named_graph_break(world):
    net = _sharded()
    net(torch.randn(2, 8))  # eager: FSDP2's lazy init picks the root
    h = net.norm(torch.randn(2, 8))  # eager: FSDP2's hooks start the group's pass (out still to run)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=graph_breaks.FSDP_UNTRACED.gb_type) as info:
        torch.compile(lambda t: net.out(t), backend="eager", fullgraph=True)(h)
    assert "whose pass FSDP2's eager hooks started" in str(info.value)


def test_group_module_reached_through_the_state_is_named_by_its_path(world):
    """``out`` is first reached by the group's hooks (through the FSDP2 state): the audit still names it ``out``."""
    from dynamo_ext.audit.rank.comm import module_path

    net = _sharded()
    backend = CountingBackend()
    torch.compile(net, backend=backend, fullgraph=True)(torch.randn(2, 8))
    raw = {str(list(n.meta["nn_module_stack"].values())[-1][0]) for gm in backend.graphs for n in gm.graph.nodes
           if n.meta.get("nn_module_stack")}  # fmt: skip
    assert any("._module_info.module" in r for r in raw), raw  # what Dynamo calls it
    paths = {module_path(n) for gm in backend.graphs for n in gm.graph.nodes if n.meta.get("nn_module_stack")}
    assert paths == {"<root>", "inp", "norm", "out"}, paths


def test_a_group_parameter_the_forward_does_not_use_gets_no_gradient_as_in_eager(world):
    # NOTE [FSDP2 gathers per group]: norm's weight and bias are gathered with out's weight in one all-gather;
    # the forward skips norm, so eager FSDP2 leaves their .grad None (AdamW then leaves them alone)
    has_grad = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        net = _sharded()
        net.skip_norm = True
        model = net if mode == "eager" else torch.compile(net, backend="aot_eager", fullgraph=True)
        model(torch.randn(2, 8)).sum().backward()
        has_grad[mode] = {name: p.grad is not None for name, p in net.named_parameters()}
    assert has_grad["compiled"] == has_grad["eager"], has_grad
    assert has_grad["eager"] == {
        "inp.weight": True,
        "inp.bias": True,
        "norm.weight": False,
        "norm.bias": False,
        "out.weight": True,
    }
