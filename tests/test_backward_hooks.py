"""Module backward hooks under torch.compile without compiled autograd (tier 1, one process).

Every check compares with eager: the gradients, and what each hook saw, in
which order.  See dynamo_ext/variables/autograd/backward_hooks.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import CountingBackend
from torch._dynamo.utils import counters

GB_TYPE = "dynamo_ext: module backward hook without compiled autograd"


class Pair(nn.Module):
    """Two tensor inputs (one may not require grad), a non-tensor one; returns (tensor, tensor, int)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, a, b, k):
        h = self.lin(a) + b
        return torch.tanh(h) * k, h.sum(-1), 7


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.pair = Pair()

    def forward(self, x, b):
        y = torch.relu(self.inner(x))
        u, s, _ = self.pair(y, b, 2)
        return u.sum() + (s * s).sum()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.block = Block()
        self.last = nn.Linear(6, 3)

    def forward(self, x, b):
        h = self.first(x)
        return self.block(h, b) + self.last(h).pow(2).sum()


def _snap(t):
    return None if t is None else t.detach().clone()


def _install_hooks(net: Net, log: list) -> list:
    """Hooks of every kind on nested modules; each logs what it saw and some change the gradients."""

    def pre(name, scale):
        def hook(mod, grad_output):
            log.append((name, "pre", tuple(_snap(g) for g in grad_output)))
            if scale is not None:
                return tuple(None if g is None else g * scale for g in grad_output)
            return None

        return hook

    def full(name, scale):
        def hook(mod, grad_input, grad_output):
            log.append((name, "full", tuple(_snap(g) for g in grad_input), tuple(_snap(g) for g in grad_output)))
            if scale is not None:
                return tuple(None if g is None else g * scale for g in grad_input)
            return None

        return hook

    return [
        net.block.register_full_backward_pre_hook(pre("block", 0.5)),
        net.block.register_full_backward_hook(full("block", None)),
        net.block.pair.register_full_backward_pre_hook(pre("pair", None)),
        net.block.pair.register_full_backward_pre_hook(pre("pair2", 3.0)),
        net.block.pair.register_full_backward_hook(full("pair", 2.0)),
        net.block.pair.register_full_backward_hook(full("pair2", None)),
        net.last.register_full_backward_hook(full("last", -1.0)),
        net.block.inner.register_full_backward_pre_hook(pre("inner", None)),
    ]


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    return a == b


def _step(fn, net, x, b):
    net.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    fn(x, b).backward()
    return [x.grad] + [p.grad for p in net.parameters()]


def _inputs(b_requires_grad: bool):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, generator=g)
    b = torch.randn(5, 6, generator=g).requires_grad_(b_requires_grad)
    return x, b


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("b_requires_grad", [True, False])
def test_nested_hooks_match_eager_in_one_graph(plugin, backend, b_requires_grad):
    torch.manual_seed(0)
    net = Net()
    x, b = _inputs(b_requires_grad)
    eager_log: list = []
    handles = _install_hooks(net, eager_log)
    eager = [_step(net, net, x, b) for _ in range(2)]
    for h in handles:
        h.remove()

    compiled_log: list = []
    _install_hooks(net, compiled_log)
    counters.clear()
    be = CountingBackend() if backend == "eager" else "aot_eager"
    cfn = torch.compile(net, backend=be, fullgraph=True)
    got = [_step(cfn, net, x, b) for _ in range(2)]
    assert not counters["graph_break"]
    if backend == "eager":
        assert be.frame_count == 1
    assert _same(got, eager)
    assert [e[:2] for e in compiled_log] == [e[:2] for e in eager_log]
    assert _same(compiled_log, eager_log)


def test_input_without_grad_fires_full_hook_at_outputs(plugin):
    lin = nn.Linear(3, 3)
    seen: list = []
    lin.register_full_backward_hook(lambda m, gi, go: seen.append((gi, _snap(go[0]))))
    x = torch.randn(2, 3)
    cfn = torch.compile(lambda x: lin(x), backend="aot_eager", fullgraph=True)
    for fn in (lin, cfn):
        with pytest.warns(UserWarning, match="no inputs require gradients"):
            fn(x).sum().backward()
    assert seen[0][0] == seen[1][0] == (None,)
    assert torch.equal(seen[0][1], seen[1][1])


