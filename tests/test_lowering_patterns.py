"""The residual RMSNorm fusion on the fake process group: what the pass matches and what Inductor then generates.

FileCheck runs on ``run_and_get_code`` output.  Each structural check is also
run against stock Inductor and must fail there, so none of them passes by
accident.  The fake group's all-reduce returns its input, so compiled results
are compared with eager ones bit for bit.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import dynamo_ext
from dynamo_ext import _compat
from dynamo_ext.inductor_lowerings import options, rms_norm_fusion, rms_norm_lowering
from dynamo_ext.inductor_lowerings.registry import ChainedGraphPass


@pytest.fixture(autouse=True)
def _default_options():
    saved = options.get_config_copy()
    yield
    options.load_config(saved)


def block_manual(x, residual, w, weight):
    """Llama-style: upcast the sum, normalize in fp32, downcast, then the weight."""
    h = funcol.all_reduce(x @ w, "sum", dist.group.WORLD)
    r = h + residual
    h32 = r.float()
    y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * y.to(r.dtype), r


def block_functional(x, residual, w, weight):
    h = funcol.all_reduce(x @ w, "sum", dist.group.WORLD)
    r = h + residual
    return torch.nn.functional.rms_norm(r, (r.shape[-1],), weight, 1e-6), r


def block_no_weight(x, residual, w, weight):
    h = funcol.all_reduce(x @ w, "sum", dist.group.WORLD)
    r = h + residual
    return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5), r


def _args(dtype, rows=33, hidden=96):
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(s, generator=g).to(dtype) for s in ((rows, hidden), (rows, hidden), (hidden, hidden), (hidden,))
    ]


def _compile(fn, *args):
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(fn, backend="inductor"), *args)
    return out, "\n".join(code)


def _epilogue_kernel(code: str) -> str:
    return code[code.index("cpp_fused") : code.index("async_compile.wait")]


def _check_row_fused(kernel: str) -> None:
    """Per row: the sum of squares, then one loop storing both the residual sum and the
    normalized row, each computed from the collective's output and the residual; the
    stored sum is never loaded back (stock stores it in a first pass and re-reads it)."""
    FileCheck().check("tmp_acc0").check_count(".store(", 2, exactly=True).run(kernel)
    FileCheck().check_not("loadu(out_ptr").run(kernel)


def _check_fused(code: str) -> None:
    FileCheck().check("all_reduce_").check("wait_tensor").check_count("cpp_fused_residual_rms_norm", 1).run(
        code[code.index("def call") :]
    )
    _check_row_fused(_epilogue_kernel(code))


@pytest.mark.parametrize("fn", [block_manual, block_functional, block_no_weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_epilogue_fuses_and_matches_stock_bit_for_bit(world, fn, dtype):
    args = _args(dtype)
    eager = fn(*args)
    ours, code = _compile(fn, *args)
    _check_fused(code)
    dynamo_ext.uninstall()
    stock, stock_code = _compile(fn, *args)
    with pytest.raises(RuntimeError):
        _check_row_fused(_epilogue_kernel(stock_code))
    for o, s, e in zip(ours, stock, eager):
        assert torch.equal(o, s), f"{fn.__name__} {dtype}: fused differs from stock Inductor by {(o - s).abs().max()}"
        torch.testing.assert_close(o, e, rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-5)


def test_training_forward_keeps_rstd_for_backward(world):
    """In a training graph the rsqrt is saved for backward: our op's rstd output serves it."""
    args = _args(torch.float32, rows=8, hidden=64)
    for a in args:
        a.requires_grad_(True)

    def step(fn):
        torch._dynamo.reset()
        out = torch.compile(fn, backend="inductor")(*args)
        (out[0].square().sum() + out[1].sum()).backward()
        grads = [a.grad.clone() for a in args]
        for a in args:
            a.grad = None
        return out, grads

    ours_out, ours_grads = step(block_manual)
    dynamo_ext.uninstall()
    stock_out, stock_grads = step(block_manual)
    for a, b in zip([*ours_out, *ours_grads], [*stock_out, *stock_grads]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(lambda r: r * torch.rsqrt(r.pow(2).mean(0, keepdim=True) + 1e-6), id="norm-over-dim-0"),
        pytest.param(lambda r: r * torch.rsqrt(r.pow(3).mean(-1, keepdim=True) + 1e-6), id="cube-not-square"),
        pytest.param(lambda r: r * torch.rsqrt(r.pow(2).sum(-1, keepdim=True) + 1e-6), id="sum-not-mean"),
        pytest.param(lambda r: r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True)), id="no-eps"),
    ],
)
def test_lookalike_chains_are_left_to_stock(world, body):
    def fn(x, residual, w, weight):
        r = funcol.all_reduce(x @ w, "sum", dist.group.WORLD) + residual
        return body(r), r

    args = _args(torch.float32, rows=16, hidden=16)
    out, code = _compile(fn, *args)
    assert "residual_rms_norm" not in code
    torch.testing.assert_close(out, fn(*args), equal_nan=True)


