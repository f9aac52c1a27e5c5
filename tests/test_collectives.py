"""c10d collectives on the fake process group (one process, rank 0 of 4).

What each ``torch.distributed`` call traces to, where the wait of an
``async_op=True`` call lands in the graph, the Work object, the backward of
``torch.distributed.nn.functional``, graph-break messages and bad input.
Numerics against eager are in ``test_collectives_gloo.py``.
"""

from __future__ import annotations

import datetime
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from expecttest import assert_expected_inline
from helpers import CountingBackend, fake_world, normalize_gm
from torch._dynamo.exc import Unsupported
from torch.testing import FileCheck

WORLD = 4
ME = 0  # the fake world's rank
P2P = {"isend_irecv", "batch_isend_irecv", "send_recv", "isend", "irecv", "send", "recv_ignored"}


def params(table: dict) -> list:
    """The names of ``table`` as pytest params; P2P ones skip on builds without functional P2P ops."""
    from dynamo_ext import _compat

    no_p2p = pytest.mark.skipif(
        not _compat.has_functional_op("isend"), reason="no functional P2P ops in this torch build (P2P graph-breaks)"
    )
    return [pytest.param(name, marks=no_p2p) if name in P2P else name for name in table]


def compile_one(fn, *args, dynamic=None):
    """Compile ``fn`` with fullgraph=True, run it; return (output, the one graph)."""
    backend = CountingBackend()
    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    assert backend.frame_count == 1
    return out, backend.graphs[0]


