"""Bad input: the same exception as eager, or a graph break that says what to do; never an internal error."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard


def _same_error_as_eager(fn, *args):
    with pytest.raises(Exception) as eager:
        fn(*args)
    with pytest.raises(type(eager.value)) as compiled:
        torch.compile(fn, backend="aot_eager")(*args)
    assert "Internal" not in type(compiled.value).__name__
    assert str(compiled.value) == str(eager.value)
    return compiled.value


def test_placement_on_missing_dim_raises_index_error(world):
    m = init_device_mesh("cpu", (4,))
    err = _same_error_as_eager(lambda x: distribute_tensor(x, m, [Shard(2)]).to_local(), torch.ones(4, 4))
    assert isinstance(err, IndexError) and "Dimension out of range" in str(err)


def test_wrong_number_of_placements_raises_value_error(world):
    m = init_device_mesh("cpu", (4,))
    err = _same_error_as_eager(lambda x: distribute_tensor(x, m, [Shard(0), Replicate()]), torch.ones(4, 4))
    assert isinstance(err, ValueError) and "device_mesh.ndim" in str(err)


def test_mesh_bigger_than_world_raises_like_eager(world):
    def fn(x):
        return x * init_device_mesh("cpu", (3, 3)).size()

    err = _same_error_as_eager(fn, torch.ones(2))
    assert isinstance(err, RuntimeError) and "bigger than default world size 4" in str(err)


def test_non_constant_mesh_shape_is_a_clear_graph_break(world):
    def fn(x):
        return x * init_device_mesh("cpu", (x.shape[0],)).size()

    x = torch.ones(4)
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(fn, backend="eager", fullgraph=True)(x)
    text = str(info.value)
    assert "dynamo_ext: non-constant distributed argument" in text
    assert "init_device_mesh" in text and "Pass a Python constant" in text


def test_strided_shard_in_distribute_tensor_is_a_clear_graph_break(world):
    m = init_device_mesh("cpu", (4,))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="redistribute to this placement"):
        torch.compile(lambda x: distribute_tensor(x, m, [_StridedShard(0, split_factor=2)]), fullgraph=True)(
            torch.ones(8, 2)
        )


def test_unknown_mesh_attribute_raises_attribute_error(world):
    m = init_device_mesh("cpu", (4,))
    err = _same_error_as_eager(lambda x: x * m.no_such_thing, torch.ones(1))
    assert isinstance(err, AttributeError) and "no_such_thing" in str(err)


def test_unmodelled_group_method_is_a_clear_graph_break(world):
    pg = init_device_mesh("cpu", (4,)).get_group()

    def fn(x):
        pg.allreduce([x])  # the raw ProcessGroup API, not a torch.distributed call
        return x

    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(1))
    text = str(info.value)
    assert "allreduce" in text
    # torch 2.14+ resolve a C++ method on the type before asking the tracker: stock's "skipped" break.
    assert "dynamo_ext: unsupported attribute of a distributed object" in text or "marked as skipped" in text
    if "dynamo_ext" in text:
        assert "ProcessGroup.allreduce" in text and "Supported on a process group" in text


def test_distribute_tensor_of_a_grad_tensor_is_a_clear_graph_break(world):
    m = init_device_mesh("cpu", (4,))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="distribute parameters outside the compiled function"):
        torch.compile(lambda x: distribute_tensor(x, m, [Shard(0)]).to_local(), fullgraph=True)(
            torch.ones(8, 2, requires_grad=True)
        )


def test_distribute_tensor_to_mixed_partial_ops_raises_value_error(world):
    # Found by tests/test_guard_fuzz.py: the plugin's traced distribute_tensor skipped eager's check.
    from torch.distributed.tensor import Partial

    m = init_device_mesh("cpu", (2, 2))
    err = _same_error_as_eager(
        lambda x: distribute_tensor(x, m, [Partial("max"), Partial("avg")]).to_local(), torch.ones(4, 4)
    )
    assert isinstance(err, ValueError) and "Mixed Partial reduce types" in str(err)


# ---- bad input through the public entry points ---------------------------------------------
def _deepest_file(info: pytest.ExceptionInfo) -> str:
    """The file of the frame that raised: the entry point itself, not something deep inside it."""
    return info.traceback[-1].path.name


def test_install_uninstall_enabled_take_no_arguments():
    import dynamo_ext

    for fn in (dynamo_ext.install, dynamo_ext.uninstall, dynamo_ext.enabled):
        with pytest.raises(TypeError, match="takes 0 positional arguments") as info:
            fn("cuda")
        assert _deepest_file(info) in ("test_bad_input.py", "contextlib.py")  # refused by the call itself
    assert not dynamo_ext.is_installed()


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("bucket_cap", 1 << 20, AttributeError, "has no option 'bucket_cap'; did you mean bucket_cap_bytes"),
        ("one_shot", 1, TypeError, "options.one_shot is a switch: set True or False, got 1"),
        ("bucket_small_bytes", -1, ValueError, "options.bucket_small_bytes must be 0 or more, got -1"),
        ("two_shot_max_bytes", 2.5e6, TypeError, "options.two_shot_max_bytes is a size (an int), got float"),
        ("one_shot_device_types", "cuda", TypeError, "a tuple of device types such as ('cuda',), got 'cuda'"),
    ],
)
def test_bad_lowering_options_are_refused_when_set(name, value, error, message):
    from dynamo_ext import _compat
    from dynamo_ext.inductor_lowerings import options

    before = options.get_hash()
    for how in (lambda: setattr(options, name, value), lambda: options.patch({name: value}).__enter__()):
        with pytest.raises(error) as info:
            how()
        assert message in str(info.value) and _deepest_file(info) == "options.py"
    assert options.get_hash() == before
    assert options.get_config_copy() == _compat.config_defaults(options)


def test_lowering_options_are_a_torch_config_module():
    """``patch`` sets and restores, and every setting is part of the hash the passes' ``uuid()`` reads."""
    from dynamo_ext.inductor_lowerings import options

    before = options.get_hash()
    with options.patch(one_shot=True, bucket_cap_bytes=1 << 10):
        assert (options.one_shot, options.bucket_cap_bytes) == (True, 1 << 10)
        assert options.get_hash() != before
    assert (options.one_shot, options.bucket_cap_bytes) == (False, 32 << 20)
    assert options.get_hash() == before


