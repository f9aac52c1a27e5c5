"""Collective bucketing on the fake process group: which all-reduces share a bucket, and the generated code.

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
from dynamo_ext import _compat
from dynamo_ext.inductor_lowerings import bucketing, options
from dynamo_ext.inductor_lowerings.registry import ChainedGraphPass


@pytest.fixture(autouse=True)
def _default_options():
    saved = options.get_config_copy()
    yield
    options.load_config(saved)


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
    """All-reduces in generated code: stock ones and buckets (NOTE [buckets only where ranks agree])."""
    stock = len(re.findall(r"_c10d_functional\.all_reduce_?\.default\(", code))
    return stock + _bucket_calls(code, "all_reduce")


def _bucket_calls(code: str, kind: str) -> int:
    return len(re.findall(rf"dynamo_ext\.bucketed_collective\.default\([^']*'{kind}'", code))


def test_32_small_all_reduces_become_one_with_one_pack_kernel(world):
    grads = grads_of_sizes()
    assert all(1024 <= g.numel() * 4 <= 64 * 1024 for g in grads)
    out, code = _compile(scaled_all_reduces, *grads)
    call = code[code.index("def call") :]
    assert _collective_calls(call) == 1
    # one pack kernel with the scale folded in, before the collective; results are views, no unpack kernel
    FileCheck().check_count("cpp_fused", 1, exactly=True).check("bucketed_collective").check_not("cpp_fused").run(call)
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
            funcol.all_reduce(c, "sum", dist.group.WORLD),
            funcol.all_reduce(b.to(torch.bfloat16), "sum", dist.group.WORLD),  # the cast joins the bf16 pack
            funcol.all_reduce(d.to(torch.bfloat16), "sum", dist.group.WORLD),
            funcol.all_reduce(e, "sum", sub),
            funcol.all_reduce(f, "max", dist.group.WORLD),
        ]

    args = [torch.randn(64 + i) for i in range(6)]
    out, code = _compile(fn, *args)
    assert _collective_calls(code[code.index("def call") :]) == 4  # f32 sum, bf16 sum, other group, max
    for o, r in zip(out, fn(*args)):
        assert torch.equal(o, r)


def test_interleaved_keys_keep_the_communication_order(world):
    """float32 and bfloat16 all-reduces in turn: a bucket never moves one across the other (NOTE [buckets keep
    the communication order]), so only the runs of one key merge and the issue order is the program's."""

    def fn(a, b, c, d, e):
        return [
            funcol.all_reduce(a, "sum", dist.group.WORLD),
            funcol.all_reduce(b, "sum", dist.group.WORLD),
            funcol.all_reduce(c.to(torch.bfloat16), "sum", dist.group.WORLD),
            funcol.all_reduce(d, "sum", dist.group.WORLD),
            funcol.all_reduce(e, "sum", dist.group.WORLD),
        ]

    args = [torch.randn(64 + i) for i in range(5)]
    out, code = _compile(fn, *args)
    call = code[code.index("def call") :]
    assert _collective_calls(call) == 3  # {a, b}, c, {d, e}
    FileCheck().check("bucketed_collective.default(").check("all_reduce_.default(").check(
        "bucketed_collective.default("
    ).run(call)
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


