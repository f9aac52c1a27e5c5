"""data_parallel keeps its contract or refuses, on the fake process group: guards, refusals and their messages.

Numbers against DDP are in tests/test_spmd_data_parallel_contract_gloo.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from dp_models import build, local_part, make_step
from torch.distributed.device_mesh import init_device_mesh

from dynamo_ext.spmd import data_parallel


@pytest.fixture
def dp(world):
    return init_device_mesh("cpu", (4,))


def _step(loss_of, returns=None, *, sched=None):
    def step(model, opt, x, y):
        out = model(x)
        loss = loss_of(model, out, y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        return loss.detach() if returns is None else returns(out.detach(), y)

    return step


def _mse(model, out, y):
    return F.mse_loss(out, y)


def _mlp(lr=0.1, optimizer=torch.optim.SGD):
    model, data = build("mlp")
    return model, optimizer(model.parameters(), lr=lr), data


def test_returned_reductions_are_reduced_with_their_own_op_and_keep_their_dtype(dp):
    model, opt, data = _mlp()
    step = data_parallel(
        _step(_mse, lambda out, y: (out.mean(), out.max(), out.amin(), (out.argmax(1) == y.argmax(1)).sum())),
        dp,
        backend=None,
    )
    mean, top, bottom, count = step(model, opt, *data(8, 0))
    assert count.dtype == torch.int64 and mean.dtype == top.dtype == bottom.dtype == torch.float32
    entry = step.compiled[0]
    ops = [(r.op, r.collective.args[1]) for r in entry.reductions if not r.gradient]
    assert sorted(ops) == [("avg", "sum"), ("max", "max"), ("min", "min"), ("sum", "sum")]
    assert {r.op for r in entry.reductions if r.gradient} == {"avg"}  # gradients: DDP's average


def test_returned_norm_over_the_batch_is_refused(dp):
    model, opt, data = _mlp()
    step = data_parallel(_step(_mse, lambda out, y: (out.sum(), torch.linalg.vector_norm(out))), dp, backend=None)
    with pytest.raises(ValueError, match=r"output #1 of the step reads node 'linalg_vector_norm' .*_NormPartial"):
        step(model, opt, *data(8, 0))


@pytest.mark.parametrize(
    "loss_of, node",
    [
        (lambda model, out, y: F.mse_loss(out, y).sqrt(), "sqrt"),
        (lambda model, out, y: (out.softmax(1).mean(0) ** 2).sum(), "pow"),
    ],
    ids=["sqrt_of_mean", "square_of_batch_mean"],
)
def test_loss_nonlinear_in_a_batch_reduction_is_refused(dp, loss_of, node):
    model, opt, data = _mlp()
    step = data_parallel(_step(loss_of), dp, backend=None)
    with pytest.raises(ValueError, match=rf"node '{node}\w*' .* reads '\w+', a reduction over the batch") as info:
        step(model, opt, *data(8, 0))
    assert "the step's loss is not a sum or mean over samples" in str(info.value)
    assert "DistributedDataParallel would apply it to each rank's local value" in str(info.value)


@pytest.mark.parametrize(
    "loss_of",
    [
        lambda model, out, y: F.mse_loss(out, y) + 0.01 * sum(p.pow(2).sum() for p in model.parameters()),
        lambda model, out, y: F.mse_loss(out, y) * 2 - 1,
        lambda model, out, y: (out - y).pow(2).sum() / out.shape[0],
        # NOTE [local rules]: a sum over the batch divided by a count over it is each rank's own mean, as DDP's
        lambda model, out, y: ((out - y).pow(2).sum(1) * (y[:, 0] > 0)).sum() / (y[:, 0] > 0).sum(),
    ],
    ids=["mean_plus_regularizer", "affine_in_mean", "sum_over_local_count", "sum_over_a_counted_subset"],
)
def test_losses_linear_in_the_batch_reductions_are_accepted(dp, loss_of):
    model, opt, data = _mlp()
    data_parallel(_step(loss_of), dp, backend=None)(model, opt, *data(8, 0))


def test_one_hot_without_num_classes_is_refused_with_what_to_do(dp):
    # F.one_hot(y) reads max(y): under DDP each rank's own labels give its number of classes.
    model, opt, data = _mlp()
    step = data_parallel(_step(lambda model, out, y: F.mse_loss(out, F.one_hot(y).float())), dp, backend=None)
    x, _ = data(8, 0)
    with pytest.raises(ValueError, match=r"could not trace the step into one graph \(\w+ in torch's one_hot: ") as info:
        step(model, opt, x, torch.tensor([0, 1, 2, 3, 1, 2, 0, 3]))
    assert "F.one_hot without num_classes reads the largest label" in str(info.value)
    assert "pass num_classes" in str(info.value)
    step = data_parallel(_step(lambda model, out, y: F.mse_loss(out, F.one_hot(y, 4).float())), dp, backend=None)
    step(model, opt, x, torch.tensor([0, 1, 2, 3, 1, 2, 0, 3]))  # with num_classes: traced


def test_scheduler_stepped_inside_the_step_is_refused(dp):
    model, opt, data = _mlp()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    step = data_parallel(_step(_mse, sched=sched), dp, backend=None)
    with pytest.raises(ValueError, match="the step changed Python state while data_parallel traced it") as info:
        step(model, opt, *data(8, 0))
    assert "attribute 'last_epoch' of LR scheduler 0 (StepLR): 0 -> 1" in str(info.value)
    assert "scheduler.step() after step(...)" in str(info.value)


def test_module_attribute_changed_while_tracing_is_refused(dp):
    model, opt, data = _mlp()
    model.calls = 0

    def counting(model, out, y):
        model.calls += 1
        return F.mse_loss(out, y)

    with pytest.raises(ValueError, match=r"attribute 'calls' of module 0 \(MLP\): 0 -> 1"):
        data_parallel(_step(counting), dp, backend=None)(model, opt, *data(8, 0))


def test_changed_module_attribute_and_new_hook_retrace(dp, caplog):
    model, opt, data = _mlp()
    model.temperature = 1.0
    step = data_parallel(_step(lambda m, out, y: F.mse_loss(out / m.temperature, y)), dp, backend=None)
    x, y = data(8, 0)
    step(model, opt, x, y)  # SGD without momentum keeps no state: one argument structure
    step(model, opt, x, y)
    assert len(step.compiled) == 1
    model.temperature = 2.0
    with caplog.at_level(logging.INFO, logger="dynamo_ext.spmd.parallel_step"):
        step(model, opt, x, y)
    assert len(step.compiled) == 2
    assert "attribute 'temperature' of module 0 (MLP): 1.0 -> 2.0" in caplog.text
    model.temperature = 1.0
    step(model, opt, x, y)
    assert len(step.compiled) == 2  # the first graph again
    mask = torch.zeros(32, 16)
    handle = next(model.parameters()).register_hook(lambda g: g * mask)
    step(model, opt, x, y)
    assert len(step.compiled) == 3
    handle.remove()
    step(model, opt, x, y)
    assert len(step.compiled) == 3


def test_post_accumulate_grad_hook_is_refused(dp):
    model, opt, data = _mlp()
    next(model.parameters()).register_post_accumulate_grad_hook(lambda p: None)
    step = data_parallel(make_step("mlp"), dp, backend=None)
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(32, 16\)\) has a hook registered with "):
        step(model, opt, *data(8, 0))


def test_adam_step_count_on_cpu_says_what_to_do(dp):
    model, opt, data = _mlp(optimizer=torch.optim.AdamW)
    step = data_parallel(make_step("mlp"), dp, backend=None)
    step(model, opt, *data(8, 0))  # the first step's count is a constant of the trace
    opt.zero_grad()
    with pytest.raises(ValueError, match=r"optimizer 0 \(AdamW\) reads its state 'step', a CPU tensor") as info:
        step(model, opt, *data(8, 1))
    assert "capturable=True" in str(info.value)
    assert "call optimizer.step() outside the step function" in str(info.value)

    # ... which works: the step leaves the averaged gradients in .grad, AdamW runs eagerly
    def backward_only(model, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss.detach()

    opt.zero_grad()
    grads = data_parallel(backward_only, dp, backend=None)
    for i in range(2):
        grads(model, *(local_part(t, 0, 4) for t in data(16, i)))
        opt.step()
        opt.zero_grad()
