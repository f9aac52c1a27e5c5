"""XLA-style SPMD API (dynamo_ext.spmd) on the fake process group: meshes, spec translation, errors, tracing.

Expected values are written from torch_xla's documentation of
``torch_xla.distributed.spmd`` (``Mesh``, ``mark_sharding``, ``HybridMesh``);
torch_xla itself cannot be installed here.
"""

from __future__ import annotations

import collections
import copy
import subprocess
import sys

import pytest
import torch
from helpers import CountingBackend, fake_world
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
from torch.distributed.tensor.placement_types import _StridedShard

from dynamo_ext.spmd import (
    HybridMesh,
    Mesh,
    ShardingSpec,
    clear_sharding,
    disable_manual_sharding,
    enable_manual_sharding,
    get_1d_mesh,
    get_sharding,
    mark_sharding,
    set_global_mesh,
    with_sharding_constraint,
)
from dynamo_ext.spmd.partition_spec import to_placements


@pytest.fixture
def mesh(world):
    return Mesh(range(4), (2, 2), ("x", "y"))


# ---- Mesh -----------------------------------------------------------------------
def test_mesh_is_a_device_mesh_with_torch_xla_accessors(mesh):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    assert isinstance(mesh, DeviceMesh)
    assert mesh == init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    assert mesh.get_logical_mesh().tolist() == [[0, 1], [2, 3]]
    assert mesh.shape == (2, 2)  # DeviceMesh's tuple, which DTensor reads
    assert mesh.shape() == collections.OrderedDict([("x", 2), ("y", 2)])  # torch_xla's
    assert mesh.size() == 4 and mesh.size(1) == 2
    assert (mesh.get_axis_name_idx("y"), mesh.get_axis_name_idx("z")) == (1, None)
    assert (mesh.device_ids, mesh.mesh_shape, mesh.axis_names) == ((0, 1, 2, 3), (2, 2), ("x", "y"))


def test_mesh_accessors_trace_without_breaks(mesh):
    def fn(t):
        sizes = mesh.shape()  # torch_xla's OrderedDict
        rows, cols = mesh.shape  # DeviceMesh's tuple
        idx = mesh.get_axis_name_idx("y")
        return t * sizes["y"] * rows * cols + mesh.get_logical_mesh().sum() + idx + mesh.size() + mesh.device_ids[3]

    backend = CountingBackend()
    t = torch.ones(2)
    assert torch.equal(torch.compile(fn, backend=backend, fullgraph=True)(t), fn(t))
    assert fn(t).tolist() == [2 * 2 * 2 + 6 + 1 + 4 + 3] * 2
    assert backend.frame_count == 1


def test_mesh_device_ids_are_laid_out_in_c_order(world):
    mesh = Mesh([3, 2, 1, 0], (2, 2))
    assert mesh.get_logical_mesh().tolist() == [[3, 2], [1, 0]]
    assert tuple(mesh.get_coordinate()) == (1, 1)  # this process is rank 0
    assert mesh.shape() == collections.OrderedDict([(0, 2), (1, 2)])  # no names: axis indices
    assert mesh.get_axis_name_idx("x") is None


def test_get_1d_mesh_and_hybrid_mesh_layouts(world):
    assert get_1d_mesh("data").get_logical_mesh().tolist() == [0, 1, 2, 3]
    assert get_1d_mesh().mesh_dim_names is None
    # Two hosts of two devices: the DCN (across hosts) part of an axis is its major part.
    assert HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1)).get_logical_mesh().tolist() == [[0, 1], [2, 3]]
    hosts_on_axis_1 = HybridMesh(ici_mesh_shape=(2, 1), dcn_mesh_shape=(1, 2), axis_names=("a", "b"))
    assert hosts_on_axis_1.get_logical_mesh().tolist() == [[0, 2], [1, 3]]
    assert hosts_on_axis_1.shape() == collections.OrderedDict([("a", 2), ("b", 2)])
    with pytest.raises(ValueError, match=r"must match the global number of devices \(4\)"):
        HybridMesh(ici_mesh_shape=(2,), dcn_mesh_shape=(1,))


@pytest.mark.parametrize(
    "args, message",
    [
        ((range(2), (2,)), "Number of device IDs (2) must match the global number of devices (4)"),
        ((range(4), (2, 2), ("x",)), "Number of axis names (1) must match mesh dimensions (2)"),
        ((range(4), (2, 2), ("x", "x")), "Axis names must be unique, got: ('x', 'x')"),
        ((range(4), (2, 3)), "Number of device IDs (4) must match mesh size (6)"),
        (([0, 0, 1, 2], (2, 2)), "Device IDs must be unique, got: [0, 0, 1, 2]"),
        (([0, 1, 2, 7], (2, 2)), "Device IDs must be global ranks in [0, 4), got: [0, 1, 2, 7]"),
    ],
)
def test_mesh_errors_use_torch_xla_wording(world, args, message):
    with pytest.raises(ValueError) as info:
        Mesh(*args)
    assert str(info.value) == message