def _all_reduces_with_reads(reads: dict[int, str]):
    """Four all-reduces of ``x0..x3``; ``reads[i]`` says what reads result ``i`` right after its wait.

    ``"compute"``: ``w * 2 + w.sum()`` (what one rank may log or use early), kept in the outputs;
    ``"collective"``: an all-gather of ``w * 2`` (data flow between collectives).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = torch.fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(4)]
    outs = []
    for i, x in enumerate(xs):
        w = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (x, "sum", "0")),))
        outs.append(w)
        if reads.get(i) == "compute":
            doubled = g.call_function(aten.mul.Tensor, (w, 2.0))
            outs.append(g.call_function(aten.add.Tensor, (doubled, g.call_function(aten.sum.default, (w,)))))
        elif reads.get(i) == "collective":
            doubled = g.call_function(aten.mul.Tensor, (w, 2.0))
            gathered = g.call_function(c10d.all_gather_into_tensor.default, (doubled, 4, "0"))
            outs.append(g.call_function(c10d.wait_tensor.default, (gathered,)))
    g.output(tuple(outs))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode()
    with mode:
        fake = [torch.empty(8 + i) for i in range(4)]
    FakeTensorProp(gm, mode).propagate(*fake)
    return gm


def _plan_names(gm):
    return [[m.collective.args[0].name for m in b] for b in bucketing.plan_buckets(gm.graph)]


def test_a_result_read_early_on_one_rank_only_does_not_change_the_plan():
    """NOTE [rank-invariant first use]: rank 0 reads result 1 before all-reduce 2, rank 1 does not.

    Both ranks must bucket alike (else one issues 1 all-reduce and the other 2: a hang); the read
    moves after the merged all-reduce, and the merged graph computes what the graph did.
    """
    rank0, rank1 = _all_reduces_with_reads({1: "compute"}), _all_reduces_with_reads({})
    before = str(rank0.graph)
    assert _plan_names(rank0) == _plan_names(rank1) == [["x0", "x1", "x2", "x3"]]
    assert str(rank0.graph) == before  # planning is pure
    real = [torch.randn(8 + i) for i in range(4)]
    for gm in (rank0, rank1):
        expected = _SimulatedWorld(gm, 0, 4).run(*real)
        assert bucketing.bucket_collectives(gm.graph) == 3
        gm.recompile()
        got = _SimulatedWorld(gm, 0, 4).run(*real)
        assert all(torch.allclose(o, e) for o, e in zip(got, expected))
        targets = [n.target for n in gm.graph.nodes]
        assert targets.count(torch.ops._c10d_functional.all_reduce.default) == 1


def test_a_collective_reading_a_result_closes_the_bucket():
    """Data flow between collectives (an all-gather of result 1) is what splits a bucket, on every rank."""
    gm = _all_reduces_with_reads({1: "collective"})
    assert _plan_names(gm) == [["x0", "x1"], ["x2", "x3"]]
    real = [torch.randn(8 + i) for i in range(4)]
    expected = _SimulatedWorld(gm, 0, 4).run(*real)
    assert bucketing.bucket_collectives(gm.graph) == 2
    gm.recompile()
    assert all(torch.allclose(o, e) for o, e in zip(_SimulatedWorld(gm, 0, 4).run(*real), expected))
    # the merged collectives keep their relative order and the all-gather stays between them
    order = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and "wait" not in str(n.target)]
    collectives = [t for t in order if "all_reduce" in t or "all_gather" in t]
    assert collectives == ["all_reduce.default", "all_gather_into_tensor.default", "all_reduce.default"]


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
    assert texts[0] == texts[1] and texts[0].count("bucketed_collective.default") == 1
    assert "all_reduce.default" not in texts[0]


# ---- FSDP-style all-gathers and reduce-scatters (NOTE [all-gather / reduce-scatter buckets]) ----
def _ag_rs_calls(code: str) -> tuple[int, int]:
    call = code[code.index("def call") :]
    return (
        len(re.findall(r"_c10d_functional\.all_gather_into_tensor(?:_out)?\.default\(", call))
        + _bucket_calls(call, "all_gather"),
        len(re.findall(r"_c10d_functional\.reduce_scatter_tensor(?:_out)?\.default\(", call))
        + _bucket_calls(call, "reduce_scatter"),
    )


def shards_and_grads(n: int = 8) -> list[torch.Tensor]:
    """``n`` parameter shards to gather, then ``n`` unsharded gradients (dim 0 a multiple of 4) to scatter."""
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(*((3 + i, 5) if i % 2 else (16 * (i + 1),)), generator=g) for i in range(n)]
    grads = [torch.randn(*((4 * (i + 1), 3) if i % 2 else (4 * (7 + i),)), generator=g) for i in range(n)]
    return shards + grads


def fsdp_step(*ts):
    """FSDP's collectives: gather every (cast) shard, reduce-scatter every (scaled) gradient, all on dim 0."""
    n = len(ts) // 2
    gathered = [funcol.all_gather_tensor(s.to(torch.bfloat16), 0, dist.group.WORLD) for s in ts[:n]]
    scattered = [funcol.reduce_scatter_tensor(g * 0.25, "sum", 0, dist.group.WORLD) for g in ts[n:]]
    return gathered + scattered


