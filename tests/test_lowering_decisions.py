"""The residual RMSNorm fusion's decisions: on by default where it applies, logged per candidate, recorded, agreed by every rank.

- Tier 1 (fake process group): the log line for each candidate (applied fusion or the
  first failed condition), the ``dynamo_ext_fusion`` structured artifact and the
  :func:`applied_fusions` records, each switch in ``options``, the symmetric-memory route
  of each release (NOTE [symmetric memory route]), layouts handled before lowering, and
  the run-time path choice of the CUDA implementation.
- Tier 2 (2 gloo ranks): one rank's local symmetric-memory state differs; both ranks still
  compile the same collectives and match eager.
"""

from __future__ import annotations

import functools
import json
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import run_on_ranks
from test_lowering_patterns import _args, _compile, block_manual

import dynamo_ext
from dynamo_ext import _compat
from dynamo_ext.inductor_lowerings import decisions, ops, options, rms_norm_fusion, rms_norm_lowering

FUSION_LOGGER = "dynamo_ext.inductor_lowerings.rms_norm_fusion"


@pytest.fixture(autouse=True)
def _default_options():
    saved = options.get_config_copy()
    decisions.applied_fusions(clear=True)
    with _compat.inductor_config().patch(fx_graph_cache=False):  # a cache hit skips the passes
        yield
    options.load_config(saved)


@pytest.fixture
def cpu_kernel_path(monkeypatch):
    """The fused-kernel path taken on the CPU: comm buffers left out so the CPU wrapper can emit the call."""
    options.one_shot = True
    options.one_shot_device_types = ("cpu",)
    monkeypatch.setattr(rms_norm_lowering, "_into_comm_buffer", lambda x, group_name: x)


def _messages(caplog, name=FUSION_LOGGER):
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_each_candidate_is_logged_with_the_fusion_or_the_first_failed_condition(world, caplog):
    def fn(x, residual, w, weight):
        r = funcol.all_reduce(x @ w, "sum", dist.group.WORLD) + residual
        y, s = block_manual(x, r, w, weight)
        return y, s, r * torch.rsqrt(r.pow(2).sum(-1, keepdim=True) + 1e-6)  # sum, not mean: no RMSNorm

    caplog.set_level(logging.DEBUG, logger="dynamo_ext")
    args = _args(torch.float32, rows=8, hidden=64)
    out, _ = _compile(fn, *args)
    torch.testing.assert_close(out, fn(*args))
    msgs = _messages(caplog)
    assert any(
        m.startswith("applied [0/0] residual_rms_norm (epilogue) on group 0, 2048 bytes at all_reduce") for m in msgs
    )
    assert (
        "fused all-reduce kernel not applied at all_reduce_1: options.one_shot is off "
        "(off by default until measured on a GPU)"
    ) in msgs
    assert any("residual_rms_norm not applied at all_reduce: no RMSNorm over the last dim" in m for m in msgs), msgs
    [record] = decisions.applied_fusions()
    assert (record.fusion, record.kernel, record.group_name, record.nbytes) == (
        "residual_rms_norm",
        "epilogue",
        "0",
        2048,
    )


def test_switched_off_fusions_say_so(world, caplog):
    caplog.set_level(logging.DEBUG, logger="dynamo_ext")
    options.residual_rms_norm = False
    _compile(block_manual, *_args(torch.float32, rows=4, hidden=16))
    assert "residual_rms_norm off (options.residual_rms_norm = False)" in _messages(caplog)
    assert decisions.applied_fusions() == []
    options.residual_rms_norm = True
    options.one_shot = False
    options.one_shot_device_types = ("cpu",)
    _compile(block_manual, *_args(torch.float32, rows=4, hidden=16))
    assert any(
        m.endswith(": options.one_shot is off (off by default until measured on a GPU)") for m in _messages(caplog)
    )
    assert [r.kernel for r in decisions.applied_fusions()] == ["epilogue"]