def test_mesh_without_process_group_says_what_to_do():
    with pytest.raises(RuntimeError, match="init_process_group"):
        Mesh(range(1), (1,))


# ---- partition spec -> placements -------------------------------------------------
@pytest.mark.parametrize(
    "spec, placements",
    [
        (("x", None), (Shard(0), Replicate())),
        ((None, "y"), (Replicate(), Shard(1))),
        ((0, 1), (Shard(0), Shard(1))),
        (("y", "x"), (Shard(1), Shard(0))),
        ((None, None), (Replicate(), Replicate())),
        ((("x", "y"), None), (Shard(0), Shard(0))),
        ((("y", "x"), None), (_StridedShard(0, split_factor=2), Shard(0))),
        ((None, (1, 0)), (_StridedShard(1, split_factor=2), Shard(1))),
        ((("y",), None), (Replicate(), Shard(0))),
    ],
)
def test_spec_to_placements(mesh, spec, placements):
    assert to_placements(mesh, spec, (8, 8)) == placements
    d = mark_sharding(torch.arange(64.0).reshape(8, 8), mesh, spec)
    assert d.placements == placements and d.shape == (8, 8)


def test_tuples_over_three_axes_follow_torchs_shard_order(world):
    with fake_world_of(8):
        mesh = Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
        for order in [(0, 1, 2), (2, 0, 1), (1, 2, 0), (2, 1, 0)]:
            spec = (tuple("abc"[i] for i in order), None)
            ours = to_placements(mesh, spec, (16, 4))
            theirs = DTensorSpec._convert_shard_order_to_StridedShard(
                (ShardOrderEntry(tensor_dim=0, mesh_dims=order),), (Shard(0),) * 3, mesh
            )
            assert ours == theirs, order
            d = mark_sharding(torch.zeros(16, 4), mesh, spec)
            assert get_sharding(d) == spec


def fake_world_of(n):
    """Swap the 4-rank fake world of the fixture for one of ``n`` ranks."""
    import contextlib

    import torch.distributed as dist

    @contextlib.contextmanager
    def swap():
        dist.destroy_process_group()
        try:
            with fake_world(n):
                yield
        finally:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)

    return swap()


@pytest.mark.parametrize(
    "spec",
    [("x", None), (None, "y"), ("y", "x"), (None, None), (("x", "y"), None), (None, ("y", "x")), (0, 1), (1, None)],
)
def test_get_sharding_round_trips(mesh, spec):
    d = mark_sharding(torch.ones(8, 4), mesh, spec)
    names = ("x", "y")
    normalised = tuple(names[e] if type(e) is int else e for e in spec)  # named mesh: axes come back by name
    assert get_sharding(d) == normalised
    assert get_sharding(mark_sharding(torch.ones(8, 4), mesh, get_sharding(d))).__eq__(normalised)
    assert get_sharding(torch.ones(2, 3)) == (None, None)


def test_get_sharding_of_partial_raises(mesh):
    from torch.distributed.tensor import Partial

    def fn(t):
        return get_sharding(DTensor.from_local(t, mesh, [Partial(), Replicate()]))

    message = r"mesh axis 0 holds a Partial placement, a pending reduction, .*redistribute"
    with pytest.raises(ValueError, match=message):
        fn(torch.ones(2))
    with pytest.raises(ValueError, match=message):
        torch.compile(fn, backend="eager")(torch.ones(2))


# ---- errors: torch_xla's wording, eager and compiled ---------------------------------
SPEC_ERRORS = [
    (("x",), "Partition spec length (1) should be equal to the input rank (2)."),
    (("x", None, None), "Partition spec length (3) should be equal to the input rank (2)."),
    (("z", None), "Axis name z is not defined in the given mesh"),
    (("x", "x"), "Each device mesh dimension should appear at most once in partition_spec ('x', 'x')."),
    ((("x", "y"), "y"), "Each device mesh dimension should appear at most once in partition_spec (('x', 'y'), 'y')."),
    ((2, None), "partition_spec ((2, None)) contains out of bound index into mesh_shape."),
    ((-1, None), "partition_spec ((-1, None)) contains out of bound index into mesh_shape."),
    ((1.5, None), "Spec type <class 'float'> is not supported in partition spec"),
    (
        (None, ("x", "y")),
        "Tensor dim 1 of size 6 is sharded over mesh axes ('x', 'y') (4 shards), and 6 is not divisible by 4: "
        "torch_xla cuts it into tiles of 2, DTensor splits it one mesh axis at a time, and for this size the two "
        "layouts differ. Pad dim 1 to a multiple of 4, or shard it over one mesh axis.",
    ),
]


@pytest.mark.parametrize("spec, message", SPEC_ERRORS)
def test_bad_spec_raises_value_error_eager_and_compiled(mesh, spec, message):
    def fn(t):
        return mark_sharding(t, mesh, spec).to_local()

    t = torch.ones(7, 6)
    with pytest.raises(ValueError) as eager:
        fn(t)
    assert str(eager.value) == message
    # Raised while tracing as the user's exception (with fullgraph=True Dynamo reports it as a break).
    with pytest.raises(ValueError) as compiled:
        torch.compile(fn, backend="eager")(t)
    assert str(compiled.value) == message