def _eager(fn, *args):
    return [t.wait() if hasattr(t, "wait") else t for t in fn(*args)]


def test_small_all_gathers_and_reduce_scatters_become_one_each(world):
    args = shards_and_grads()
    out, code = _compile(fsdp_step, *args)
    assert _ag_rs_calls(code) == (1, 1)
    call = code[code.index("def call") :]
    # one pack kernel (with the cast) before the all-gather, one kernel after it that re-assembles the
    # gathered blocks in rank order (it also packs the reduce-scatter input, scale folded in), and the
    # reduce-scatter results are views: no kernel after it
    FileCheck().check_count("cpp_fused", 1, exactly=True).check("bucketed_collective.default(").check(
        "'all_gather'"
    ).check_count("cpp_fused", 1, exactly=True).check("bucketed_collective.default(").check(
        "'reduce_scatter'"
    ).check_not("cpp_fused").run(call)
    FileCheck().check("0.25").run(code)
    for o, r in zip(out, _eager(fsdp_step, *args)):
        assert o.shape == r.shape and o.dtype == r.dtype and torch.equal(o, r)
    dynamo_ext.uninstall()
    _, stock = _compile(fsdp_step, *args)
    assert _ag_rs_calls(stock) == (len(args) // 2, len(args) // 2)


def test_all_gather_and_reduce_scatter_switched_off_by_option(world):
    options.bucket_all_gathers_reduce_scatters = False
    args = shards_and_grads(4)
    _, code = _compile(fsdp_step, *args)
    assert _ag_rs_calls(code) == (4, 4)


def test_all_gather_limits_count_the_gathered_size(world):
    options.bucket_small_bytes = 4096
    options.bucket_cap_bytes = 8192
    # 256 B shards gather to 1 KiB on 4 ranks: 8 fill the 8 KiB cap, 4 more make a second bucket;
    # a 2 KiB shard gathers to 8 KiB, not small
    args = [torch.randn(64) for _ in range(12)] + [torch.randn(512)]
    out, code = _compile(lambda *xs: [funcol.all_gather_tensor(x, 0, dist.group.WORLD) for x in xs], *args)
    assert _ag_rs_calls(code) == (3, 0)
    for o, r in zip(out, _eager(lambda *xs: [funcol.all_gather_tensor(x, 0, dist.group.WORLD) for x in xs], *args)):
        assert torch.equal(o, r)


def test_dynamic_shapes_are_left_alone(world):
    args = shards_and_grads(3)
    for t in args:
        torch._dynamo.mark_dynamic(t, 0)
    out, code = _compile(fsdp_step, *args)
    assert _ag_rs_calls(code) == (3, 3)
    for o, r in zip(out, _eager(fsdp_step, *args)):
        assert torch.equal(o, r)


class _SimulatedWorld(torch.fx.Interpreter):
    """Runs a graph as rank ``rank`` of ``size`` ranks whose inputs are this one's plus ``1000 * r``.

    Collective inputs are copies of graph inputs here, so rank ``r``'s collective input is this
    rank's plus ``1000 * r`` too: the collectives can be computed from one rank's data alone.
    """

    def __init__(self, gm: torch.fx.GraphModule, rank: int, size: int) -> None:
        super().__init__(gm)
        self.rank, self.size = rank, size

    def call_function(self, target, args, kwargs):
        c10d = torch.ops._c10d_functional
        if target is c10d.wait_tensor.default:
            return args[0]
        if target is c10d.all_reduce.default:
            return sum(args[0] + 1000 * r for r in range(self.size))
        if target is c10d.all_gather_into_tensor.default:
            return torch.cat([args[0] + 1000 * r for r in range(self.size)])
        if target is c10d.reduce_scatter_tensor.default:
            return sum((args[0] + 1000 * r).chunk(self.size)[self.rank] for r in range(self.size))
        return super().call_function(target, args, kwargs)


def test_all_gather_reduce_scatter_plan_and_layout():
    """A pure plan; the merged graph gathers in rank order and scatters every member's own chunk."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    c10d = torch.ops._c10d_functional
    shapes = [(3, 2), (5,), (2, 2), (4,), (8, 3), (12,), (5,), (6,), (2, 2), (16,)]
    g = torch.fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(len(shapes))]

    def wait(n):
        return g.call_function(c10d.wait_tensor.default, (n,))

    outs = [
        wait(g.call_function(c10d.all_gather_into_tensor.default, (xs[0], 4, "0"))),
        wait(g.call_function(c10d.all_gather_into_tensor.default, (xs[1], 4, "0"))),
        wait(g.call_function(c10d.all_gather_into_tensor.default, (xs[2], 2, "1"))),  # other group
        wait(g.call_function(c10d.all_gather_into_tensor.default, (xs[3], 4, "0"))),
        wait(g.call_function(c10d.reduce_scatter_tensor.default, (xs[4], "sum", 4, "0"))),
        wait(g.call_function(c10d.reduce_scatter_tensor.default, (xs[5], "sum", 4, "0"))),
        wait(g.call_function(c10d.reduce_scatter_tensor.default, (xs[6], "sum", 5, "2"))),  # dim 0 = 5: 1 each
        wait(g.call_function(c10d.reduce_scatter_tensor.default, (xs[7], "max", 4, "0"))),  # other op
        wait(g.call_function(c10d.all_gather_into_tensor.default, (xs[8], 4, "0"))),
        wait(g.call_function(c10d.reduce_scatter_tensor.default, (xs[9], "sum", 4, "0"))),
    ]
    g.output(tuple(outs))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode()
    with mode:
        fake = [torch.empty(s) for s in shapes]
    FakeTensorProp(gm, mode).propagate(*fake)
    before = str(gm.graph)
    plan = bucketing.plan_buckets(gm.graph)
    # runs of one key only: another group, kind or op between closes a bucket (NOTE [buckets keep the
    # communication order])
    assert [[m.collective.args[0].name for m in b] for b in plan] == [["x0", "x1"], ["x4", "x5"]]
    assert bucketing.bucket_key(plan[0][0].collective)[:3] == ("all_gather", "0", 4)
    assert str(gm.graph) == before  # planning is pure, and gives the same plan every time
    assert [[m.collective for m in b] for b in bucketing.plan_buckets(gm.graph)] == [
        [m.collective for m in b] for b in plan
    ]

    real = [torch.randn(s) for s in shapes]
    expected = _SimulatedWorld(gm, 2, 4).run(*real)
    assert bucketing.bucket_collectives(gm.graph) == 2
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(c10d.all_gather_into_tensor.default) == 4  # the merged one, group "1", x3, x8
    assert targets.count(c10d.reduce_scatter_tensor.default) == 4  # the merged one, group "2", max, x9
    got = _SimulatedWorld(gm, 2, 4).run(*real)
    for o, e in zip(got, expected):
        assert o.shape == e.shape and o.is_contiguous() and torch.equal(o, e)


def test_non_contiguous_and_mismatched_dim_0_are_left_alone():
    from torch._subclasses.fake_tensor import FakeTensorMode

    c10d = torch.ops._c10d_functional
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    ag = g.call_function(c10d.all_gather_into_tensor.default, (x, 4, "0"))
    rs = g.call_function(c10d.reduce_scatter_tensor.default, (y, "sum", 4, "0"))
    g.output((g.call_function(c10d.wait_tensor.default, (ag,)), g.call_function(c10d.wait_tensor.default, (rs,))))
    with FakeTensorMode():
        x.meta["val"] = torch.empty(4, 6).t()  # not contiguous
        ag.meta["val"] = torch.empty(24, 4)
        y.meta["val"] = torch.empty(8, 3)
        rs.meta["val"] = torch.empty(8, 3)  # not dim-0 scatter semantics
    assert bucketing.bucket_key(ag) is None and bucketing.bucket_key(rs) is None
    with FakeTensorMode():
        x.meta["val"] = torch.empty(6, 4)
        rs.meta["val"] = torch.empty(2, 3)
    assert bucketing.bucket_key(ag) == ("all_gather", "0", 4, torch.float32)
    assert bucketing.bucket_key(rs) == ("reduce_scatter", "0", 4, "sum", torch.float32)


def _reduce_scatters_with_slices(sliced: list[int]) -> torch.fx.GraphModule:
    """Three reduce-scatters of FSDP2 gradients; member ``i`` in ``sliced`` is narrowed right after its wait.

    What Inductor leaves of an uneven shard: a real slice on a rank whose shard is
    short, nothing (a removed no-op) on a rank whose shard is whole.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    c10d = torch.ops._c10d_functional
    g = torch.fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(3)]
    outs = []
    for i, x in enumerate(xs):
        w = g.call_function(
            c10d.wait_tensor.default, (g.call_function(c10d.reduce_scatter_tensor.default, (x, "avg", 4, "0")),)
        )
        if i in sliced:  # a slice, or the backward of F.pad: a constant_pad_nd that only cuts
            cut = (
                (torch.ops.aten.slice.Tensor, (w, 0, 0, 1))
                if i % 2
                else (torch.ops.aten.constant_pad_nd.default, (w, [0, 0, 0, -1]))
            )
            w = g.call_function(*cut)
        outs.append(w)
    g.output(tuple(outs))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode()
    with mode:
        fake = [torch.empty(8, 3) for _ in range(3)]
    FakeTensorProp(gm, mode).propagate(*fake)
    return gm