def test_fused_kernels_are_off_by_default_and_say_so_once(world, caplog, monkeypatch):
    """Off until measured on a GPU: the default keeps the stock all-reduce and logs the opt-in once per process."""
    assert options.one_shot is False
    monkeypatch.setattr(rms_norm_fusion, "_told_off_by_default", [])
    options.one_shot_device_types = ("cpu",)  # a device the kernels would take: the INFO line applies
    caplog.set_level(logging.INFO, logger="dynamo_ext")
    for rows in (4, 8):  # two compiles, one INFO line
        torch._dynamo.reset()
        _compile(block_manual, *_args(torch.float32, rows=rows, hidden=16))
    told = [m for m in _messages(caplog) if "off by default until measured on a GPU" in m]
    assert told == [
        "fused all-reduce + RMSNorm Triton kernels are off by default until measured on a GPU; "
        "dynamo_ext.inductor_lowerings.options.one_shot = True opts in"
    ]
    assert [r.kernel for r in decisions.applied_fusions()] == ["epilogue", "epilogue"]


def test_first_failed_condition_follows_the_documented_order(world):
    options.one_shot = True
    options.one_shot_device_types = ("cpu",)
    options.one_shot_max_hidden = 8
    options.two_shot_max_bytes = options.one_shot_max_bytes = 64
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def graph_of(fn, *args):
        g = make_fx(fn)(*args)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        FakeTensorProp(g, mode).propagate(*[mode.from_tensor(a) for a in args])
        return g

    def fn(x, residual):
        r = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "0")) + residual
        return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6)

    g = graph_of(fn, torch.randn(4, 16), torch.randn(4, 16))
    [ar] = [n for n in g.graph.nodes if n.target == torch.ops._c10d_functional.all_reduce.default]
    match = rms_norm_fusion.match_residual_rms_norm(ar)
    assert rms_norm_fusion.one_shot_refusal(match) == "256 bytes > options.two_shot_max_bytes (64)"
    options.two_shot_max_bytes = 1 << 20
    assert rms_norm_fusion.one_shot_refusal(match) == "rows of 16 elements > options.one_shot_max_hidden (8)"
    options.one_shot_max_hidden = 16
    assert rms_norm_fusion.one_shot_refusal(match) is None