def test_residual_must_have_the_collective_shape(world):
    def fn(x, residual_row, w, weight):
        r = funcol.all_reduce(x @ w, "sum", dist.group.WORLD) + residual_row  # broadcast add
        return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6), r

    x, _, w, weight = _args(torch.float32, rows=8, hidden=32)
    out, code = _compile(fn, x, weight, w, weight)
    assert "residual_rms_norm" not in code
    torch.testing.assert_close(out, fn(x, weight, w, weight))


def test_fallback_lowering_is_the_stock_structure(world):
    """With the predicate saying no (rows too long), the op lowers as stock would: sum stored, then re-read."""
    options.row_fused_max_hidden = 8
    args = _args(torch.float32, rows=8, hidden=32)
    out, code = _compile(block_functional, *args)
    FileCheck().check("cpp_fused_residual_rms_norm").check("loadu(out_ptr0").run(_epilogue_kernel(code))
    torch.testing.assert_close(out, block_functional(*args), rtol=1e-6, atol=1e-6)


def test_fused_rms_norm_op_is_matched(world):
    """``aten._fused_rms_norm`` (kept where Inductor does not decompose it, e.g. MPS) is matched too."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = torch.fx.Graph()
    x, residual, weight = g.placeholder("x"), g.placeholder("residual"), g.placeholder("weight")
    r = g.call_function(
        aten.add.Tensor,
        (
            g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (x, "sum", "0")),)),
            residual,
        ),
    )
    fused = g.call_function(aten._fused_rms_norm.default, (r, [24], weight, 1e-6))
    g.output((g.call_function(operator.getitem, (fused, 0)), g.call_function(operator.getitem, (fused, 1)), r))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    args = [torch.randn(5, 24, dtype=torch.bfloat16) for _ in range(2)] + [torch.randn(24, dtype=torch.bfloat16)]
    expected = gm(*args)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(a) for a in args])

    assert rms_norm_fusion.fuse_residual_rms_norm(gm.graph) == 1
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten._fused_rms_norm.default not in targets and torch.ops.dynamo_ext.residual_rms_norm.default in targets
    for got, want in zip(gm(*args), expected):
        # the native kernel and the decomposition our op follows may round the last bf16 bit differently
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-5)


def test_one_shot_lowering_is_a_collective_over_a_comm_buffer(world):
    """The CUDA path's IR, checked on the CPU: a ``_CollectiveKernel`` whose input is a symmetric-memory buffer.

    Wrapper codegen then stops (comm buffers need a CUDA device index); the IR is
    captured before that by a pre-fusion scheduler pass.
    """
    test_mode = _compat.symm_mem_test_mode()
    if test_mode is None:
        pytest.skip("this torch has no symmetric-memory test mode")
    options.one_shot = True
    options.one_shot_device_types = ("cpu",)
    captured: list[tuple[str, bool, str, list[str]]] = []

    def capture(nodes):
        from torch._inductor.utils import is_collective

        for n in nodes:
            ins = [
                type(i.get_output_spec()).__name__
                for i in getattr(n.node, "inputs", ())
                if hasattr(i, "get_output_spec")
            ]
            captured.append(
                (type(n.node).__name__, is_collective(n.node), str(getattr(n.node, "op_overload", "")), ins)
            )
        return nodes

    cfg = _compat.inductor_config()
    with test_mode(), cfg.patch(_pre_fusion_custom_pass=capture):
        code = _post_grad_graph_or_error(block_functional, *_args(torch.float32, rows=8, hidden=64))
    assert "dynamo_ext.one_shot_all_reduce_residual_rms_norm" in code and "all_reduce.default" not in code
    collectives = [c for c in captured if c[1]]
    assert [(c[0], c[2], c[3][0]) for c in collectives] == [
        ("_CollectiveKernel", "dynamo_ext.one_shot_all_reduce_residual_rms_norm.default", "CommBufferLayout")
    ]
    assert sum(c[0] == "_WaitKernel" for c in captured) == 2  # normalized output and residual sum; rstd unused


def test_one_shot_collective_kernel_codegen_and_numerics_without_comm_buffer(world, monkeypatch):
    """The same ``_CollectiveKernel`` lowering with ordinary buffers, so the CPU wrapper can emit and run it.

    Checks what the comm-buffer test cannot reach: the wrapper call with its dtype /
    None / group arguments, the per-output waits, and the numbers (the op's CPU
    implementation is a functional all-reduce plus the reference epilogue).
    """
    test_mode = _compat.symm_mem_test_mode()
    if test_mode is None:
        pytest.skip("this torch has no symmetric-memory test mode")
    options.one_shot = True
    options.one_shot_device_types = ("cpu",)
    monkeypatch.setattr(rms_norm_lowering, "_into_comm_buffer", lambda x, group_name: x)
    args = _args(torch.bfloat16, rows=8, hidden=64)
    with test_mode():
        out, code = _compile(block_manual, *args)
    call = code[code.index("def call") :]
    FileCheck().check("extern_kernels.mm").check(
        "torch.ops.dynamo_ext.one_shot_all_reduce_residual_rms_norm.default("
    ).check("torch.float32").check("torch.bfloat16").check_count("wait_tensor.default(", 2, exactly=True).check_not(
        "all_reduce_.default("
    ).run(call)
    for o, e in zip(out, block_manual(*args)):
        torch.testing.assert_close(o, e, rtol=0, atol=0)


def _post_grad_graph_or_error(fn, *args) -> str:
    seen: list[str] = []
    cfg = _compat.inductor_config()
    with cfg.patch(
        post_grad_custom_post_pass=ChainedGraphPass([cfg.post_grad_custom_post_pass, lambda g: seen.append(str(g))])
    ):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="Comm buffer requires a valid (CUDA|accelerator) device"):
            torch.compile(fn, backend="inductor")(*args)
    return seen[-1]


def test_one_shot_op_called_directly_falls_back_on_cpu(world):
    """The op in a user graph, no symmetric memory: the fallback lowering (stock all-reduce + our epilogue)."""

    def fn(x, residual, weight):
        s, y, _ = torch.ops.dynamo_ext.one_shot_all_reduce_residual_rms_norm(
            x, residual, weight, 1e-6, None, None, None, dist.group.WORLD.group_name
        )
        return y, s

    args = _args(torch.float32, rows=8, hidden=64)
    args = [args[0], args[1], args[3]]
    out, code = _compile(fn, *args)
    FileCheck().check("all_reduce_").check("wait_tensor").check("cpp_fused_one_shot_all_reduce_residual_rms_norm").run(
        code[code.index("def call") :]
    )
    torch.testing.assert_close(out, fn(*args), rtol=1e-6, atol=1e-6)


def test_user_post_grad_pass_runs_first_and_comes_back_on_uninstall():
    calls: list[str] = []

    class UserPass(_compat.custom_graph_pass_base()):
        def __call__(self, graph):
            calls.append("user")

        def uuid(self):
            return b"user-pass"

    cfg = _compat.inductor_config()
    user = UserPass()
    with cfg.patch(post_grad_custom_post_pass=user, fx_graph_cache=False):  # a cache hit would skip the passes
        with dynamo_ext.enabled():
            chained = cfg.post_grad_custom_post_pass
            assert chained.passes[0] is user and len(chained.passes) == 5  # the user's, then our four
            assert chained.uuid()[0] == b"user-pass"
            torch.compile(lambda x: x.sin() + 1, backend="inductor")(torch.randn(4))
            assert calls == ["user"]
        assert cfg.post_grad_custom_post_pass is user
    with cfg.patch(post_grad_custom_post_pass=lambda g: None), dynamo_ext.enabled():
        assert cfg.post_grad_custom_post_pass.uuid() is None  # a plain callable: no cache key, no caching