def collective_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The ``_c10d_functional`` ops of ``gm``, in graph order, by name."""
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    return [n.split("_c10d_functional.")[1].split(".")[0] for n in names if "_c10d_functional." in n]


def _rows(x):
    return list(x.view(WORLD, -1).unbind(0))


# ---- what each call traces to -----------------------------------------------------
def _p2p_ring(x):
    y = torch.empty_like(x)
    s = dist.isend(x, 1)
    r = dist.irecv(y, WORLD - 1)
    s.wait()
    r.wait()
    return y


def _batch(x):
    y = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, y, WORLD - 1)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return y


def _send_recv(x):
    dist.send(x, 1)
    return dist.recv(torch.empty_like(x), 2)


TRACES = {
    "all_reduce": (lambda x: dist.all_reduce(x.clone()), ["all_reduce", "wait_tensor"]),
    "all_reduce_max": (lambda x: dist.all_reduce(x.clone(), op=dist.ReduceOp.MAX), ["all_reduce", "wait_tensor"]),
    "all_gather_into_tensor": (
        lambda x: dist.all_gather_into_tensor(x.new_empty(WORLD * 8), x),
        ["all_gather_into_tensor", "wait_tensor"],
    ),
    "all_gather_into_tensor_stacked": (
        lambda x: dist.all_gather_into_tensor(x.new_empty(WORLD, 8), x),
        ["all_gather_into_tensor", "wait_tensor"],
    ),
    "reduce_scatter_tensor": (
        lambda x: dist.reduce_scatter_tensor(x.new_empty(2), x),
        ["reduce_scatter_tensor", "wait_tensor"],
    ),
    "all_to_all_single": (
        lambda x: dist.all_to_all_single(torch.empty_like(x), x),
        ["all_to_all_single", "wait_tensor"],
    ),
    "all_to_all_single_uneven": (
        lambda x: dist.all_to_all_single(x.new_empty(4), x, [1, 1, 1, 1], [2, 2, 2, 2]),
        ["all_to_all_single", "wait_tensor"],
    ),
    "all_gather": (
        lambda x: dist.all_gather([torch.empty_like(x) for _ in range(WORLD)], x),
        ["all_gather_into_tensor", "wait_tensor"],
    ),
    "reduce_scatter": (
        lambda x: dist.reduce_scatter(x.new_empty(2), _rows(x)),
        ["reduce_scatter_tensor", "wait_tensor"],
    ),
    "all_to_all": (
        lambda x: dist.all_to_all([x.new_empty(2) for _ in range(WORLD)], _rows(x)),
        ["all_to_all_single", "wait_tensor"],
    ),
    "all_reduce_coalesced": (
        lambda x: dist.all_reduce_coalesced([x.clone(), x * 2]),
        ["all_reduce_coalesced", "wait_tensor", "wait_tensor"],
    ),
    "broadcast": (lambda x: dist.broadcast(x.clone(), src=1), ["broadcast", "wait_tensor"]),
    "broadcast_group_src": (lambda x: dist.broadcast(x.clone(), group_src=2), ["broadcast", "wait_tensor"]),
    "barrier": (lambda x: dist.barrier(), ["all_reduce", "wait_tensor"]),
    "scatter_root": (lambda x: dist.scatter(x.new_empty(2), _rows(x), src=ME), ["all_to_all_single", "wait_tensor"]),
    "scatter_leaf": (lambda x: dist.scatter(x.new_empty(2), None, src=1), ["all_to_all_single", "wait_tensor"]),
    "gather_root": (
        lambda x: dist.gather(x, [torch.empty_like(x) for _ in range(WORLD)], dst=ME),
        ["all_to_all_single", "wait_tensor"],
    ),
    "gather_leaf": (lambda x: dist.gather(x, dst=3), ["all_to_all_single", "wait_tensor"]),
    "reduce": (lambda x: dist.reduce(x.clone(), dst=1), ["all_reduce", "wait_tensor"]),
    "isend_irecv": (_p2p_ring, ["isend", "irecv", "wait_tensor", "wait_tensor"]),
    "batch_isend_irecv": (_batch, ["batch_p2p_ops", "wait_tensor", "wait_tensor"]),
    "send_recv": (_send_recv, ["isend", "wait_tensor", "irecv", "wait_tensor"]),
    "nn.all_reduce": (lambda x: dist_nn.all_reduce(x), ["all_reduce", "wait_tensor"]),
    "nn.all_gather": (lambda x: dist_nn.all_gather(x), ["all_gather_into_tensor", "wait_tensor"]),
    "nn.reduce_scatter": (
        lambda x: dist_nn.reduce_scatter(x.new_empty(2), _rows(x)),
        ["reduce_scatter_tensor", "wait_tensor"],
    ),
    "nn.all_to_all": (
        lambda x: dist_nn.all_to_all([x.new_empty(2) for _ in range(WORLD)], _rows(x)),
        ["all_to_all_single", "wait_tensor"],
    ),
    "nn.all_to_all_single": (
        lambda x: dist_nn.all_to_all_single(torch.empty_like(x), x),
        ["all_to_all_single", "wait_tensor"],
    ),
    "nn.broadcast": (lambda x: dist_nn.broadcast(x, src=1), ["broadcast", "wait_tensor"]),
    "nn.reduce": (lambda x: dist_nn.reduce(x, dst=1), ["all_reduce", "wait_tensor"]),
    "nn.gather": (lambda x: dist_nn.gather(x, dst=1), ["all_to_all_single", "wait_tensor"]),
    "nn.scatter": (lambda x: dist_nn.scatter(_rows(x), src=1), ["all_to_all_single", "wait_tensor"]),
}


@pytest.mark.parametrize("name", params(TRACES))
def test_call_traces_to_functional_collectives(world, name):
    fn, ops = TRACES[name]
    _, gm = compile_one(fn, torch.arange(8.0))
    assert collective_ops(gm) == ops


def test_outside_the_group_is_eager_none_without_communication(world):
    sub = dist.new_group([2, 3])  # rank 0 is not a member: eager returns None and leaves y alone

    def fn(x):
        y = x.clone()
        return y, dist.all_reduce(y, group=sub), dist.broadcast(y, group=sub, group_src=0, async_op=True)

    (y, r1, r2), gm = compile_one(fn, torch.arange(4.0))
    assert (r1, r2) == (None, None) and torch.equal(y, torch.arange(4.0))
    assert collective_ops(gm) == []


def test_subgroup_names_its_group_and_converts_global_ranks(world):
    sub = dist.new_group([0, 2])

    def fn(x):
        dist.broadcast(x, src=2, group=sub)  # global rank 2 is group rank 1
        return x

    _, gm = compile_one(fn, torch.arange(4.0))
    FileCheck().check(f"_c10d_functional.broadcast(l_x_, 1, '{sub.group_name}')").run(gm.code)


# ---- async_op=True: the wait lands where the user waits ---------------------------------
def test_async_all_reduce_graph(world):
    def fn(x):
        y = x.clone()
        work = dist.all_reduce(y, async_op=True)
        z = x * 3  # overlaps with the collective
        before = work.is_completed()
        work.wait()
        return y + z, before, work.is_completed()

    (_, before, after), gm = compile_one(fn, torch.arange(4.0))
    assert (before, after) == (False, True)
    assert_expected_inline(
        normalize_gm(gm.print_readable(False)),
        """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4]"):
        l_x_ = L_x_

        y: "f32[4]" = l_x_.clone()

        out: "f32[4]" = torch.ops._c10d_functional.all_reduce(y, 'sum', '<group>')

        z: "f32[4]" = l_x_ * 3;  l_x_ = None

        result: "f32[4]" = torch.ops._c10d_functional.wait_tensor(out);  out = None

        copy_: "f32[4]" = y.copy_(result);  result = copy_ = None

        add: "f32[4]" = y + z;  y = z = None
        return (add,)
