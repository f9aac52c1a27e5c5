"""Batch-dim analysis (dynamo_ext.spmd.batch_dim) of make_fx graphs of training steps, on the fake process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from dynamo_ext.spmd.batch_dim import analyze_batch_dims, analyze_step


@pytest.fixture
def dp(world):
    return init_device_mesh("cpu", (4,))


def _grads_step(loss_fn):
    """forward + loss + backward (``autograd.grad``) as one function of (inputs..., params...)."""

    def step(*args):
        loss, params = loss_fn(*args)
        return (loss, *torch.autograd.grad(loss, params))

    return step


def _layouts(fn, args, dims, mesh):
    return analyze_batch_dims(make_fx(fn)(*args), args, dims, mesh)


def test_mlp_step_activations_follow_the_batch_loss_and_grads_are_partial(dp):
    def mlp(x, y, w1, w2):
        return F.mse_loss(F.relu(x @ w1) @ w2, y), (w1, w2)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)]
    args += [torch.randn(6, 5, generator=g, requires_grad=True), torch.randn(5, 3, generator=g, requires_grad=True)]
    layouts = _layouts(_grads_step(mlp), args, [0, 0, None, None], dp)
    assert [layouts[n] for n in ("mm", "relu", "mm_1")] == [Shard(0)] * 3  # activations: batch on dim 0
    assert layouts["output"] == (Partial("avg"), Partial("sum"), Partial("sum"))  # mean loss, summed grads
    assert [v for k, v in layouts.items() if k.startswith("t")].count(Shard(1)) == 2  # x.t() and relu.t()


def test_views_permutes_and_reductions(dp):
    def fn(x):
        heads = x.reshape(8, 2, 3).permute(1, 0, 2)  # the batch moves to dim 1
        return heads, heads.sum(2), x.sum(0), x.mean(), x.amax(1)

    layouts = _layouts(fn, [torch.randn(8, 6)], [0], dp)
    assert layouts["output"] == (Shard(1), Shard(1), Partial("sum"), Partial("avg"), Shard(0))


def test_attention_block_keeps_the_batch_through_heads(dp):
    def attention(x, wq, wk, wv):
        b, t, c = x.shape

        def heads(w):
            return (x @ w).reshape(b, t, 2, c // 2).transpose(1, 2)

        att = torch.softmax(heads(wq) @ heads(wk).transpose(-1, -2) / 2.0, dim=-1)
        y = (att @ heads(wv)).transpose(1, 2).reshape(b, t, c)
        return y.pow(2).mean(), (wq, wk, wv)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(4, 5, 8, generator=g)] + [torch.randn(8, 8, generator=g, requires_grad=True) for _ in range(3)]
    layouts = _layouts(_grads_step(attention), args, [0, None, None, None], dp)
    assert layouts["output"] == (Partial("avg"), Partial("sum"), Partial("sum"), Partial("sum"))
    assert layouts["_softmax"] == Shard(0)


def test_conv_net_step(dp):
    def conv(x, w, b):
        return F.conv2d(x, w, b, padding=1).relu().mean(), (w, b)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(8, 3, 6, 6, generator=g), torch.randn(4, 3, 3, 3, generator=g, requires_grad=True)]
    args.append(torch.randn(4, generator=g, requires_grad=True))
    layouts = _layouts(_grads_step(conv), args, [0, None, None], dp)
    assert layouts["convolution"] == Shard(0)
    assert layouts["output"][0] == Partial("avg") and all(p.is_partial() for p in layouts["output"][1:])


def test_parameters_alone_have_no_batch_dim(dp):
    layouts = _layouts(lambda x, w: (x * 2, w * 2), [torch.randn(8, 2), torch.randn(2)], [0, None], dp)
    assert layouts["output"] == (Shard(0), Replicate())


@pytest.mark.parametrize(
    "fn, node",
    [
        (lambda x: x.cumsum(0), "cumsum"),  # mixes samples
        (lambda x: x[0] * 2, "select"),  # one sample
        (lambda x: x.sort(0)[0], "sort"),
        (lambda x: x.reshape(6, 8), "view"),  # the batch split across dims unevenly
    ],
)
def test_node_without_a_batch_dim_is_named(dp, fn, node):
    with pytest.raises(ValueError, match=rf"the batch dim of node '{node}' \(%{node} : .*cannot be inferred"):
        _layouts(fn, [torch.randn(8, 6)], [0], dp)


def test_bad_arguments(dp):
    gm = make_fx(lambda x: x + 1)(torch.randn(8, 6))
    with pytest.raises(ValueError, match="got 1 example inputs and 2 batch dims for a graph of 1 placeholders"):
        analyze_batch_dims(gm, [torch.randn(8, 6)], [0, None], dp)
    with pytest.raises(ValueError, match=r"batch dim 2 of input 'x_1' is out of range for its shape \(8, 6\)"):
        analyze_batch_dims(gm, [torch.randn(8, 6)], [2], dp)
    with pytest.raises(ValueError, match="needs a 1-D data-parallel mesh"):
        analyze_batch_dims(gm, [torch.randn(8, 6)], [0], init_device_mesh("cpu", (2, 2)))


def test_step_analysis_records_where_gradients_are_read_whole_and_local_batch_reductions(dp):
    def step(x, y, w):
        loss = F.cross_entropy(x @ w, y)  # nll_loss's backward divides by the sample count: a local read
        (g,) = torch.autograd.grad(loss, [w])
        return w.detach().clone().sub_(0.1 * g)  # an in-place update reads the gradient whole: a reduction edge

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)]
    args.append(torch.randn(6, 3, generator=g, requires_grad=True))
    gm = make_fx(step)(*args)
    result = analyze_step(gm, args, [0, 0, None], dp)
    assert result.reduce_before == {"sub_": ["mul"]}
    assert list(result.local_reads) == ["nll_loss_backward"]
    assert result.layouts["mul"] == Partial("sum") and result.layouts["sub_"] == Replicate()
    with pytest.raises(ValueError, match="the batch dim of node 'nll_loss_backward'"):
        analyze_batch_dims(gm, args, [0, 0, None], dp)  # without reductions allowed: refused, named


def _classifier_step(loss_fn):
    """A step of a linear classifier: loss, its gradient, an SGD update (reads the gradient whole)."""

    def step(x, y, w):
        loss = loss_fn(x @ w, y)
        (g,) = torch.autograd.grad(loss, [w])
        return loss.detach(), w.detach().clone().sub_(0.1 * g)

    return step


def _classifier_args():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    return [x, y, torch.randn(6, 3, generator=g, requires_grad=True)]


@pytest.mark.parametrize(
    "loss_fn",
    [
        F.cross_entropy,
        lambda out, y: F.nll_loss(F.log_softmax(out, 1), y, weight=torch.tensor([1.0, 2.0, 0.5]), ignore_index=1),
    ],
)
def test_a_mean_nll_loss_is_each_ranks_local_mean(dp, loss_fn):
    # NOTE [local rules]: DDP's loss is each rank's weighted mean over its own samples (2.15's DTensor rule
    # gathers the batch for it); the total weight its backward divides by is each rank's own too.
    args = _classifier_args()
    gm = make_fx(_classifier_step(loss_fn))(*args)
    result = analyze_step(gm, args, [0, 0, None], dp)
    assert result.layouts["nll_loss_forward"] == (Partial("avg"), Partial("sum"))
    assert result.layouts["output"][0] == Partial("avg")
    assert list(result.local_reads) == ["nll_loss_backward"]
    assert list(result.reduce_before) == ["sub_"]  # only the update reads a reduction whole
    logits = [torch.randn(8, 3), args[1]]
    forward = make_fx(lambda out, y: loss_fn(out, y))(*logits)  # no backward: no local read, so strict mode too
    assert analyze_batch_dims(forward, logits, [0, 0], dp)["output"] == Partial("avg")


def test_label_smoothing_divides_by_each_ranks_own_count(dp):
    # cross_entropy's smoothing term is a sum over the samples divided by the count of those not ignored,
    # forward and backward: each rank's own count, as under DDP (a local read), not the full-batch one.
    args = _classifier_args()
    gm = make_fx(_classifier_step(lambda out, y: F.cross_entropy(out, y, ignore_index=0, label_smoothing=0.1)))(*args)
    result = analyze_step(gm, args, [0, 0, None], dp)
    divs = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.div.Tensor and n.name in result.local_reads]
    assert len(divs) == 2, result.local_reads
    assert all(result.layouts[d] == Partial("avg") for d in divs)
    assert result.layouts["output"][0] == Partial("avg")
    assert list(result.reduce_before) == ["sub_"]
    with pytest.raises(ValueError, match=r"the batch dim of node 'div' .*needs communication"):
        analyze_batch_dims(gm, args, [0, 0, None], dp)  # a local read: refused without reductions allowed


def test_one_hot_label_check_is_each_ranks_own(dp):
    # F.one_hot checks its labels with aten.all and _assert_async: each rank checks its own (2.15's DTensor
    # gathers the batch for all, 2.13's has no rule for _assert_async).
    args = _classifier_args()
    step = _classifier_step(lambda out, y: F.mse_loss(out, F.one_hot(y, 3).float()))
    gm = make_fx(step, tracing_mode="symbolic")(*args)  # symbolic, as data_parallel traces: the checks are asserts
    result = analyze_step(gm, args, [0, 0, None], dp)
    assert [result.layouts[n] for n in ("all_1", "all_2")] == [Partial("min")] * 2
    assert result.layouts["output"][0] == Partial("avg")
    assert list(result.reduce_before) == ["sub_"]
    assert result.local_reads == {"_assert_async": ["all_1"], "_assert_async_1": ["all_2"]}  # no all-reduce


@pytest.mark.parametrize(
    ("reduction", "layout"), [("mean", Partial("avg")), ("sum", Partial("sum")), ("none", Shard(0))]
)
def test_binary_cross_entropy_with_logits_is_each_ranks_own(dp, reduction, layout):
    # DTensor has no rule for it (2.13, 2.15); each rank's loss is the one of its own samples, as under DDP.
    def loss_fn(out, y):
        target = F.one_hot(y, 3).float()
        return F.binary_cross_entropy_with_logits(out, target, pos_weight=torch.ones(3), reduction=reduction)

    args = _classifier_args()
    step = _classifier_step(lambda out, y: loss_fn(out, y).sum() if reduction == "none" else loss_fn(out, y))
    gm = make_fx(step, tracing_mode="symbolic")(*args)
    result = analyze_step(gm, args, [0, 0, None], dp)
    assert result.layouts["binary_cross_entropy_with_logits"] == layout
    assert list(result.reduce_before) == ["sub_"]


def test_a_value_computed_from_a_gradient_is_never_read_locally(dp):
    # NOTE [local rules]: a sum divided by a sum over the batch is each rank's own mean, except where the sum is
    # a gradient's (here an update normalized by the gradient's sum): DDP's optimizer reads the averaged gradient.
    def step(x, y, w):
        loss = F.mse_loss(x @ w, y)
        (g,) = torch.autograd.grad(loss, [w])
        return w.detach().clone().sub_(0.1 * g / g.sum())

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)]
    args.append(torch.randn(6, 3, generator=g, requires_grad=True))
    gm = make_fx(step)(*args)
    grad = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.default).args[0]
    assert "div" in analyze_step(gm, args, [0, 0, None], dp).local_reads  # a loss's mean: read locally
    result = analyze_step(gm, args, [0, 0, None], dp, gradients=[grad])
    div = next(n for n in gm.graph.nodes if n.name == "div")
    assert "div" not in result.local_reads  # both of its gradient-made inputs reduced first: the average
    assert set(result.reduce_before["div"]) == {a.name for a in div.args} == {"mul", "sum_1"}
