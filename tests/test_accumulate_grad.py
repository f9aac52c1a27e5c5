"""A DTensor leaf's first ``.grad`` under compiled autograd has eager's placements and local values.

NOTE [compiled autograd: DTensor .grad of an uneven shard] (``dynamo_ext/variables/autograd/accumulate_grad.py``):
torch 2.11 makes an uneven shard's gradient Replicate, 2.11/2.12 fail with PendingUnbackedSymbolNotFound on a
``_StridedShard`` one.  Tier 1: rank 0 of a fake 4-rank world; the gradient never needs a collective.
"""

from __future__ import annotations

import pytest
import torch


def _leaf(mesh, placements, local_rows, shape):
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    local = torch.randn(local_rows, shape[1])
    stride = (shape[1], 1)
    return torch.nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride))


def _loss(param, weight):
    return (param.to_local() * weight).sum()


def _grad(param, compiled_autograd: bool):
    import dynamo_ext._compat as compat

    weight = torch.arange(param.to_local().numel(), dtype=torch.float32).reshape(param.to_local().shape)
    if compiled_autograd:  # the forward compiled too, as in FSDP2 training (DTensor.to_local's backward traced)
        loss = torch.compile(_loss, backend="aot_eager", fullgraph=True)(param, weight)
    else:
        loss = _loss(param, weight)
    if compiled_autograd:
        with compat.compiled_autograd(torch.compile(backend="aot_eager", fullgraph=True)):
            loss.backward()
    else:
        loss.backward()
    grad, param.grad = param.grad, None
    return grad


def _meshes():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import dynamo_ext._compat as compat

    strided = compat.strided_shard_type()
    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {
        # 10 rows over 4 ranks: 3, 3, 3, 1 (FSDP2's uneven Shard(0))
        "uneven_shard": (mesh1, (Shard(0),), 3, (10, 4)),
        # FSDP over TP: a column-parallel weight sharded again over dp
        "strided_shard": (mesh2, (strided(0, split_factor=2), Shard(0)), 2, (8, 4)),
    }


@pytest.mark.parametrize("case", ["uneven_shard", "strided_shard"])
def test_dtensor_leaf_grad_under_compiled_autograd_matches_eager(world, case):
    from torch.distributed.tensor import DTensor

    mesh, placements, rows, shape = _meshes()[case]
    param = _leaf(mesh, placements, rows, shape)
    eager = _grad(param, compiled_autograd=False)
    compiled = _grad(param, compiled_autograd=True)
    assert isinstance(compiled, DTensor), type(compiled)
    assert compiled.placements == eager.placements == placements, (compiled.placements, eager.placements)
    assert compiled.shape == eager.shape and compiled.to_local().shape == eager.to_local().shape
    torch.testing.assert_close(compiled.to_local(), eager.to_local(), rtol=0, atol=0)