""",  # noqa: B950
    )


ASYNC = {
    "all_reduce": (lambda x: dist.all_reduce(x, async_op=True), "all_reduce"),
    "all_gather_into_tensor": (
        lambda x: dist.all_gather_into_tensor(x.new_empty(WORLD * 8), x, async_op=True),
        "all_gather_into_tensor",
    ),
    "reduce_scatter_tensor": (
        lambda x: dist.reduce_scatter_tensor(x.new_empty(2), x, async_op=True),
        "reduce_scatter_tensor",
    ),
    "all_to_all_single": (
        lambda x: dist.all_to_all_single(torch.empty_like(x), x, async_op=True),
        "all_to_all_single",
    ),
    "all_gather": (
        lambda x: dist.all_gather([torch.empty_like(x) for _ in range(WORLD)], x, async_op=True),
        "all_gather_into_tensor",
    ),
    "reduce_scatter": (
        lambda x: dist.reduce_scatter(x.new_empty(2), _rows(x), async_op=True),
        "reduce_scatter_tensor",
    ),
    "all_to_all": (
        lambda x: dist.all_to_all([x.new_empty(2) for _ in range(WORLD)], _rows(x), async_op=True),
        "all_to_all_single",
    ),
    "broadcast": (lambda x: dist.broadcast(x, src=1, async_op=True), "broadcast"),
    "barrier": (lambda x: dist.barrier(async_op=True), "all_reduce"),
    "scatter": (lambda x: dist.scatter(x.new_empty(2), _rows(x), src=ME, async_op=True), "all_to_all_single"),
    "gather": (lambda x: dist.gather(x, dst=1, async_op=True), "all_to_all_single"),
    "reduce": (lambda x: dist.reduce(x, dst=ME, async_op=True), "all_reduce"),
    "isend": (lambda x: dist.isend(x, 1), "isend"),
    "irecv": (lambda x: dist.irecv(x, src=1), "irecv"),
}


@pytest.mark.parametrize("name", params(ASYNC))
def test_compute_between_call_and_wait_sits_between_collective_and_wait(world, name):
    start, op = ASYNC[name]

    def fn(x):
        work = start(x)
        marker = x.sin()
        assert work.wait() is True
        return marker + 1

    _, gm = compile_one(fn, torch.arange(8.0))
    FileCheck().check(f"_c10d_functional.{op}(").check("sin").check("wait_tensor").check_not("sin").run(gm.code)


def test_work_api(world):
    def fn(x):
        y = x.clone()
        work = dist.all_gather([torch.empty_like(x) for _ in range(WORLD)], y, async_op=True)
        done = (work.is_completed(), work.is_success(), work.exception())
        result = work.result()  # waits first, as eager's result() hands back ready tensors
        return done, result, work.is_completed(), repr(work)

    (done, result, completed, text), gm = compile_one(fn, torch.arange(2.0))
    assert done == (False, False, None) and completed and len(result) == WORLD
    assert text == "FunctionalWork(1 collective(s), completed)"
    assert collective_ops(gm) == ["all_gather_into_tensor", "wait_tensor"]


def test_work_returned_unwaited_waits_after_the_graph(world):
    def fn(x):
        y = x.clone()
        return y, dist.all_reduce(y, async_op=True)

    (y, work), gm = compile_one(fn, torch.arange(4.0))
    assert collective_ops(gm) == ["all_reduce"]  # wait_tensor runs eagerly, below
    assert not work.is_completed()
    assert work.wait() is True and work.is_completed()


# ---- torch.distributed.nn.functional: backward graphs -----------------------------------
NN_BACKWARD = {
    "all_reduce": (lambda t: dist_nn.all_reduce(t), ["all_reduce", "wait_tensor"]),
    "all_gather": (lambda t: dist_nn.all_gather(t), ["reduce_scatter_tensor", "wait_tensor"]),
    "reduce_scatter": (
        lambda t: dist_nn.reduce_scatter(t.new_empty(2), _rows(t)),
        ["all_gather_into_tensor", "wait_tensor"],
    ),
    "all_to_all_single": (
        lambda t: dist_nn.all_to_all_single(t.new_empty(4), t, [1, 1, 1, 1], [2, 2, 2, 2]),
        ["all_to_all_single", "wait_tensor"],
    ),
    "broadcast": (lambda t: dist_nn.broadcast(t, src=1), ["all_reduce", "wait_tensor"]),
    "reduce": (lambda t: dist_nn.reduce(t, dst=1), ["broadcast", "wait_tensor"]),
    "gather": (lambda t: dist_nn.gather(t, dst=1), ["all_to_all_single", "wait_tensor"]),
    "scatter": (lambda t: dist_nn.scatter(_rows(t), src=1), ["all_to_all_single", "wait_tensor"]),
}


def training_graphs(fn, x):
    """Forward and backward graphs of ``fn`` as the ``aot_eager`` backend partitions them, with Inductor's decompositions.

    The default partitioner rebuilds each graph from its outputs (NOTE [keep-alive] in
    dynamo_ext/variables/c10d/work.py); the decompositions turn ``new_zeros(t)`` into ``full``.
    """
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=capture,
        bw_compiler=capture,
        decompositions=select_decomp_table(),
    )
    out = torch.compile(fn, backend=backend, fullgraph=True)(x)
    sum(t.sum() for t in (out if isinstance(out, tuple) else (out,))).backward()
    return graphs


@pytest.mark.parametrize("name", params(NN_BACKWARD))
def test_nn_functional_backward_is_a_collective(world, name):
    fn, backward_ops = NN_BACKWARD[name]
    x = torch.arange(8.0, requires_grad=True)
    graphs = training_graphs(fn, x)
    assert len(graphs) == 2 and x.grad is not None and x.grad.shape == x.shape
    assert collective_ops(graphs[1]) == backward_ops


# Calls whose result this rank (0) does not use: the partitioner must keep them, or the ranks that do use it hang.
UNUSED_HERE = {
    "barrier": (lambda t: (dist.barrier(), t * 2)[1], "all_reduce", 0),
    "send": (lambda t: (dist.send(t.detach(), 1), t * 2)[1], "isend", 0),
    "recv_ignored": (lambda t: (dist.recv(torch.empty(8), 1), t * 2)[1], "irecv", 0),
    "gather_leaf": (lambda t: (dist.gather(t.detach(), dst=1), t * 2)[1], "all_to_all_single", 0),
    "reduce_leaf": (lambda t: (dist.reduce(t.detach().clone(), dst=1), t * 2)[1], "all_reduce", 0),
    "broadcast_root": (lambda t: (dist.broadcast(t.detach().clone(), src=ME), t * 2)[1], "broadcast", 0),
    "nn.gather_leaf": (lambda t: dist_nn.gather(t, dst=1), "all_to_all_single", 0),
    "nn.reduce_leaf": (lambda t: dist_nn.reduce(t, dst=1), "all_reduce", 0),
    "nn.broadcast_leaf_backward": (lambda t: dist_nn.broadcast(t, src=1), "all_reduce", 1),
    "nn.scatter_leaf_backward": (lambda t: dist_nn.scatter(_rows(t), src=1), "all_to_all_single", 1),
}


@pytest.mark.parametrize("name", params(UNUSED_HERE))
def test_collective_unused_on_this_rank_survives_partitioning(world, name):
    fn, op, graph = UNUSED_HERE[name]
    graphs = training_graphs(fn, torch.arange(8.0, requires_grad=True))
    assert op in collective_ops(graphs[graph]) and "wait_tensor" in collective_ops(graphs[graph])


def test_polyfills_take_the_arguments_of_the_calls_they_replace():
    from dynamo_ext.variables.c10d import handlers, nn_functional, p2p

    tables = [("torch.distributed", handlers.POLYFILLS), ("torch.distributed", p2p.POLYFILLS)]
    tables.append(("torch.distributed.nn.functional", nn_functional.POLYFILLS))
    for module, table in tables:
        for name, impl, _ in table:
            fn = getattr(__import__(module, fromlist=[name]), name, None)
            if fn is None:
                continue
            expected = list(inspect.signature(fn).parameters)
            got = inspect.signature(impl).parameters
            # The same parameters in the same order; extra ones (from newer releases) have defaults.
            assert [p for p in got if p in expected] == expected, f"{module}.{name}"
            assert all(got[p].default is not inspect.Parameter.empty for p in got if p not in expected)


# ---- graph breaks -----------------------------------------------------------------
TD = datetime.timedelta(seconds=5)

BREAKS = {
    "all_gather_object": (
        lambda x: dist.all_gather_object([None] * WORLD, 1),
        r"dynamo_ext: object collective(.|\n)*all_gather_object\(\.\.\.\)",
    ),
    "broadcast_object_list": (
        lambda x: dist.broadcast_object_list([1], src=0),
        r"dynamo_ext: object collective(.|\n)*broadcast_object_list",
    ),
    "gather_object": (lambda x: dist.gather_object(1, None, dst=1), r"object collective(.|\n)*gather_object"),
    "scatter_object_list": (
        lambda x: dist.scatter_object_list([None], None, src=1),
        r"object collective(.|\n)*scatter_object_list",
    ),
    "new_group": (lambda x: dist.new_group([0, 1]), r"process group creation(.|\n)*Create groups and meshes once"),
    "new_subgroups": (lambda x: dist.new_subgroups(2), r"process group creation(.|\n)*new_subgroups"),
    "init_process_group": (
        lambda x: dist.init_process_group("gloo"),
        r"process group creation(.|\n)*init_process_group",
    ),
    "destroy_process_group": (lambda x: dist.destroy_process_group(), r"creation(.|\n)*destroy_process_group"),
    "monitored_barrier": (
        lambda x: dist.monitored_barrier(),
        r"collective without a functional counterpart(.|\n)*dist.barrier\(\) traces(.|\n)*monitored_barrier",
    ),
    "premul_sum": (
        lambda x: dist.all_reduce(x, op=PREMUL),
        r"unsupported collective arguments(.|\n)*Functional collectives take ReduceOp.SUM(.|\n)*dist.all_reduce\(op=",
    ),
    "barrier_timeout": (lambda x: dist.barrier(timeout=TD), r"dist.barrier\(timeout=\.\.\.\): a per-call timeout"),
    "uneven_all_gather": (
        lambda x: dist.all_gather([x.new_empty(8)] * 3 + [x.new_empty(2)], x),
        r"unsupported collective arguments(.|\n)*dist.all_gather: tensors of different sizes",
    ),
    "recv_any_source": (lambda x: dist.irecv(x), r"without a functional counterpart(.|\n)*any source"),
    "get_future": (
        lambda x: dist.all_reduce(x, async_op=True).get_future(),
        r"Work.get_future\(\): a future cannot be recorded",
    ),
}
PREMUL = None


@pytest.mark.parametrize("name", params(BREAKS))
def test_untraceable_call_is_a_graph_break_that_names_it(world, name):
    global PREMUL
    PREMUL = dist._make_nccl_premul_sum(2.0)
    if name == "barrier_timeout" and "timeout" not in inspect.signature(dist.barrier).parameters:
        pytest.skip("dist.barrier has no timeout on this release")
    fn, message = BREAKS[name]
    with pytest.raises(Unsupported, match=message):
        torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(8))


def test_rank_from_tensor_data_is_a_graph_break(world):
    def fn(x):
        dist.broadcast(x, src=x.shape[0] - 8)
        return x

    x = torch.ones(9)
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(Unsupported, match=r"non-constant distributed argument(.|\n)*dist.broadcast\(src="):
        torch.compile(fn, backend="eager", fullgraph=True)(x)


def test_without_functional_p2p_ops_p2p_is_a_graph_break(monkeypatch):
    import dynamo_ext
    from dynamo_ext import _compat

    real = _compat.has_functional_op
    monkeypatch.setattr(
        _compat, "has_functional_op", lambda op: op not in {"isend", "irecv", "batch_p2p_ops"} and real(op)
    )
    with fake_world(WORLD):
        dynamo_ext.install()
        try:
            for fn in (lambda x: dist.isend(x, 1), lambda x: dist.recv(x, 1), lambda x: dist.P2POp(dist.isend, x, 1)):
                torch._dynamo.reset()
                with pytest.raises(Unsupported, match=r"point-to-point ops unavailable(.|\n)*lacks torch.ops"):
                    torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2))
            assert compile_one(lambda x: dist.all_reduce(x), torch.ones(2))  # the rest still traces
        finally:
            dynamo_ext.uninstall()


def test_uninstall_removes_the_handlers(world):
    import dynamo_ext
    from dynamo_ext.variables import registry

    assert registry.lookup(dist.broadcast) is not None
    dynamo_ext.uninstall()
    assert registry.lookup(dist.broadcast) is None and registry.lookup(dist_nn.all_reduce) is None
    dynamo_ext.install()  # the fixture uninstalls


# ---- bad input: eager's exception ------------------------------------------------------
BAD = {
    "broadcast_src_twice": (lambda x: dist.broadcast(x, src=0, group_src=0), ValueError, "Can't specify both"),
    "a2a_split_count": (
        lambda x: dist.all_to_all_single(x.new_empty(4), x[:4], [1, 1, 1, 1], [1, 1, 2]),
        RuntimeError,
        "Number of tensor splits not equal to group size",
    ),
    "scatter_root_without_list": (
        lambda x: dist.scatter(x, None, src=ME),
        ValueError,
        "``scatter_list`` must be specified on source rank",
    ),
    "gather_list_on_leaf": (
        lambda x: dist.gather(x, [torch.empty_like(x)], dst=1),
        ValueError,
        "``gather_list`` must NOT be specified on non-destination ranks",
    ),
}


@pytest.mark.parametrize("name", params(BAD))
def test_bad_input_raises_what_eager_raises(world, name):
    fn, exc, message = BAD[name]
    try:
        fn(torch.ones(8))
    except exc as e:
        eager = e
    else:
        pytest.skip("this release's fake process group accepts it (a real backend raises)")
    assert message in str(eager)
    with pytest.raises(exc) as compiled:
        torch.compile(fn, backend="eager")(torch.ones(8))
    assert str(compiled.value) == str(eager)
    torch._dynamo.reset()
    with pytest.raises(Unsupported, match=message):  # fullgraph: Dynamo's report names the error
        torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(8))


def test_wrong_output_size_raises_runtime_error_at_trace_time(world):
    def fn(x):
        dist.all_gather_into_tensor(x.new_empty(7), x)

    message = r"RuntimeError(.|\n)*dist.all_gather_into_tensor: output_tensor has 7 elements, expected 32"
    with pytest.raises(Unsupported, match=message):
        torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(8))
