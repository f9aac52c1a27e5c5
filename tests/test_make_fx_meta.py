"""``dynamo_ext/make_fx_meta.py``.

NOTE [fake DTensor snapshots]: ``make_fx``'s snapshot of a fake DTensor, made without DTensor's dispatch, equals
the one its ``detach`` gives: spec, requires_grad and the local tensor's metadata and storage.  NOTE [compiled
autograd's capture keeps no memory format]: the graphs compiled autograd hands on are the same without it.
NOTE [make_fx wrappers run untraced]: a backward inside a compiled step does not make Dynamo compile them.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from helpers import compiled_llama_loss

from dynamo_ext import _compat, make_fx_meta
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
        make_fx_meta.install(patches)
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


# ---- NOTE [compiled autograd's capture keeps no memory format] ----------------------------------------------------


def _llama_backward(mesh: Any, capture_part: bool) -> tuple[list[str], list[str], list[torch.Tensor], int]:
    """The bundled Llama's (FSDP over TP, 2 layers) compiled-autograd backward: the captured graph's code with
    each node's meta keys, Dynamo's graph of it, the gradients' local values, and how many contiguity questions
    ``_extract_tensor_metadata`` asked meanwhile."""
    import torch.fx.passes.shape_prop as shape_prop

    module = _compat.proxy_tensor_module()
    asked = [0]
    contiguous = shape_prop.is_contiguous_for_memory_format_or_false

    def counted(*args: Any, **kwargs: Any) -> Any:
        asked[0] += 1
        return contiguous(*args, **kwargs)

    captured: list[str] = []
    dynamo: list[str] = []

    def dynamo_backend(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        dynamo.append(gm.code)
        return gm.forward

    def compiler(gm: torch.fx.GraphModule) -> Any:
        captured.append(gm.code)
        captured.extend(f"{n.name}: {sorted(n.meta)}" for n in gm.graph.nodes)
        return torch.compile(gm, backend=dynamo_backend)

    torch._dynamo.reset()
    model, loss = compiled_llama_loss(mesh)
    patches = Patcher()
    patches.setattr(shape_prop, "is_contiguous_for_memory_format_or_false", counted)
    if not capture_part:  # the plugin installed, this part of it undone
        patches.setattr(module, "set_meta", module.set_meta.__wrapped__)
        patches.setattr(module, "_extract_tensor_metadata", module._extract_tensor_metadata.__wrapped__)
    try:
        with _compat.compiled_autograd(compiler):
            loss.backward()
    finally:
        patches.undo_all()
        torch._dynamo.reset()
    grads = [_compat.local_tensor_of(p.grad) for p in model.parameters()]
    return captured, dynamo, grads, asked[0]


def _normalized(code: list[str]) -> list[str]:
    """FX's file names and compiled autograd's AOTAutograd-backward ids (``aot5_mm``) count up in a process."""
    return [re.sub(r"\baot\d+_", "aot_", re.sub(r"<eval_with_key>\.\d+", "<eval_with_key>", c)) for c in code]


def test_compiled_autograd_graphs_are_the_same_without_the_captures_memory_formats(world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # one mesh: the same group names
    captured, dynamo, grads, asked = _llama_backward(mesh, capture_part=True)
    stock_captured, stock_dynamo, stock_grads, stock_asked = _llama_backward(mesh, capture_part=False)
    assert len(captured) > 100 and len(dynamo) == 1
    assert _normalized(captured) == _normalized(stock_captured)
    assert _normalized(dynamo) == _normalized(stock_dynamo)
    for a, b in zip(grads, stock_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert stock_asked > 100 and asked * 4 < stock_asked, (asked, stock_asked)


def test_make_fx_outside_a_capture_keeps_memory_formats(world):
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    gm = make_fx(lambda t: t.relu() + 1, tracing_mode="symbolic")(x)
    formats = [n.meta["tensor_meta"].memory_format for n in gm.graph.nodes if "tensor_meta" in n.meta]
    assert formats and all(f == torch.channels_last for f in formats), formats


# ---- NOTE [make_fx wrappers run untraced] --------------------------------------------------------------------------


def test_backward_inside_a_compiled_step_runs_the_wrappers_untraced(world):
    """``loss.backward()`` inside a compiled step under compiled autograd (the python reducer's way): the capture
    runs the wrappers while a frame Dynamo compiled is running; Dynamo compiles none of them."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.distributed.device_mesh import init_device_mesh

    from dynamo_ext.audit.targets import example_llama as ex

    module = _compat.proxy_tensor_module()
    wrappers = [module.snapshot_fake, module.set_meta, module._extract_tensor_metadata]
    cfg = ex.Config(n_layers=2)
    torch.manual_seed(0)
    model = ex.parallelize(ex.Decoder(cfg), init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1))
    with torch._dynamo.config.patch(compiled_autograd=True):

        @torch.compile(backend="aot_eager")
        def step(tokens: torch.Tensor) -> torch.Tensor:
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            return loss

    try:
        step(tokens)
        compiled = [w.__name__ for w in wrappers if _debug_get_cache_entry_list(w.__code__)]
    finally:
        torch._dynamo.reset()
    assert not compiled, compiled
    assert all(p.grad is not None for p in model.parameters())
