"""Fusion 2 on the fake process group: which all-reduces share a bucket, and the generated code.

The fake group's all-reduce returns its input, so compiled and eager results are
compared exactly.  The gloo test (several real ranks) is in test_lowering_gloo.py.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import dynamo_ext
from dynamo_ext.inductor_lowerings import _compat, bucketing
from dynamo_ext.inductor_lowerings.options import options
from dynamo_ext.inductor_lowerings.registry import ChainedGraphPass


@pytest.fixture(autouse=True)
def _default_options():
    saved = dict(vars(options))
    yield
    vars(options).update(saved)


def grads_of_sizes(n: int = 32, *, odd: bool = False) -> list[torch.Tensor]:
    """``n`` fp32 gradients spread from 1 KiB to 64 KiB, every third one of shape (k, 1).

    Sizes are multiples of 16 elements unless ``odd``: tails double the C++ compile time
    of the pack kernel, and :func:`test_odd_sizes_land_at_the_right_offsets` covers them.
    """
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        numel = int(256 * 64 ** (i / max(n - 1, 1)))
        numel = min(16384, numel + i % 5) if odd else numel // 16 * 16
        t = torch.randn(numel, generator=g)
        out.append(t.reshape(-1, 1) if i % 3 == 1 else t)
    return out


def scaled_all_reduces(*grads):
    """What a data-parallel step does to its gradients: scale, all-reduce each, wait each."""
    return [funcol.all_reduce(g * 0.25, "sum", dist.group.WORLD) for g in grads]


def _compile(fn, *args):
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(fn, backend="inductor"), *args)
    return out, "\n".join(code)


def _collective_calls(code: str) -> int:
    return len(re.findall(r"_c10d_functional\.all_reduce_?\.default\(", code))


def test_32_small_all_reduces_become_one_with_one_pack_kernel(world):
    grads = grads_of_sizes()
    assert all(1024 <= g.numel() * 4 <= 64 * 1024 for g in grads)
    out, code = _compile(scaled_all_reduces, *grads)
    call = code[code.index("def call") :]
    assert _collective_calls(call) == 1
    # one pack kernel with the scale folded in, before the collective; results are views, no unpack kernel
    FileCheck().check_count("cpp_fused", 1, exactly=True).check("all_reduce_").check("wait_tensor").check_not(
        "cpp_fused"
    ).run(call)
    FileCheck().check("cpp_fused_cat_mul").check("0.25").run(code)
    assert call.count("reinterpret_tensor(") >= len(grads)
    for o, g in zip(out, grads):
        assert o.shape == g.shape and torch.equal(o, g * 0.25)


def test_odd_sizes_land_at_the_right_offsets(world):
    grads = grads_of_sizes(5, odd=True)
    out, code = _compile(scaled_all_reduces, *grads)
    assert _collective_calls(code[code.index("def call") :]) == 1
    for o, g in zip(out, grads):
        assert o.shape == g.shape and torch.equal(o, g * 0.25)
    dynamo_ext.uninstall()
    _, stock = _compile(scaled_all_reduces, *grads)
    assert _collective_calls(stock[stock.index("def call") :]) == len(grads)


def test_dtypes_groups_and_ops_get_their_own_buckets(world):
    sub = dist.new_group([0, 1, 2, 3])

    def fn(a, b, c, d, e, f):
        return [
            funcol.all_reduce(a, "sum", dist.group.WORLD),
            funcol.all_reduce(b.to(torch.bfloat16), "sum", dist.group.WORLD),  # the cast joins the bf16 pack
            funcol.all_reduce(c, "sum", dist.group.WORLD),
            funcol.all_reduce(d.to(torch.bfloat16), "sum", dist.group.WORLD),
            funcol.all_reduce(e, "sum", sub),
            funcol.all_reduce(f, "max", dist.group.WORLD),
        ]

    args = [torch.randn(64 + i) for i in range(6)]
    out, code = _compile(fn, *args)
    assert _collective_calls(code[code.index("def call") :]) == 4  # f32 sum, bf16 sum, other group, max
    for o, r in zip(out, fn(*args)):
        assert torch.equal(o, r)


def test_dependent_all_reduce_is_not_merged(world):
    def fn(a, b):
        x = funcol.all_reduce(a, "sum", dist.group.WORLD)
        y = funcol.all_reduce(b + x.sum(), "sum", dist.group.WORLD)  # needs x first
        return x, y

    args = [torch.randn(32), torch.randn(32)]
    out, code = _compile(fn, *args)
    assert _collective_calls(code[code.index("def call") :]) == 2
    torch.testing.assert_close(out, list(fn(*args)))  # x.sum() may round differently compiled


def test_result_used_before_a_later_collective_splits_the_bucket():
    """A result read between two collectives: merging would move the read after the second."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    c10d = torch.ops._c10d_functional
    g = torch.fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(4)]
    outs = []
    for i, x in enumerate(xs):
        w = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (x, "sum", "0")),))
        outs.append(g.call_function(torch.ops.aten.mul.Tensor, (w, 2.0)) if i == 1 else w)
    g.output(tuple(outs))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode()
    with mode:
        fake = [torch.empty(8 + i) for i in range(4)]
    FakeTensorProp(gm, mode).propagate(*fake)
    before = str(gm.graph)
    plan = bucketing.plan_buckets(gm.graph)
    assert [[m.all_reduce.args[0].name for m in b] for b in plan] == [["x0", "x1"], ["x2", "x3"]]
    assert str(gm.graph) == before  # planning is pure
    assert bucketing.bucket_all_reduces(gm.graph) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(c10d.all_reduce.default) == 2
    # the merged collectives keep their relative order and sit where x1's and x3's did
    order = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]
    assert [a.args[0].args[0][0].args[0].name for a in order] == ["x0", "x2"]


def test_big_all_reduces_stay_alone_and_buckets_close_at_the_cap(world):
    options.bucket_small_bytes = 4096
    options.bucket_cap_bytes = 8192
    args = [torch.randn(512) for _ in range(6)] + [torch.randn(2048)]  # 2 KiB each, then 8 KiB
    out, code = _compile(lambda *xs: [funcol.all_reduce(x, "sum", dist.group.WORLD) for x in xs], *args)
    # four 2 KiB fill the 8 KiB cap, the other two form a second bucket, the 8 KiB one is not small
    assert _collective_calls(code[code.index("def call") :]) == 3
    for o, r in zip(out, args):
        assert torch.equal(o, r)


def test_switched_off_by_option(world):
    options.bucket_all_reduces = False
    grads = grads_of_sizes(4)
    _, code = _compile(scaled_all_reduces, *grads)
    assert _collective_calls(code[code.index("def call") :]) == 4


def test_plan_is_a_pure_function_of_the_graph(world):
    """Every rank runs the pass on the same graph: same buckets, same order, every time."""
    texts = []
    for _ in range(2):
        seen: list[str] = []
        cfg = _compat.inductor_config()
        with cfg.patch(
            # A ChainedGraphPass, not a list: torch 2.11's Inductor takes one callable.
            post_grad_custom_post_pass=ChainedGraphPass(
                [cfg.post_grad_custom_post_pass, lambda g, s=seen: s.append(str(g))]
            )
        ):
            _compile(scaled_all_reduces, *grads_of_sizes(8))
        texts.append(seen[-1])
    assert texts[0] == texts[1] and texts[0].count("all_reduce.default") == 1
