"""NOTE [fake DTensor snapshots]: ``make_fx``'s snapshot of a fake DTensor, made without DTensor's dispatch,
equals the one its ``detach`` gives: spec, requires_grad and the local tensor's metadata and storage."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dynamo_ext import _compat, dtensor_snapshot
from dynamo_ext._patching import Patcher


def _dtensors() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)

    def make(mesh: Any, placements: list[Any], local: tuple[int, int], shape: tuple[int, int]) -> Any:
        stride = (shape[1], 1)
        t = DTensor.from_local(torch.randn(local), mesh, placements, run_check=False, shape=shape, stride=stride)
        return t.requires_grad_()

    return {
        "uneven_shard": make(mesh1, [Shard(0)], (3, 5), (10, 5)),
        "replicate": make(mesh1, [Replicate()], (6, 4), (6, 4)),
        "partial": make(mesh1, [Partial()], (6, 4), (6, 4)),
        "shard_2d": make(mesh2, [Shard(0), Shard(1)], (4, 3), (8, 6)),
    }


def _facts(snapshot: Any, fake: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    local = snapshot._local_tensor
    return {
        "type": type(snapshot) is DTensor,
        "spec": snapshot._spec,
        "requires_grad": snapshot.requires_grad,
        "outer": (snapshot.shape, snapshot.stride(), snapshot.dtype),
        "local": (type(local), local.shape, local.stride(), local.dtype, local.storage_offset(), local.device),
        "same fake mode": local.fake_mode is fake._local_tensor.fake_mode,
        "shares storage": _compat.storage_of(local) == _compat.storage_of(fake._local_tensor),
    }


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("case", ["uneven_shard", "replicate", "partial", "shard_2d"])
def test_snapshot_equals_dtensor_detach(world, case: str, symbolic: bool):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    module = _compat.proxy_tensor_module()
    ours = module.snapshot_fake  # the plugin is installed
    stock = ours.__wrapped__
    mode = FakeTensorMode(shape_env=ShapeEnv() if symbolic else None)
    fake = mode.from_tensor(_dtensors()[case])
    assert any(isinstance(s, torch.SymInt) for s in fake.shape) == symbolic
    with mode:  # DTensor's dispatch of detach needs the fake mode for symbolic sizes
        expected = _facts(stock(fake), fake)
        got = _facts(ours(fake), fake)
    assert got == expected
    assert expected["type"] and expected["shares storage"] and not expected["requires_grad"]


def test_other_values_go_to_the_original():
    calls = []

    def original(val: Any, include_real: bool = False) -> Any:
        calls.append((val, include_real))
        return "snapshot"

    module = type(
        "proxy_tensor", (), {"snapshot_fake": staticmethod(original), "is_fake": staticmethod(lambda v: True)}
    )
    patches = Patcher()
    patches.setattr(_compat, "proxy_tensor_module", lambda: module)
    try:
        dtensor_snapshot.install(patches)
        plain = torch.ones(2)
        assert module.snapshot_fake(plain, include_real=True) == "snapshot"
    finally:
        patches.undo_all()
    assert calls == [(plain, True)]
    assert module.snapshot_fake is original


def test_compiled_autograd_capture_of_fsdp_over_tp_llama_snapshots_as_detach(world):
    """Every fake DTensor compiled autograd snapshots while capturing the bundled Llama's backward (FSDP2 over TP):
    the snapshot made without the dispatch has the facts of the one ``detach`` gives, made then and there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from dynamo_ext.audit.targets import example_llama as ex

    module = _compat.proxy_tensor_module()
    ours = module.snapshot_fake
    compared: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def both(val: Any, include_real: bool = False) -> Any:
        snapshot = ours(val, include_real=include_real)
        if type(val) is DTensor:
            compared.append((_facts(snapshot, val), _facts(ours.__wrapped__(val, include_real=include_real), val)))
        return snapshot

    cfg = ex.Config(n_layers=2)
    torch.manual_seed(0)
    model = ex.parallelize(ex.Decoder(cfg), init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1))
    patches = Patcher()
    patches.setattr(module, "snapshot_fake", both)
    try:
        logits = torch.compile(model, backend="aot_eager")(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        with ex.compiled_backward("aot_eager"):
            loss.backward()
    finally:
        patches.undo_all()
    assert len(compared) >= 20  # the parameters at the capture's start, their gradients, ...
    for got, expected in compared:
        assert got == expected
