"""Guards on distributed objects: the pure extract/describe pairs, and recompiles under Dynamo."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import CountingBackend
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import guard_failures
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from dynamo_ext.guards import objects
from dynamo_ext.guards.spec import FAILURES, make_checker

placements = st.one_of(
    st.builds(Shard, st.integers(-3, 3)),
    st.just(Replicate()),
    st.builds(Partial, st.sampled_from(["sum", "avg", "max", "min"])),
)


@given(placements, placements)
def test_placement_record_equal_iff_placements_equal(a, b):
    same = objects.extract_placement(a) == objects.extract_placement(b)
    assert same == (a == b and type(a) is type(b))
    diff = objects.describe_placement(objects.extract_placement(a), objects.extract_placement(b))
    assert (diff is None) == same
    if not same:
        assert diff == f"placement changed: {a!r} -> {b!r}"


def test_extract_is_total_on_foreign_objects():
    for spec in (objects.PROCESS_GROUP, objects.DEVICE_MESH, objects.PLACEMENT, objects.DTENSOR_SPEC):
        for junk in (None, 3, "tp", object(), [1, 2]):
            spec.extract(junk)  # never raises


def test_mesh_describe_names_each_field(world):
    a = objects.extract_device_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    b = objects.extract_device_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)))
    text = objects.describe_device_mesh(a, b)
    assert "mesh shape changed: (2, 2) -> (4,)" in text
    assert "mesh dim names changed: ('dp', 'tp') -> ('tp',)" in text
    assert "ranks" not in text  # same ranks 0..3 in both


def test_checker_fast_path_and_failure_text(world):
    m = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    check = make_checker(objects.DEVICE_MESH, m, "t1", "L['mesh']")
    assert check(m)
    assert check(init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)))  # equal mesh, other object
    assert not check(init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)))
    assert FAILURES["t1"] == "L['mesh']: mesh dim names changed: ('tp',) -> ('cp',)"
    assert not check("not a mesh")


def _reasons() -> list[str]:
    return [r for rs in guard_failures.values() for r in rs]


@pytest.fixture
def fresh_failures():
    guard_failures.clear()
    FAILURES.clear()
    yield
    guard_failures.clear()


def test_mesh_argument_recompiles_only_on_change(world, fresh_failures):
    backend = CountingBackend()
    fn = torch.compile(lambda x, mesh: x * mesh.size() + mesh.ndim, backend=backend, fullgraph=True)
    x = torch.ones(2)
    m1 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fn(x, m1)
    fn(x, m1)
    fn(x, copy.copy(m1))  # an equal mesh on the same process groups
    assert backend.frame_count == 1
    out = fn(x, m1["tp"])
    assert backend.frame_count == 2
    assert torch.equal(out, x * 2 + 1)
    assert any("mesh dim names changed: ('dp', 'tp') -> ('tp',)" in r for r in _reasons()), _reasons()
    # The same layout on new process groups: a graph may bake the old groups' names, so it recompiles.
    fn(x, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    assert backend.frame_count == 3
    assert any("mesh process groups changed: ('1', '3') -> " in r for r in _reasons()), _reasons()


def test_placement_argument_recompiles_with_reason(world, fresh_failures):
    backend = CountingBackend()
    fn = torch.compile(lambda x, p: x + (p.dim if p.is_shard() else -1), backend=backend, fullgraph=True)
    x = torch.zeros(1)
    assert fn(x, Shard(1)).item() == 1
    assert fn(x, Shard(1)).item() == 1
    assert backend.frame_count == 1
    assert fn(x, Replicate()).item() == -1
    assert backend.frame_count == 2
    assert any("placement changed: Shard(dim=1) -> Replicate()" in r for r in _reasons()), _reasons()


def test_process_group_guarded_by_identity(world, fresh_failures):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    backend = CountingBackend()
    fn = torch.compile(lambda x, pg: x * pg.size() + pg.rank(), backend=backend, fullgraph=True)
    x = torch.ones(1)
    fn(x, mesh.get_group("dp"))
    fn(x, mesh.get_group("dp"))
    assert backend.frame_count == 1
    fn(x, mesh.get_group("tp"))
    assert backend.frame_count == 2
    assert any("process group" in r for r in _reasons()), _reasons()


def test_dtensor_placements_change_reason(world, fresh_failures):
    m = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    a = distribute_tensor(torch.arange(32.0).reshape(8, 4), m, [Shard(0)])
    b = distribute_tensor(torch.arange(32.0).reshape(8, 4), m, [Replicate()])
    backend = CountingBackend()
    fn = torch.compile(lambda t: t.redistribute(m, [Replicate()]).to_local() * 2, backend=backend, fullgraph=True)
    fn(a)
    fn(a)
    assert backend.frame_count == 1
    fn(b)
    assert backend.frame_count == 2
    assert any("DTensor placements changed: (Shard(dim=0),) -> (Replicate(),)" in r for r in _reasons()), _reasons()


def test_closed_over_mesh_is_guarded(world, fresh_failures):
    holder = {"mesh": init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))}

    class Block(torch.nn.Module):
        def forward(self, x):
            return x * holder["mesh"].size()

    backend = CountingBackend()
    fn = torch.compile(Block(), backend=backend, fullgraph=True)
    x = torch.ones(1)
    assert fn(x).item() == 4
    holder["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]
    assert fn(x).item() == 2  # never the graph built for the other mesh
    assert backend.frame_count == 2