def test_on_by_default_without_any_user_call_and_recorded(world, cpu_kernel_path):
    """2.13 and 2.15: ``enable_symm_mem_for_group`` is deprecated; the pass fuses without it (and without calling it),
    whatever this release's ``is_symm_mem_enabled_for_group`` answers (2.15: no accelerator backend here)."""
    if _compat.symm_mem_route() != "automatic":
        pytest.skip(f"this torch's symmetric-memory route is {_compat.symm_mem_route()!r}")
    mod = _compat.symm_mem_module()
    assert not _compat.symm_mem_registered("0") and not getattr(mod, "_is_test_mode", False)
    assert not _compat.is_symm_mem_enabled_for_group("0")  # 2.13: not registered; 2.15: no backend on the CPU
    args = _args(torch.float32, rows=8, hidden=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the deprecated call is never made
        out, code = _compile(block_manual, *args)
    assert "dynamo_ext.one_shot_all_reduce_residual_rms_norm.default(" in code[code.index("def call") :]
    assert not _compat.symm_mem_registered("0")
    assert [(r.kernel, r.nbytes) for r in decisions.applied_fusions()] == [("one_shot", 2048)]
    for o, e in zip(out, block_manual(*args)):
        torch.testing.assert_close(o, e, rtol=1e-6, atol=1e-6)


def test_applied_fusions_reach_the_structured_trace(world):
    events = []

    class Handler(logging.Handler):
        def emit(self, record):
            md = getattr(record, "metadata", {}) or {}
            if md.get("artifact", {}).get("name") == decisions.ARTIFACT_NAME:
                events.append(json.loads(record.payload))

    trace = logging.getLogger("torch.__trace")
    handler, level = Handler(level=logging.DEBUG), trace.level
    trace.addHandler(handler)
    trace.setLevel(logging.DEBUG)
    try:
        _compile(block_manual, *_args(torch.float32, rows=4, hidden=16))
    finally:
        trace.removeHandler(handler)
        trace.setLevel(level)
    assert [(e["fusion"], e["kernel"], e["compile_id"], e["nbytes"]) for e in events] == [
        ("residual_rms_norm", "epilogue", "0/0", 256)
    ]


def test_this_release_route_never_registers_and_uninstall_leaves_the_registry(world, cpu_kernel_path, monkeypatch):
    """The route this release really has, through its own functions: where ``enable_symm_mem_for_group`` is
    deprecated (2.13, 2.15) the pass never calls it, two compiles fuse alike, and uninstall leaves the registry
    (which a user may have written) as it was."""
    route = _compat.symm_mem_route()
    if route != "automatic":
        pytest.skip(f"this torch's symmetric-memory route is {route!r}")
    mod = _compat.symm_mem_module()
    real = mod.enable_symm_mem_for_group
    calls = []
    spy = functools.wraps(real)(lambda group_name: calls.append(group_name) or real(group_name))
    monkeypatch.setattr(mod, "enable_symm_mem_for_group", spy)  # keeps the real one's deprecation mark
    assert _compat.symm_mem_route() == "automatic"
    for _ in range(2):
        _compile(block_manual, *_args(torch.float32, rows=4, hidden=16))
    assert calls == [] and not _compat.symm_mem_registered("0")
    assert [r.kernel for r in decisions.applied_fusions()] == ["one_shot", "one_shot"]
    monkeypatch.setitem(mod._group_name_to_store, "user's", object())
    dynamo_ext.uninstall()
    assert _compat.symm_mem_registered("user's")
    dynamo_ext.install()


def test_enable_route_registers_the_group_once_and_uninstall_forgets_it(world, cpu_kernel_path, monkeypatch):
    """The pre-2.13 route (2.11, 2.12: ``enable_symm_mem_for_group`` not deprecated), which no release this suite
    runs on has, so its function is replaced: the pass registers the group once and uninstall forgets it.
    Registration is read from the registry the function writes, not from ``is_symm_mem_enabled_for_group``
    (whose 2.15 meaning is "this accelerator has a backend")."""
    mod = _compat.symm_mem_module()
    calls = []

    def enable(group_name):  # no __deprecated__: the pre-2.13 function
        calls.append(group_name)
        mod._group_name_to_store[group_name] = object()

    monkeypatch.setattr(mod, "enable_symm_mem_for_group", enable)
    assert _compat.symm_mem_route() == "enable"
    for _ in range(2):
        _compile(block_manual, *_args(torch.float32, rows=4, hidden=16))
    assert calls == ["0"] and _compat.symm_mem_registered("0")
    dynamo_ext.uninstall()
    assert not _compat.symm_mem_registered("0")
    dynamo_ext.install()


def test_a_failing_route_raises_instead_of_falling_back_alone(world, cpu_kernel_path, monkeypatch):
    mod = _compat.symm_mem_module()

    def enable(group_name):
        raise KeyError(group_name)

    monkeypatch.setattr(mod, "enable_symm_mem_for_group", enable)
    with pytest.raises(Exception, match="could not set up symmetric memory for process group '0' on this rank"):
        _compile(block_manual, *_args(torch.float32, rows=4, hidden=16))


def test_a_view_input_becomes_a_contiguous_comm_buffer(world):
    """A transposed all-reduce input: lowered as a contiguous copy in symmetric memory, never the view."""
    from test_lowering_patterns import _post_grad_graph_or_error

    options.one_shot = True
    options.one_shot_device_types = ("cpu",)
    layouts = []
    real = rms_norm_lowering._into_comm_buffer

    def spy(x, group_name):
        out = real(x, group_name)
        layout = out.data.data.get_output_spec()
        layouts.append((type(layout).__name__, layout.is_contiguous(), type(x.data).__name__))
        return out

    def fn(x, residual, w, weight):
        h = funcol.all_reduce((w.t() @ x.t()).t(), "sum", dist.group.WORLD)  # [rows, hidden], transposed strides
        r = h + residual
        return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6) * weight, r

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rms_norm_lowering, "_into_comm_buffer", spy)
        _post_grad_graph_or_error(fn, *_args(torch.float32, rows=8, hidden=64))
    assert layouts == [("CommBufferLayout", True, "ReinterpretView")]