def test_unused_output_gives_none_to_pre_hook(plugin):
    m = Pair()
    seen: list = []
    m.register_full_backward_pre_hook(lambda mod, go: seen.append(tuple(_snap(g) for g in go)))
    m.register_full_backward_hook(lambda mod, gi, go: seen.append(tuple(_snap(g) for g in gi)))
    a, b = torch.randn(2, 6, requires_grad=True), torch.randn(2, 6)

    def f(a, b):
        return m(a, b, 3)[0].sum()

    f(a, b).backward()
    torch.compile(f, backend="aot_eager", fullgraph=True)(a, b).backward()
    assert seen[0][1] is None and seen[0][2] is None
    assert _same(seen[2:], seen[:2])


def test_full_hook_may_return_none_for_inputs_without_grad(plugin):
    m = Pair()
    m.register_full_backward_hook(lambda mod, gi, go: (gi[0] * 2, None, None))
    a, b = torch.randn(2, 6, requires_grad=True), torch.randn(2, 6)

    def f(a, b):
        return m(a, b, 3)[0].sum()

    f(a, b).backward()
    ref, a.grad = a.grad, None
    torch.compile(f, backend="aot_eager", fullgraph=True)(a, b).backward()
    assert torch.allclose(a.grad, ref)


def _late(register, backend="aot_eager"):
    torch.manual_seed(0)
    net = Net()
    x, b = _inputs(True)
    cfn = torch.compile(net, backend=backend)
    first = _step(cfn, net, x, b)
    handle = register(net)
    ref = _step(net, net, x, b)
    got = _step(cfn, net, x, b)
    return first, ref, got, handle


@pytest.mark.parametrize(
    "register",
    [
        lambda n: n.last.register_full_backward_pre_hook(lambda m, go: (go[0] * 10,)),
        lambda n: n.last.register_full_backward_hook(lambda m, gi, go: (gi[0] * 10,)),
    ],
    ids=["pre_hook", "hook"],
)
def test_hook_registered_after_compile_recompiles(plugin, register):
    # pytorch#117265: stock ignores it and computes the old gradient.
    torch._dynamo.utils.guard_failures.clear()
    first, ref, got, _ = _late(register)
    assert not _same(ref, first)
    assert _same(got, ref)
    reasons = [r for rs in torch._dynamo.utils.guard_failures.values() for r in rs]
    assert any(
        "_backward_" in str(r) and "module backward hooks changed: compiled with none" in str(r) for r in reasons
    ), reasons


def test_stock_ignores_late_pre_hook():
    """The bug the guard fixes, reproduced on stock torch.compile (fails once stock fixes it)."""
    first, ref, got, _ = _late(lambda n: n.last.register_full_backward_pre_hook(lambda m, go: (go[0] * 10,)))
    assert not _same(ref, first)
    assert _same(got, first)


def test_hook_removed_after_compile_recompiles(plugin):
    torch.manual_seed(0)
    net = Net()
    x, b = _inputs(True)
    h = net.last.register_full_backward_hook(lambda m, gi, go: (gi[0] * 10,))
    cfn = torch.compile(net, backend="aot_eager")
    _step(cfn, net, x, b)
    h.remove()
    assert _same(_step(cfn, net, x, b), _step(net, net, x, b))


def test_global_hook_registered_after_compile(plugin):
    torch.manual_seed(0)
    net = Net()
    x, b = _inputs(True)
    # A function, not torch.compile(net): the OptimizedModule wrapper is a module with hooks of its own.
    cfn = torch.compile(lambda x, b: net(x, b), backend="aot_eager")
    _step(cfn, net, x, b)
    names: list = []

    def hook(mod, grad_output):
        names.append(type(mod).__name__)
        return None

    h = nn.modules.module.register_module_full_backward_pre_hook(hook)
    try:
        ref = _step(net, net, x, b)
        eager_names, names[:] = list(names), []
        got = _step(cfn, net, x, b)
    finally:
        h.remove()
    assert _same(got, ref)
    assert names == eager_names


