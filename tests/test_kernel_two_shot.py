"""The two-shot all-reduce + residual add + RMSNorm Triton kernel (NOTE [two-shot all-reduce]).

- Under ``TRITON_INTERPRET=1`` on the CPU, across 2 and 4 real processes sharing
  ``MAP_SHARED`` files, as the one-shot tests: each rank reduces and normalizes its
  slice of rows, stages it in its own buffer, and gathers the peers' slices.  Odd
  sizes, rows not divisible by the world size (and fewer rows than ranks), fp32 and
  bf16, the chain's cast variants, against float64 and the exact-dtype reference; the
  signal pads are back to zero afterwards.
- Compiled offline for sm_90 (no GPU needed): three parallel barriers of sys-scope acquire/release, 16-byte peer reads.
- The size dispatch (``ops.fused_all_reduce_algorithm``, ``options.two_shot_max_bytes``)
  and the fusion pass admitting two-shot sizes, on the CPU.
- On a CUDA device (``gpu`` marker): symmetric memory at world size 1.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from helpers import run_on_ranks
from test_kernel_one_shot import (  # noqa: F401
    EPS,
    _case_inputs,
    _nvidia_backend_available,
    compile_for_sm90,
    one_rank_nccl_group,
    peer_load_widths,
)

# (rows, cols, dtype, weight, upcast, mid_dtype, out_dtype)
CASES = [
    (5, 37, torch.float32, True, None, None, None),  # 5 rows: not divisible by 2 or 4
    (3, 130, torch.bfloat16, True, torch.float32, torch.bfloat16, None),  # Llama: weight * h.to(bf16)
    (7, 33, torch.bfloat16, True, torch.float32, None, torch.bfloat16),  # _fused_rms_norm decomposition
    (2, 50, torch.float16, True, torch.float32, torch.float16, None),
    (13, 64, torch.float32, False, None, None, None),  # more rows per rank than programs
    (1, 1, torch.float32, True, None, None, None),  # fewer rows than ranks: empty slices
    (11, 257, torch.bfloat16, False, torch.float32, torch.bfloat16, None),
]
MAX_BLOCKS = 2
BUFFER_NBYTES = 1 << 16


@pytest.fixture
def lowering_options():
    from dynamo_ext.inductor_lowerings import options

    saved = options.get_config_copy()
    yield options
    options.load_config(saved)


def _interpreted_rank(rank: int, world_size: int, directory: str, staging_dir: str) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from dynamo_ext.inductor_lowerings.kernels import two_shot_all_reduce_rms_norm as kernel
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import PeerBuffers

    assert os.environ.get("TRITON_INTERPRET") == "1"
    peers = PeerBuffers.open_host_shared(directory, rank=rank, world_size=world_size)
    workspace = PeerBuffers.open_host_shared(staging_dir, rank=rank, world_size=world_size)
    results = []
    for i, case in enumerate(CASES):  # one buffer reused case after case: the exit barrier makes that safe
        rows, cols, dtype, _, upcast, mid, out_dtype = case
        inputs, residual, weight = _case_inputs(case, world_size)
        x = peers.local_tensor((rows, cols), dtype)
        x.copy_(inputs[rank])
        casts = {"upcast": upcast, "mid_dtype": mid, "out_dtype": out_dtype}
        got = kernel.two_shot_all_reduce_residual_rms_norm(
            peers,
            x,
            residual,
            weight,
            eps=EPS,
            max_blocks=MAX_BLOCKS,
            staging=workspace if i % 2 else None,  # a separate workspace, or after the input
            **casts,
        )
        exact = kernel.reference(inputs, residual, weight, eps=EPS, **casts)
        truth = kernel.reference_float64(inputs, residual, weight, eps=EPS)
        results.append(
            {
                "case": (rows, cols, str(dtype), weight is not None),
                "dtypes": [t.dtype for t in got] == [t.dtype for t in exact],
                "vs_reference": [(g.double() - e.double()).abs().max().item() for g, e in zip(got, exact)],
                "vs_float64_rel": [((g.double() - t).abs() / (t.abs() + 1)).max().item() for g, t in zip(got, truth)],
                "input_untouched": bool(torch.equal(x, inputs[rank])),
            }
        )
    dist.barrier()  # every rank is past its last exit barrier
    results.append({"signal_slots_left_raised": int(peers.keepalive[1][rank].count_nonzero())})
    return results


@pytest.mark.parametrize("world_size", [4])
def test_two_shot_kernel_across_processes_under_the_interpreter(world_size, tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import create_host_shared

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned ranks
    create_host_shared(str(tmp_path), world_size=world_size, buffer_nbytes=BUFFER_NBYTES, max_blocks=MAX_BLOCKS)
    (tmp_path / "staging").mkdir()
    staging = str(tmp_path / "staging")
    create_host_shared(staging, world_size=world_size, buffer_nbytes=BUFFER_NBYTES, max_blocks=1)
    by_rank = run_on_ranks(_interpreted_rank, str(tmp_path), staging, nproc=world_size, plugin=False)
    for rank, results in enumerate(by_rank):
        assert results[-1]["signal_slots_left_raised"] == 0, f"rank {rank}: barrier left slots raised"
        for r, case in zip(results[:-1], CASES, strict=True):
            dtype = case[2]
            # fp32: only summation order differs; fp16/bf16: at most one ulp of the output dtype
            ulp = {torch.float32: 2e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
            assert r["dtypes"], f"rank {rank} {r['case']}: output dtypes differ from the reference"
            assert r["input_untouched"], f"rank {rank} {r['case']}: the kernel wrote over its input"
            for name, err, scale in zip(("sum", "normed", "rstd"), r["vs_reference"], (8, 8, 1)):
                assert err <= ulp * scale, f"rank {rank} {r['case']}: {name} off the exact reference by {err}"
            for name, err in zip(("sum", "normed", "rstd"), r["vs_float64_rel"]):
                assert err <= 4 * ulp, f"rank {rank} {r['case']}: {name} off float64 by {err} (relative)"


def test_staging_must_fit_the_buffer_clear_of_the_input(tmp_path):
    pytest.importorskip("triton")
    from dynamo_ext.inductor_lowerings.kernels import two_shot_all_reduce_rms_norm as kernel
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import PeerBuffers, create_host_shared

    create_host_shared(str(tmp_path), world_size=1, buffer_nbytes=4096, max_blocks=1)
    peers = PeerBuffers.open_host_shared(str(tmp_path), rank=0, world_size=1)
    x = peers.local_tensor((4, 100), torch.float32)  # 1600 bytes: its staging needs 3216 more
    residual = torch.zeros(4, 100)
    assert kernel.staging_nbytes((4, 100), torch.float32, torch.float32) > 4096 - x.nbytes
    with pytest.raises(ValueError, match="staging"):
        kernel.two_shot_all_reduce_residual_rms_norm(peers, x, residual, None, eps=EPS)
    with pytest.raises(ValueError, match="clear of the input"):
        kernel.two_shot_all_reduce_residual_rms_norm(peers, x, residual, None, eps=EPS, staging_offset=800)


def test_the_kernel_is_picked_by_input_size(lowering_options):
    from dynamo_ext.inductor_lowerings.ops import fused_all_reduce_algorithm

    one, two = lowering_options.one_shot_max_bytes, lowering_options.two_shot_max_bytes
    assert one < two
    assert fused_all_reduce_algorithm(1) == "one_shot"
    assert fused_all_reduce_algorithm(one) == "one_shot"
    assert fused_all_reduce_algorithm(one + 1) == "two_shot"
    assert fused_all_reduce_algorithm(two) == "two_shot"
    assert fused_all_reduce_algorithm(two + 1) is None
    lowering_options.two_shot_max_bytes = one  # two-shot off
    assert fused_all_reduce_algorithm(one + 1) is None


@pytest.mark.parametrize(("one_shot_max", "two_shot_max", "fused"), [(1024, 4096, True), (1024, 1024, False)])
def test_fusion_pass_admits_two_shot_sizes(world, monkeypatch, lowering_options, one_shot_max, two_shot_max, fused):
    """A 2 KiB all-reduce above ``one_shot_max_bytes``: fused up to ``two_shot_max_bytes``, else stock."""
    from test_lowering_patterns import _args, _compile, block_manual

    from dynamo_ext import _compat
    from dynamo_ext.inductor_lowerings import rms_norm_lowering

    test_mode = _compat.symm_mem_test_mode()
    if test_mode is None:
        pytest.skip("this torch has no symmetric-memory test mode")
    lowering_options.one_shot = True
    lowering_options.one_shot_device_types = ("cpu",)
    lowering_options.one_shot_max_bytes, lowering_options.two_shot_max_bytes = one_shot_max, two_shot_max
    monkeypatch.setattr(rms_norm_lowering, "_into_comm_buffer", lambda x, group_name: x)
    args = _args(torch.float32, rows=8, hidden=64)  # 8 x 64 x 4 = 2048 bytes
    with test_mode():
        out, code = _compile(block_manual, *args)
    call = code[code.index("def call") :]
    assert ("dynamo_ext.one_shot_all_reduce_residual_rms_norm.default(" in call) == fused
    assert ("all_reduce_.default(" in call) != fused
    for o, e in zip(out, block_manual(*args)):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)  # fp32: the stock path's sum order may differ


@pytest.mark.skipif(not _nvidia_backend_available(), reason="triton without its NVIDIA backend")
def test_kernel_compiles_for_sm90_with_system_scope_acquire_release():
    """No GPU needed: three barriers, each one vector sys-scope release CAS and one acquire CAS (one lane per
    peer); peer reads (input and staged rows) are 16-byte loads; the chunked epilogue compiles."""
    from dynamo_ext.inductor_lowerings.kernels._two_shot_all_reduce_rms_norm_kernel import (
        _two_shot_all_reduce_residual_rms_norm_kernel as kernel,
    )

    world = 4
    tables = ("buffer_ptrs", "signal_pad_ptrs", "staging_ptrs")
    offsets = ("input_offset", "sum_stage_offset", "norm_stage_offset", "rstd_stage_offset")
    compiled = compile_for_sm90(kernel, world, int64_args=tables + offsets, n_chunks=2)
    ptx = compiled.asm["ptx"]
    assert "cubin" in compiled.asm
    assert ptx.count("atom.global.release.sys.cas.b32") == 3
    assert ptx.count("atom.global.acquire.sys.cas.b32") == 3
    loads = peer_load_widths(ptx)
    assert sum(".v4." in m for m in loads) >= world and not any(m.endswith(".b16") for m in loads), loads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_shot_kernel_on_symmetric_memory(one_rank_nccl_group, dtype):  # noqa: F811
    import torch.distributed._symmetric_memory as symm_mem

    from dynamo_ext.inductor_lowerings.kernels import two_shot_all_reduce_rms_norm as kernel
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import PeerBuffers

    rows, cols = 37, 4099
    staging = kernel.staging_nbytes((rows, cols), dtype, dtype)
    flat = symm_mem.empty(rows * cols + staging // dtype.itemsize, dtype=dtype, device="cuda")
    x = flat[: rows * cols].view(rows, cols)
    inputs, residual, weight = _case_inputs((rows, cols, dtype, True), 1)
    x.copy_(inputs[0])
    peers = PeerBuffers.from_symmetric_memory(flat, one_rank_nccl_group)
    upcast = None if dtype == torch.float32 else torch.float32
    mid = None if dtype == torch.float32 else dtype
    got = kernel.two_shot_all_reduce_residual_rms_norm(
        peers, x, residual.cuda(), weight.cuda(), eps=EPS, upcast=upcast, mid_dtype=mid
    )
    exact = kernel.reference(inputs, residual, weight, eps=EPS, upcast=upcast, mid_dtype=mid)
    tol = 2e-6 if dtype == torch.float32 else 2**-7
    for g, e in zip(got, exact):
        torch.testing.assert_close(g.cpu(), e, rtol=tol, atol=tol)
