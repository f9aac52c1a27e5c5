"""data_parallel on the fake process group: bucket split for overlap, no recompile for a new batch size, errors.

Numerics against DDP are in tests/test_spmd_data_parallel_gloo.py; here the
collectives return garbage, so only graphs, compile counts and messages are checked.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F
from dp_models import build, local_part, make_step
from helpers import CountingBackend
from torch.distributed.device_mesh import init_device_mesh

from dynamo_ext.node_origin import user_frame
from dynamo_ext.spmd import data_parallel, overlap

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
COMPUTE = {aten.mm.default, aten.addmm.default, aten.convolution_backward.default}


@pytest.fixture
def dp(world):
    return init_device_mesh("cpu", (4,))


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_each_bucket_all_reduce_is_issued_before_the_next_buckets_backward(dp):
    # MLP gradients in backward order: head (512 + 16 bytes), net.2 (4096 + 128), net.0 (2048 + 128).
    # DDP's rule with a 500-byte first bucket and a 4000-byte cap: three buckets of two gradients each.
    model, data = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counting = CountingBackend("aot_eager")
    step = data_parallel(
        make_step("mlp"), dp, backend=counting, first_bucket_mb=500 / 2**20, bucket_cap_mb=4000 / 2**20
    )
    step(model, opt, *(local_part(t, 0, 4) for t in data(16, 0)))
    entry = step.compiled[0]
    assert [len(b.members) for b in entry.buckets] == [2, 2, 2]
    assert [b.nbytes for b in entry.buckets] == [528, 4224, 2176]
    # inductor_lowerings' bucketing merged each bucket into one all-reduce of a packed (cat) buffer
    for b in entry.buckets:
        assert len(b.collectives) == 1 and b.collectives[0].args[0].target is aten.cat.default
    # the split: one submodule per bucket, then the optimizer; Dynamo compiled them in call order
    graphs = counting.graphs
    assert len(graphs) == len(entry.buckets) + 1
    for k in range(len(entry.buckets)):
        ops = _targets(graphs[k])
        assert c10d.all_reduce.default in ops and c10d.wait_tensor.default not in ops
        last_compute = max(i for i, t in enumerate(ops) if t in COMPUTE)
        last_all_reduce = max(i for i, t in enumerate(ops) if t is c10d.all_reduce.default)
        assert last_compute < last_all_reduce  # the bucket's all-reduce is issued once its gradients are computed
        if k + 1 < len(entry.buckets):  # ... and the next bucket's backward runs while it is in flight
            assert any(t in COMPUTE for t in _targets(graphs[k + 1]))
    # the returned loss.detach() (made after the optimizer step) is averaged as soon as the loss exists
    assert _targets(graphs[0]).count(c10d.all_reduce.default) == 2
    last = _targets(graphs[-1])  # the waits, then the optimizer's update
    assert c10d.all_reduce.default not in last
    assert last.index(c10d.wait_tensor.default) < last.index(aten.add_.Tensor)
    split_ops = [n.target for n in entry.split.graph.nodes]
    assert c10d.wait_tensor.default not in split_ops and c10d.all_reduce.default not in split_ops
    assert all(p.grad is not None for p in model.parameters())


def test_a_new_batch_size_equal_to_a_static_size_does_not_recompile(dp):
    # 3 samples per rank and 3 input channels: with duck shapes Dynamo would give both one symbol
    model, data = build("conv")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    counting = CountingBackend("aot_eager")
    step = data_parallel(make_step("conv"), dp, backend=counting)
    frames = []
    for i, n in enumerate((16, 12, 8)):
        step(model, opt, *(local_part(t, 0, 4) for t in data(n, i)))
        opt.zero_grad()
        frames.append(counting.frame_count)
    assert len(step.compiled) == 2  # step 1 creates the momentum buffers; steps 2 and 3 share a trace
    assert frames[2] == frames[1] > frames[0]


def _mlp_step_with(extra):
    def step(model, opt, x, y):
        loss = F.mse_loss(extra(model(x)), y)
        loss.backward()
        opt.step()
        return loss

    return step


def test_batch_dim_that_cannot_be_inferred_names_the_node(dp):
    model, data = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = data_parallel(_mlp_step_with(lambda out: out.cumsum(0)), dp, backend=None)
    with pytest.raises(ValueError, match=r"the batch dim of node 'cumsum' \(%cumsum : .*\) cannot be inferred"):
        step(model, opt, *data(8, 0))


def test_bad_calls(dp):
    model, data = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(8, 0)
    with pytest.raises(ValueError, match="needs a 1-D data-parallel DeviceMesh"):
        data_parallel(make_step("mlp"), init_device_mesh("cpu", (2, 2)))
    step = data_parallel(make_step("mlp"), dp, backend=None)
    with pytest.raises(ValueError, match=r"tensor argument 0 has 1 sample\(s\) on its batch dim 0"):
        step(model, opt, x[:1], y[:1])
    with pytest.raises(ValueError, match="batch_dim 2 is out of range for tensor argument 0 of shape"):
        data_parallel(make_step("mlp"), dp, batch_dim=2, backend=None)(model, opt, x, y)
    with pytest.raises(ValueError, match="batch_dim has 1 entries but the step got 2 tensor arguments"):
        data_parallel(make_step("mlp"), dp, batch_dim=[0], backend=None)(model, opt, x, y)
    next(model.parameters()).grad = torch.zeros(32, 16)
    with pytest.raises(ValueError, match=r"already has a .grad when the data-parallel step starts.*zero_grad"):
        step(model, opt, x, y)
    opt.zero_grad()
    item = data_parallel(_mlp_step_with(lambda out: out * float(out.detach().sum())), dp, backend=None)
    with pytest.raises(ValueError, match=r"could not trace the step into one graph .*\.item\(\)"):
        item(model, opt, x, y)
    other = torch.optim.SGD(build("mlp")[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="holds a parameter of shape .* that belongs to no module passed to the step"):
        step(model, other, x, y)


class _RaisingBackend:
    """A backend whose compiled graphs raise when they run (as a failed collective check or a timeout does)."""

    def __call__(self, gm, example_inputs):
        def run(*args):
            raise RuntimeError("the compiled graph failed while it ran")

        return run


@pytest.mark.parametrize("split", [True, False])
def test_an_error_raised_by_a_compiled_graph_reaches_the_caller_as_itself(dp, split):
    # Compiling the GraphModule with fullgraph=True let FX's call wrapper format the error with a generator
    # inside Dynamo's frame hook: every error became "Unsupported: Attempt to trace generator".
    model, data = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = data_parallel(make_step("mlp"), dp, backend=_RaisingBackend(), split=split)
    with pytest.raises(RuntimeError, match="^the compiled graph failed while it ran$"):
        step(model, opt, *(local_part(t, 0, 4) for t in data(16, 0)))


def test_compiled_code_is_named_after_its_content(dp):
    # NOTE [rank-invariant names for the step's code]: the collective check compares where each collective is
    # issued. FX's <eval_with_key>.N counts this process's generated modules, a count that differs between
    # ranks after a rank-local recompile; a name made from the code is the same on every rank that has it.
    model, data = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counting = CountingBackend("aot_eager")
    step = data_parallel(make_step("mlp"), dp, backend=counting)
    torch.fx.symbolic_trace(torch.nn.Identity())  # moves FX's counter on, as a recompile on this rank only does
    step(model, opt, *(local_part(t, 0, 4) for t in data(16, 0)))
    subs = overlap.submodule_calls(step.compiled[0].split)
    expected = {
        f"<data_parallel {name} {hashlib.sha1(sub.graph_module.code.encode()).hexdigest()[:16]}>" for name, sub in subs
    }
    issued_at = {
        user_frame(n.meta["stack_trace"])[0]
        for g in counting.graphs
        for n in g.graph.nodes
        if n.target is c10d.all_reduce.default
    }
    assert issued_at and issued_at <= expected, (issued_at, expected)