def test_plan_is_the_same_whether_or_not_a_rank_slices_its_shard():
    """NOTE [rank-invariant first use]: an uneven shard's slice must not split one rank's bucket (a hang)."""
    whole, short = _reduce_scatters_with_slices([]), _reduce_scatters_with_slices([0, 1])

    def plan(gm):
        return [[m.collective.args[0].name for m in b] for b in bucketing.plan_buckets(gm.graph)]

    assert plan(whole) == plan(short) == [["x0", "x1", "x2"]]
    real = [torch.randn(8, 3) for _ in range(3)]
    expected = _SimulatedWorld(short, 1, 4).run(*real)
    assert bucketing.bucket_collectives(short.graph) == 2
    short.recompile()
    got = _SimulatedWorld(short, 1, 4).run(*real)
    assert all(torch.equal(o, e) for o, e in zip(got, expected))


def test_pass_uuids_cover_every_lowering_and_kernel_file(monkeypatch):
    """NOTE [pass identity covers the lowerings]: Inductor's cache key changes when a lowering or kernel does."""
    import os

    from dynamo_ext import node_origin
    from dynamo_ext._compat import inductor, symm_mem
    from dynamo_ext.fx import collectives, nodes
    from dynamo_ext.inductor_lowerings import bucketing, graph_edit, registry, rms_norm_fusion, rms_norm_lowering
    from dynamo_ext.inductor_lowerings.kernels import one_shot_all_reduce_rms_norm

    files = registry.package_sources()
    # The compatibility modules, FX reader and helpers the passes run are part of their identity too.
    for module in (
        rms_norm_lowering,
        one_shot_all_reduce_rms_norm,
        bucketing,
        rms_norm_fusion,
        inductor,
        symm_mem,
        graph_edit,
        collectives,
        nodes,
        node_origin,
    ):
        assert os.path.realpath(module.__file__) in files
    hashed = []
    real = _compat.hash_for_files
    monkeypatch.setattr(_compat, "hash_for_files", lambda paths, extra="": hashed.append(paths) or real(paths, extra))
    bucketing.AllReduceBucketingPass().uuid()
    rms_norm_fusion.ResidualRMSNormPass().uuid()
    assert hashed == [files, files]


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
def test_a_bucket_run_unmerged_lays_out_its_result_as_merged(kind, monkeypatch):
    """NOTE [buckets only where ranks agree]: the per-member collectives fill the merged result's layout."""
    from dynamo_ext.inductor_lowerings import bucket_op

    world = _SimulatedWorld(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), 2, 4)

    class Simulated:
        def __getattr__(self, name):
            op = getattr(torch.ops._c10d_functional, name).default
            return lambda *args: world.call_function(op, args, {})

    monkeypatch.setattr(bucket_op, "_c10d", Simulated)
    sizes = [6, 2, 10]  # all-reduce, all-gather: the members' elements; reduce-scatter: their chunks
    packed = torch.randn(4 * sum(sizes) if kind == "reduce_scatter" else sum(sizes))
    merged = bucket_op._merged(packed, kind, "sum", 4, "0")
    unmerged = bucket_op._unmerged(packed, kind, sizes, "sum", 4, "0")
    assert merged.shape == unmerged.shape and torch.allclose(merged, unmerged)