def test_run_time_path_depends_only_on_shared_facts(world, monkeypatch):
    """The CUDA implementation's choice, run on CPU tensors: layouts and symmetric-ness decide; a failed
    rendezvous raises (the other ranks are in the kernel's barrier) instead of falling back on one rank."""
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import PeerBuffers

    pytest.importorskip("triton")
    x, residual = torch.randn(4, 16), torch.randn(4, 16)
    group = dist.group.WORLD.group_name
    args = (None, 1e-6, None, None, None, group)
    assert ops.kernel_refusal(x.t().contiguous().t(), residual, None) == (
        "input (4, 16) and residual (4, 16) must have one shape and be contiguous"
    )
    assert "float32" in ops.kernel_refusal(x.bfloat16(), residual.bfloat16(), None, None, None, None)
    # non-contiguous: the fallback, never check_arguments' ValueError
    got = ops._one_shot_cuda(x.t().contiguous().t(), residual, *args)
    torch.testing.assert_close(got[0], x + residual)  # the fake group's all-reduce returns its input
    # not a symmetric-memory tensor (an eager call, the same on every rank): the fallback
    torch.testing.assert_close(ops._one_shot_cuda(x, residual, *args)[0], x + residual)

    def fail(tensor, group_name):
        raise RuntimeError("rendezvous failed")

    monkeypatch.setattr(_compat, "is_symm_mem_tensor", lambda t: True)
    monkeypatch.setattr(PeerBuffers, "from_symmetric_memory", classmethod(lambda cls, t, g: fail(t, g)))
    with pytest.raises(RuntimeError, match="cannot fall back alone") as info:
        ops._one_shot_cuda(x, residual, *args)
    assert "rendezvous failed" in str(info.value.__cause__)


# ---- tier 2: ranks that differ locally still agree ----------------------------------------------
def _differing_rank(rank: int, world_size: int) -> dict:
    from torch._inductor.utils import run_and_get_code

    import dynamo_ext
    from dynamo_ext import _compat
    from dynamo_ext.inductor_lowerings import decisions, options, rms_norm_lowering

    options.one_shot = True
    options.one_shot_device_types = ("cpu",)
    rms_norm_lowering._into_comm_buffer = lambda x, group_name: x  # CPU wrapper: no comm buffers
    group = dist.group.WORLD.group_name
    if rank == 0:  # only rank 0 has the group in the deprecated registry: a local difference
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            _compat.symm_mem_module().enable_symm_mem_for_group(group)
    g = torch.Generator().manual_seed(rank)
    x, residual, weight = torch.randn(8, 64, generator=g), torch.randn(8, 64), torch.randn(64)
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(7)) / 8
    eager = block_manual(x, residual, w, weight)
    # no FX graph cache: rank 1 would hit rank 0's entry (one cache directory) and run no pass
    with dynamo_ext.enabled(), _compat.inductor_config().patch(fx_graph_cache=False):
        torch._dynamo.reset()
        out, code = run_and_get_code(torch.compile(block_manual, backend="inductor"), x, residual, w, weight)
    call = "\n".join(code)
    call = call[call.index("def call") :]
    return {
        "enabled_here": _compat.symm_mem_registered(group),
        "fused": "one_shot_all_reduce_residual_rms_norm.default(" in call,
        "stock_all_reduce": "all_reduce_.default(" in call,
        "kernels": [r.kernel for r in decisions.applied_fusions()],
        "max_err": max((o - e).abs().max().item() for o, e in zip(out, eager)),
    }


@pytest.mark.gloo
def test_ranks_with_different_local_symm_mem_state_compile_the_same_collectives():
    if _compat.symm_mem_route() == "none":
        pytest.skip("no symmetric memory in this build")
    results = run_on_ranks(_differing_rank, nproc=2, plugin=False)
    assert [r["enabled_here"] for r in results] == [True, False]
    assert [(r["fused"], r["stock_all_reduce"], r["kernels"]) for r in results] == [(True, False, ["one_shot"])] * 2
    assert all(r["max_err"] <= 1e-5 for r in results), results
