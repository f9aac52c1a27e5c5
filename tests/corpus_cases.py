"""dynamo-ext's own corpus cases, run with the shared runner (``run.py --cases-file``).

They cover what the issue asks beyond the public corpus: DTensor and mesh
creation inside a compiled function, implicit replication, FSDP2 forward with
repeated calls, and bad input that must raise what eager raises.
"""

import torch
import torch.nn as nn
from corpus import case
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor


def _x(env, *shape):
    g = torch.Generator().manual_seed(4321 + env.rank)
    return torch.randn(*shape, generator=g)


@case("dtensor", "ext")
def case_ext_distribute_tensor_inside(env):
    m = env.mesh2d

    def fn(x):
        d = distribute_tensor(x, m, [Shard(0), Replicate()])
        return (d * 2).to_local(), d.full_tensor()

    return fn, (_x(env, 8, 4),)


@case("dtensor", "ext")
def case_ext_distribute_tensor_uneven_src_none(env):
    m = env.mesh1d

    def fn(x):
        return distribute_tensor(x, m, [Shard(1)], src_data_rank=None).to_local() + 1

    return fn, (_x(env, 3, 7),)


@case("mesh", "ext")
def case_ext_init_device_mesh_inside(env):
    ws = env.world_size

    def fn(x):
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("a", "b"))
        d = DTensor.from_local(x, mesh, [Replicate(), Shard(0)], run_check=False)
        return d.redistribute(mesh, [Replicate(), Replicate()]).to_local() * mesh["b"].size()

    return fn, (_x(env, 2, 3),)


@case("dtensor", "ext")
def case_ext_implicit_replication(env):
    from torch.distributed.tensor.experimental import implicit_replication

    m = env.mesh1d

    def fn(x, bias):
        d = DTensor.from_local(x, m, [Shard(0)], run_check=False)
        with implicit_replication():
            y = d + bias
        return y.to_local()

    return fn, (_x(env, 4, 4), torch.arange(4.0))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 5)  # 5 rows: uneven shards with padding on 4 ranks

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@case("module", "ext")
def case_ext_fsdp2_forward_uneven_repeated(env):
    from torch.distributed.fsdp import fully_shard

    net = _Net()
    fully_shard(net.a, mesh=env.mesh1d)
    fully_shard(net.b, mesh=env.mesh1d)
    fully_shard(net, mesh=env.mesh1d)
    x = _x(env, 3, 8)
    return net, (x,), [(x * 2,), (x,)]


@case("bad-input", "ext", expect_error=True)
def case_ext_bad_shard_dim(env):
    m = env.mesh1d
    return (lambda x: distribute_tensor(x, m, [Shard(2)]).to_local()), (_x(env, 4, 4),)


@case("bad-input", "ext", expect_error=True)
def case_ext_bad_placement_count(env):
    m = env.mesh1d
    return (lambda x: distribute_tensor(x, m, [Shard(0), Shard(1)]).to_local()), (_x(env, 4, 4),)


@case("bad-input", "ext", expect_error=True)
def case_ext_bad_mesh_size(env):
    def fn(x):
        mesh = init_device_mesh("cpu", (3, 3))
        return x * mesh.size()

    return fn, (_x(env, 2),)


@case("dtensor", "ext")
def case_ext_from_local_run_check_default(env):
    m = env.mesh1d

    def fn(x):
        d = DTensor.from_local(x, m, [Shard(0)])  # run_check defaults to True
        return d.redistribute(m, [Replicate()]).to_local()

    return fn, (_x(env, 2, 3),)


@case("dtensor", "ext")
def case_ext_from_local_shape_stride_uneven(env):
    m = env.mesh1d
    rows = 3 if env.rank < env.world_size - 1 else 1  # 10 rows over 4 ranks

    def fn(x):
        d = DTensor.from_local(x, m, [Shard(0)], run_check=False, shape=(10, 2), stride=(2, 1))
        return d.full_tensor() * 2

    return fn, (_x(env, rows, 2),)


@case("dtensor", "comm", "ext")
def case_ext_redistribute_async(env):
    m = env.mesh2d

    def fn(x):
        d = DTensor.from_local(x, m, [Shard(0), Partial()], run_check=False)
        y = d.redistribute(m, [Replicate(), Replicate()], async_op=True)
        return y.to_local() + 1

    return fn, (_x(env, 2, 4),)


@case("dtensor", "ext")
def case_ext_local_map(env):
    from torch.distributed.tensor.experimental import local_map

    m = env.mesh1d
    scaled = local_map(lambda t, s: t * s, out_placements=[Shard(0)], in_placements=([Shard(0)], None), device_mesh=m)

    def fn(x):
        d = DTensor.from_local(x, m, [Shard(0)], run_check=False)
        return scaled(d, 3.0).to_local()

    return fn, (_x(env, 2, 2),)


@case("mesh", "ext")
def case_ext_mesh_multi_slice_flatten_layout(env):
    m = env.mesh2d

    def fn(x):
        both = m["dp", "tp"]
        flat = m._flatten("dp_tp")
        return x * flat.size() + both.mesh.sum() + m.mesh[0, 0] + flat.get_local_rank()

    return fn, (_x(env, 3),)


@case("guard", "ext", expect_graphs=2)
def case_ext_guard_mesh_names(env):
    a = env.mesh2d
    b = init_device_mesh("cpu", (2, env.world_size // 2), mesh_dim_names=("x", "y"))

    def fn(t, mesh):
        return t * (10 if mesh.mesh_dim_names[0] == "dp" else 20)

    t = _x(env, 2)
    return fn, (t, a), [(t, a), (t, b), (t, a)]


@case("module", "ext")
def case_ext_fsdp2_over_tp_forward(env):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    net = _Net()
    net.b = nn.Linear(16, 6)  # TP needs the rows of b's output to be whole on each tp rank
    tp, dp = env.mesh2d["tp"], env.mesh2d["dp"]
    parallelize_module(net, tp, {"a": ColwiseParallel(), "b": RowwiseParallel()})
    fully_shard(net.a, mesh=dp)
    fully_shard(net.b, mesh=dp)
    fully_shard(net, mesh=dp)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(env.rank // 2))  # same input across a tp group
    return net, (x,), [(x,)]
