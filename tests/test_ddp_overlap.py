"""DDP's python reducer under compiled autograd, on the fake process group: the backward's split for overlap.

Numerics against eager DDP are in tests/test_ddp_overlap_gloo.py; here the
collectives return garbage, so only the graphs Dynamo hands the backend are checked.
"""

from __future__ import annotations

import pytest
import torch
from dp_models import build, compiled_autograd_step, local_part
from helpers import CountingBackend
from torch.nn.parallel import DistributedDataParallel

import dynamo_ext

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
COMPUTE = {aten.mm.default, aten.addmm.default}
CAP_MB = 4000 / 2**20  # MLP gradients in backward order: head (16 + 512 bytes), net.2 (128 + 4096), net.0 (128 + 2048)


@pytest.fixture
def python_reducer(world):
    """``optimize_ddp="python_reducer"`` and the split on; DDP's constructor then changes Inductor's config and Dynamo's inline
    list globally: restored afterwards."""
    import torch._dynamo.trace_rules as rules
    import torch._inductor.config as inductor_config

    saved = (inductor_config._fuse_ddp_communication, inductor_config._fuse_ddp_bucket_size)
    inlined = "torch.nn.parallel.distributed" in rules.LEGACY_MOD_INLINELIST
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"), dynamo_ext.config.patch(ddp_split_for_overlap=True):
        yield
    inductor_config._fuse_ddp_communication, inductor_config._fuse_ddp_bucket_size = saved
    if not inlined:
        rules.LEGACY_MOD_INLINELIST.discard("torch.nn.parallel.distributed")
        rules.get_legacy_mod_inlinelist.cache_clear()


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    """Call targets in graph order, collective packets (what Dynamo records) as their default overloads."""
    packets = {c10d.all_reduce: c10d.all_reduce.default, c10d.wait_tensor: c10d.wait_tensor.default}
    return [packets.get(n.target, n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def _run(**ddp_kwargs: object) -> tuple[CountingBackend, torch.nn.Module]:
    model, data = build("mlp")
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    counting = CountingBackend("aot_eager")
    step = compiled_autograd_step(ddp, "mlp", counting)
    step(*(local_part(t, 0, 4) for t in data(16, 0)))
    return counting, model


def test_each_bucket_all_reduce_is_issued_before_the_next_buckets_backward(python_reducer):
    # DDP's rule with a 4000-byte cap (an explicit cap is also the first bucket's): head and net.2 fill bucket 1
    # (4752 bytes), net.0 is bucket 2; each bucket is merged into one all-reduce of a packed (cat) buffer.
    counting, model = _run(bucket_cap_mb=CAP_MB)
    forward, *backward = counting.graphs
    assert c10d.all_reduce.default not in _targets(forward)
    assert len(backward) == 3  # one submodule per bucket, then the waits and the copies into .grad
    for k, gm in enumerate(backward[:2]):
        ops = _targets(gm)
        assert ops.count(c10d.all_reduce.default) == 1 and c10d.wait_tensor.default not in ops
        collective = next(n for n in gm.graph.nodes if n.target is c10d.all_reduce.default)
        assert collective.args[0].target is aten.cat.default
        last_compute = max(i for i, t in enumerate(ops) if t in COMPUTE)
        assert last_compute < ops.index(c10d.all_reduce.default)  # issued once the bucket's gradients exist
        if k == 0:  # ... and the next bucket's backward runs while it is in flight
            assert any(t in COMPUTE for t in _targets(backward[1]))
    sizes = [
        next(n for n in gm.graph.nodes if n.target is c10d.all_reduce.default).args[0].meta["example_value"].numel()
        for gm in backward[:2]
    ]
    assert [4 * s for s in sizes] == [16 + 512 + 128 + 4096, 128 + 2048]
    last = _targets(backward[2])
    assert c10d.all_reduce.default not in last and last.count(c10d.wait_tensor.default) == 2
    assert last.count("copy_") == 6 and last.index(c10d.wait_tensor.default) < last.index("copy_")
    assert all(p.grad is not None for p in model.parameters())


def test_one_bucket_or_the_switch_off_keeps_one_backward_graph(python_reducer):
    counting, _ = _run()  # DDP's default caps: 25 MiB, first bucket 1 MiB: all gradients in one bucket
    assert len(counting.graphs) == 2
    torch._dynamo.reset()
    with dynamo_ext.config.patch(ddp_split_for_overlap=False):
        counting, _ = _run(bucket_cap_mb=CAP_MB)
    assert len(counting.graphs) == 2
    ops = _targets(counting.graphs[1])
    assert ops.count(c10d.all_reduce.default) == 6  # stock: each wait right after its all-reduce
    assert all(ops[i + 1] is c10d.wait_tensor.default for i, t in enumerate(ops) if t is c10d.all_reduce.default)


@pytest.mark.parametrize("hook_after_ddp", [False, True])
def test_a_gradient_a_later_hook_reads_is_left_in_place(python_reducer, hook_after_ddp):
    model, data = build("mlp")
    seen = []
    weight = model.net[0].weight
    if not hook_after_ddp:  # runs before DDP's hook, on the local gradient: the block may still move
        weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.sum()))
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    if hook_after_ddp:  # reads the averaged gradient: its all-reduce, wait and copy_ stay in place
        weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.sum()))
    counting = CountingBackend("aot_eager")
    compiled_autograd_step(ddp, "mlp", counting)(*(local_part(t, 0, 4) for t in data(16, 0)))
    assert len(seen) == 1
    kept = []
    for gm in counting.graphs[1:]:
        ops = _targets(gm)
        kept += [
            i for i, t in enumerate(ops[:-1]) if t is c10d.all_reduce.default and ops[i + 1] is c10d.wait_tensor.default
        ]
    assert len(kept) == (1 if hook_after_ddp else 0)
    assert len(counting.graphs) == 4  # the forward, then 2 buckets and the waits either way


def test_a_failed_split_compile_compiles_the_backward_whole(python_reducer, monkeypatch, caplog):
    from dynamo_ext.spmd import ddp_overlap

    def fail(*args: object) -> None:
        raise RuntimeError("a submodule failed to compile")

    monkeypatch.setattr(ddp_overlap, "_compile_split", fail)
    with caplog.at_level("WARNING", logger="dynamo_ext.spmd.ddp_overlap"):
        counting, model = _run(bucket_cap_mb=CAP_MB)
    assert "compiling the backward whole" in caplog.text
    assert len(counting.graphs) == 2  # the forward and the (merged, equivalent) backward
    ops = _targets(counting.graphs[1])
    assert ops.count(c10d.all_reduce.default) == 2 and ops.count("copy_") == 6
    assert all(p.grad is not None for p in model.parameters())