def test_hook_error_messages_match_eager(plugin):
    lin = nn.Linear(3, 3)
    lin.register_full_backward_hook(lambda m, gi, go: (gi[0], gi[0]))
    x = torch.randn(2, 3, requires_grad=True)
    for fn in (lin, torch.compile(lambda x: lin(x), backend="aot_eager", fullgraph=True)):
        with pytest.raises(RuntimeError, match="invalid number of grad_input, got 2, but expected 1"):
            fn(x).sum().backward()


def test_hook_returning_none_for_a_defined_gradient_raises(plugin):
    lin = nn.Linear(3, 3)
    lin.register_full_backward_pre_hook(lambda m, go: (None,))
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="returned None for grad_output\\[0\\].*compiled autograd"):
        torch.compile(lambda x: lin(x), backend="aot_eager", fullgraph=True)(x).sum().backward()


def test_named_tuple_result_graph_breaks_with_hint(plugin):
    from collections import namedtuple

    Out = namedtuple("Out", "y")

    class M(nn.Module):
        def forward(self, x):
            return Out(x * 2)

    m = M()
    m.register_full_backward_hook(lambda mod, gi, go: None)
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=GB_TYPE) as info:
        torch.compile(lambda x: m(x), backend="eager", fullgraph=True)(x)
    assert "compiled_autograd = True" in str(info.value)
    counters.clear()
    out = torch.compile(lambda x: m(x), backend="eager")(x)  # falls back to eager at the break
    assert torch.equal(out.y, x * 2)


def test_compiled_autograd_around_backward_only(plugin):
    """Forward traced without compiled autograd, backward under it: the hook op runs in the CA graph."""
    torch.manual_seed(0)
    net = Net()
    x, b = _inputs(True)
    log_e: list = []
    hs = _install_hooks(net, log_e)
    ref = _step(net, net, x, b)
    for h in hs:
        h.remove()
    log_c: list = []
    _install_hooks(net, log_c)
    cfn = torch.compile(net, backend="aot_eager", fullgraph=True)
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
        got = _step(cfn, net, x, b)
    assert _same(got, ref)
    assert _same(log_c, log_e)


def test_uninstall_restores_stock_break_and_reinstall_works(plugin):
    lin = nn.Linear(3, 3)
    lin.register_full_backward_pre_hook(lambda m, go: (go[0] * 2,))
    x = torch.randn(2, 3, requires_grad=True)
    lin(x).sum().backward()
    ref, x.grad = x.grad, None
    patched = torch._dynamo.variables.BackwardHookVariable.__dict__["create"]
    torch.compile(lambda x: lin(x), backend="aot_eager", fullgraph=True)(x).sum().backward()
    assert torch.allclose(x.grad, ref)
    assert hasattr(torch.ops.dynamo_ext, "run_module_hooks")
    plugin.uninstall()
    assert not hasattr(torch.ops.dynamo_ext, "run_module_hooks")
    assert torch._dynamo.variables.BackwardHookVariable.__dict__["create"] is not patched
    with pytest.raises(torch._dynamo.exc.Unsupported, match="Module-level backwards hooks"):
        torch.compile(lambda x: lin(x), backend="eager", fullgraph=True)(x)
    plugin.install()  # the fixture uninstalls again
    x.grad = None
    torch.compile(lambda x: lin(x), backend="aot_eager", fullgraph=True)(x).sum().backward()
    assert torch.allclose(x.grad, ref)


def test_dtensor_at_hook_point_graph_breaks_with_hint(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (4,))

    class Scale(nn.Module):
        def forward(self, x):
            return x * 2

    m = Scale()
    m.register_full_backward_hook(lambda mod, gi, go: None)
    x = DTensor.from_local(torch.randn(3, requires_grad=True), mesh, [Replicate()], run_check=False)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=GB_TYPE) as info:
        torch.compile(lambda x: m(x), backend="eager", fullgraph=True)(x)
    assert "input[0] is a DTensor" in str(info.value)
    assert "compiled_autograd = True" in str(info.value)