def test_audit_api_bad_arguments():
    from dynamo_ext.audit import audit

    with pytest.raises(TypeError, match="fn must be a function or module to compile, got int") as info:
        audit(42)
    assert _deepest_file(info) == "api.py"
    with pytest.raises(TypeError, match="takes a make_step callable"):
        audit(torch.sin, torch.ones(1), check_numerics="step", backend="eager")
    with pytest.raises(ValueError, match=r"audit\(rtol=...\) must be a number >= 0, got -1"):
        audit(torch.sin, torch.ones(1), rtol=-1, atol=0.0, backend="eager")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-breaks", "-1"], "--max-breaks must be 0 or more, got -1"),
        (["--max-hang-risks", "-2"], "--max-hang-risks must be 0 or more, got -2"),
        (["--rtol", "-1", "--atol", "0"], "--rtol must be a number >= 0, got -1"),
        (
            ["--json", "/no/such/folder/out.json"],
            "--json /no/such/folder/out.json: folder /no/such/folder does not exist",
        ),
        (["--html", "."], "--html .: is a directory; give a file name"),
        (["no_such_module_xyz:main"], "unknown module 'no_such_module_xyz'"),
    ],
)
def test_audit_cli_bad_options_fail_before_launching(capsys, argv, message):
    from dynamo_ext.audit.cli import EXIT_ERROR, main

    assert main(["audit", *argv]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert f"dynamo-ext audit: error: {message}" in err and "Traceback" not in err


def test_audit_cli_non_number_is_an_argparse_error(capsys):
    from dynamo_ext.audit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["audit", "--nproc", "four"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --nproc: invalid int value: 'four'" in err and "Traceback" not in err


def test_spmd_bad_mesh_or_tensor_is_a_type_error(world):
    from dynamo_ext.spmd import Mesh, mark_sharding, with_sharding_constraint

    mesh = Mesh(range(4), (2, 2), ("x", "y"))
    with pytest.raises(TypeError, match="mesh must be a dynamo_ext.spmd.Mesh or a DeviceMesh, got str") as info:
        mark_sharding(torch.ones(4, 4), "mesh", ("x", None))
    assert _deepest_file(info) == "sharding.py"
    with pytest.raises(TypeError, match="with_sharding_constraint|mark_sharding: expected a tensor"):
        with_sharding_constraint([[1.0, 2.0]], mesh, ("x", None))
