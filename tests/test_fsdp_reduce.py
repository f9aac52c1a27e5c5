"""FSDP2's gradient reduction as the traced all-gather's backward (fake 4-rank group, one process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dynamo_ext.variables.fsdp import reduce as fsdp_reduce


def _param(param_dtype=None, reduce_dtype=None, orig=torch.float32):
    mesh_info = SimpleNamespace(shard_process_group=dist.group.WORLD)
    return SimpleNamespace(mesh_info=mesh_info, param_dtype=param_dtype, reduce_dtype=reduce_dtype, orig_dtype=orig)


@pytest.mark.parametrize(
    ("kwargs", "group", "expected"),
    [
        # FSDP2's _get_gradient_divide_factors (torch 2.13): AVG for fp32/bf16 ...
        ({}, {}, ("avg", None, None, None)),
        ({"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}, {}, ("avg", None, None, None)),
        # ... PREMUL_SUM(1/f) for a factor other than the world size (traced as a multiply, then sum) ...
        ({}, {"gradient_divide_factor": 2.0}, ("sum", 0.5, None, None)),
        ({}, {"gradient_divide_factor": 4.0}, ("avg", None, None, None)),
        # ... and SUM with a post-division when sums are forced, pre and post for fp16 (overflow risk)
        ({}, {"force_sum_reduction_for_comms": True}, ("sum", None, None, 4.0)),
        ({"param_dtype": torch.float16}, {}, ("sum", None, 2, 2.0)),
    ],
)
def test_plan_mirrors_fsdp2_divide_factors(world, kwargs, group, expected):
    r = fsdp_reduce.plan(_param(**kwargs), SimpleNamespace(**group))
    assert (r.op, r.premul, r.pre_factor, r.post_factor) == expected
    assert r.world == 4 and r.group_name == dist.group.WORLD.group_name
    assert (r.param_dtype, r.reduce_dtype) == (kwargs.get("param_dtype"), kwargs.get("reduce_dtype"))


def test_backward_casts_divides_and_returns_the_original_dtype():
    """On a real 1-rank gloo group the reduce-scatter returns its input: the arithmetic around it shows."""
    from torch.distributed import HashStore

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        name = dist.group.WORLD.group_name
        r = fsdp_reduce.GradReduction(name, 1, torch.bfloat16, torch.float32, "sum", 0.5, 2.0, 4.0)
        local = torch.randn(2, 3, requires_grad=True)
        full = fsdp_reduce.gather(local, r)
        assert full.shape == (2, 3) and full.dtype == torch.bfloat16
        torch.testing.assert_close(full, local.detach().to(torch.bfloat16))
        grad = torch.arange(6.0).reshape(2, 3).to(torch.bfloat16)
        full.backward(grad)
        assert local.grad.dtype == torch.float32
        torch.testing.assert_close(local.grad, grad.float() * 0.5 / 2.0 / 4.0)  # premul, pre-, post-divide
    finally:
        dist.destroy_process_group()