def test_unnamed_mesh_rejects_names(world):
    with pytest.raises(ValueError, match="Axis name x is not defined in the given mesh"):
        mark_sharding(torch.ones(4), Mesh(range(4), (4,)), ("x",))


def test_mark_sharding_of_dtensor_on_other_mesh_raises(mesh):
    d = mark_sharding(torch.ones(4, 4), mesh, ("x", None))
    with pytest.raises(ValueError, match="not on the given mesh"):
        mark_sharding(d, get_1d_mesh(), (0, None))


# ---- tracing: one graph, no recompile, guarded on the spec and the mesh ---------------
def test_everything_traces_as_one_graph(mesh):
    set_global_mesh(mesh)
    try:
        sharding = ShardingSpec(mesh, (None, "y"))

        def fn(t):
            a = mark_sharding(t, mesh, ("x", None))
            b = mark_sharding(t, mesh, (("y", "x"), None))
            c = sharding.apply(t)
            local = enable_manual_sharding(t, (0, None))
            back = disable_manual_sharding(local * 2, (0, None), t.shape)
            spec = get_sharding(b)
            return a.to_local(), b.to_local(), c.to_local(), clear_sharding(back), spec

        backend = CountingBackend()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        t = torch.arange(32.0).reshape(8, 4)
        out, ref = compiled(t), fn(t)
        compiled(t + 1)
        assert backend.frame_count == 1  # no recompile for new data
        assert out[-1] == ref[-1] == (("y", "x"), None)
        for o, r in zip(out[:3], ref[:3]):
            assert torch.equal(o, r)  # the local shards (no collectives involved)
    finally:
        set_global_mesh(None)


def test_a_new_spec_or_mesh_recompiles_an_equal_one_does_not(mesh):
    backend = CountingBackend()

    @torch.compile(backend=backend, fullgraph=True)
    def fn(t, m, spec):
        return mark_sharding(t, m, spec).to_local()

    t = torch.ones(8, 4)
    assert fn(t, mesh, ("x", None)).shape == (4, 4)
    fn(t, mesh, ("x", None))
    fn(t, copy.copy(mesh), ("x", None))  # an equal mesh on the same process groups
    assert backend.frame_count == 1
    assert fn(t, mesh, (None, "y")).shape == (8, 2)
    assert backend.frame_count == 2
    assert fn(t, Mesh([1, 0, 3, 2], (2, 2), ("x", "y")), ("x", None)).shape == (4, 4)
    assert backend.frame_count == 3
    # An equal layout on new process groups recompiles: a graph may bake the old groups' names.
    assert fn(t, Mesh(range(4), (2, 2), ("x", "y")), ("x", None)).shape == (4, 4)
    assert backend.frame_count == 4


def test_with_sharding_constraint_redistributes_once_and_is_a_no_op_when_matching(mesh):
    backend = CountingBackend()

    @torch.compile(backend=backend, fullgraph=True)
    def fn(t):
        d = mark_sharding(t, mesh, ("x", None))
        same = with_sharding_constraint(d, mesh, ("x", None))
        moved = with_sharding_constraint(same, mesh, (None, "y"))
        return same, moved

    same, moved = fn(torch.ones(8, 4))
    fn(torch.zeros(8, 4))
    assert (same.placements, moved.placements) == ((Shard(0), Replicate()), (Replicate(), Shard(1)))
    assert backend.frame_count == 1
    targets = [str(n.target) for n in backend.graphs[0].graph.nodes]
    # mark_sharding's redistribute and the one constraint that moves: the matching one adds nothing
    assert sum("redistribute" in t for t in targets) == 2


def test_import_has_no_side_effects():
    code = (
        "import sys, torch.distributed as dist\n"
        "import dynamo_ext\n"
        "assert 'dynamo_ext.spmd' not in sys.modules\n"
        "import dynamo_ext.spmd\n"
        "assert not dist.is_initialized() and not dynamo_ext.is_installed()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sharding_spec_argument_is_guarded_by_value(mesh):
    backend = CountingBackend()

    @torch.compile(backend=backend, fullgraph=True)
    def fn(t, sharding):
        return sharding.apply(t).to_local() if sharding.can_apply(t) else t

    t = torch.ones(8, 4)
    assert fn(t, ShardingSpec(mesh, ("x", None))).shape == (4, 4)
    assert fn(t, ShardingSpec(mesh, ("x", None))).shape == (4, 4)  # an equal spec: no recompile
    assert backend.frame_count == 1
    assert fn(t, ShardingSpec(mesh, (None, "y"))).shape == (8, 2)
    assert fn(t, ShardingSpec(mesh, (None,))).shape == (8, 4)  # cannot apply: returned as is
    assert backend.frame_count == 3
