"""Tracing of process groups, meshes and placements on the fake process group (one process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from expecttest import assert_expected_inline
from helpers import CountingBackend, normalize_gm
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def compile_one(fn, *args):
    """Compile ``fn`` with fullgraph=True, run it, and return (output, graphs)."""
    backend = CountingBackend()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, backend.graphs


@pytest.fixture
def mesh2d(world):
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_mesh_attributes_fold_to_constants(mesh2d):
    m = mesh2d

    def fn(x):
        k = m.size() * 1000 + m.ndim * 100 + m.size(1) * 10 + len(m.shape)
        if m.mesh_dim_names == ("dp", "tp") and m.device_type == "cpu":
            k += 5
        return x + k + sum(m.get_coordinate()) + m.get_local_rank("tp")

    x = torch.zeros(2)
    out, graphs = compile_one(fn, x)
    assert torch.equal(out, fn(x))
    # Everything folded: the graph is one add of a constant.
    assert [n.target for n in graphs[0].graph.nodes if n.op == "call_function"] == [__import__("operator").add] * 3


def test_mesh_slicing_groups_and_flatten(mesh2d):
    m = mesh2d

    def fn(x):
        tp = m["tp"]
        both = m["dp", "tp"]
        flat = m._flatten("dp_tp") if hasattr(m, "_flatten") else both
        y = funcol.all_reduce(x, "sum", tp.get_group())
        return y * both.size() + flat.size() + tp.get_local_rank()

    x = torch.ones(4)
    out, graphs = compile_one(fn, x)
    assert len(graphs) == 1
    assert torch.equal(out, fn(x))


def test_mesh_layout_tensor_and_dict_key(mesh2d):
    m = mesh2d
    table = {m: 3}

    def fn(x):
        return x * table[m] + m.mesh.sum() + (m == m) + (m != m["tp"])

    x = torch.ones(2)
    out, _ = compile_one(fn, x)
    assert torch.equal(out, fn(x))


def test_process_group_and_world(mesh2d):
    pg = mesh2d.get_group("dp")

    def fn(x):
        return x * pg.size() + pg.rank() + dist.group.WORLD.size() * 10 + dist.get_rank(pg) + len(pg.group_name)

    x = torch.ones(2)
    out, _ = compile_one(fn, x)
    assert torch.equal(out, fn(x))


def test_c10d_queries_fold(mesh2d):
    pg = mesh2d.get_group("tp")

    def fn(x):
        ranks = dist.get_process_group_ranks(pg)
        return x + sum(ranks) + dist.get_world_size(pg) + dist.get_global_rank(pg, 1) + dist.get_group_rank(pg, 0)

    x = torch.ones(2)
    out, _ = compile_one(fn, x)
    assert torch.equal(out, fn(x))


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product"])
def test_placements_construct_compare_hash(world, op):
    def fn(x):
        ps = (Shard(1), Replicate(), Partial(op), _StridedShard(0, split_factor=2))
        k = ps[0].dim + ps[3].split_factor * 10
        k += sum(1 for p in ps if p.is_replicate()) * 100
        k += 1000 if ps[2].reduce_op == op and ps[2].is_partial() else 0
        k += 10000 if Shard(1) == ps[0] and {Shard(1): 3}[ps[0]] == 3 else 0
        k += 100000 if isinstance(ps[1], Replicate) and not isinstance(ps[1], Shard) else 0
        return x + k + len(str(ps[0])) + len(repr(ps[2]))

    x = torch.zeros(1)
    out, _ = compile_one(fn, x)
    assert torch.equal(out, fn(x))


@pytest.mark.skipif(
    not hasattr(torch._dynamo.variables.BuiltinVariable, "call_hash"),
    reason="this torch's Dynamo has no hash() builtin handler (2.11)",
)
def test_hash_of_placements(world):
    def fn(x):
        return x + (hash(Shard(1)) == hash(Shard(1))) + (hash(Replicate()) != hash(Shard(0)))

    x = torch.zeros(1)
    assert torch.equal(compile_one(fn, x)[0], fn(x))


def test_user_placement_subclass(world):
    from torch.distributed.tensor.placement_types import Placement

    class Blocked(Placement):
        def __init__(self, block: int):
            super().__init__()  # 2.11's Placement is a C++ class that must be initialised
            self.block = block

        def __eq__(self, other):
            return isinstance(other, Blocked) and other.block == self.block

        def __hash__(self):
            return hash(("Blocked", self.block))

        def blocks(self, n: int) -> int:
            return (n + self.block - 1) // self.block

    def fn(x, p):
        return x * p.blocks(10) + p.block + Blocked(3).blocks(7)

    x = torch.ones(1)
    out, _ = compile_one(fn, x, Blocked(4))
    assert torch.equal(out, fn(x, Blocked(4)))


def test_graph_of_funcol_on_mesh_axis(mesh2d):
    m = mesh2d

    def fn(x):
        return funcol.all_reduce(x * m["tp"].size(), "sum", m.get_group("tp")) + 1

    _, graphs = compile_one(fn, torch.ones(4))
    assert_expected_inline(
        normalize_gm(graphs[0].print_readable(False)),
        """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4]"):
        l_x_ = L_x_

        mul: "f32[4]" = l_x_ * 2;  l_x_ = None

        tensor: "f32[4]" = torch.ops._c10d_functional.all_reduce(mul, 'sum', '<group>');  mul = None

        wait_tensor: "f32[4]" = torch.ops._c10d_functional.wait_tensor(tensor);  tensor = None

        add: "f32[4]" = wait_tensor + 1;  wait_tensor = None
        return (add,)
""",
    )


def test_dtensor_graph_with_plugin_trackers(mesh2d):
    m = mesh2d

    def fn(x):
        d = DTensor.from_local(x, m, [Shard(0), Replicate()], run_check=False)
        e = d.redistribute(m, [Replicate(), Replicate()])
        return (e * 2).to_local(grad_placements=[Partial(), Partial()]), e.placements, e.device_mesh.ndim

    x = torch.ones(2, 2)
    (out, placements, ndim), graphs = compile_one(fn, x)
    assert placements == (Replicate(), Replicate()) and ndim == 2
    assert len(graphs) == 1


def test_to_local_called_from_eager_code_is_not_a_frame_of_its_own(world):
    """NOTE [to_local frames]: after a graph break skips its caller, `DTensor.to_local` runs eagerly instead of
    being compiled as a frame whose autograd.Function backward stock Dynamo cannot trace (transformers'
    expert-parallel `_use_local_dtensor_params` does this)."""
    from torch.distributed.tensor import distribute_tensor

    import dynamo_ext

    mesh = init_device_mesh("cpu", (4,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)], src_data_rank=None))
    backend = CountingBackend()
    out = torch.compile(DTensor.to_local, backend=backend)(p)
    assert backend.frame_count == 0 and torch.equal(out, p.to_local())
    out.sum().backward()  # eager autograd: the gradient is a DTensor with p's placements
    assert p.grad.placements == (Shard(0),) and torch.equal(p.grad.to_local(), torch.ones(2, 3))
    dynamo_ext.uninstall()  # undone: stock Dynamo compiles the frame again
    try:
        torch._dynamo.reset()
        stock = CountingBackend()
        try:
            torch.compile(DTensor.to_local, backend=stock, fullgraph=True)(p)
            assert stock.frame_count == 1  # torch 2.15 traces it whole
        except torch._dynamo.exc.Unsupported as e:
            assert "compute_global_tensor_info" in str(e)  # torch 2.13: traced, and broke in its backward
    finally:
        dynamo_ext.install()
