"""The one-shot all-reduce + residual add + RMSNorm Triton kernel.

- Under ``TRITON_INTERPRET=1`` on the CPU, across 2 and 4 real processes: each rank's
  input lives in a file mapped ``MAP_SHARED`` into every process, and the kernel reads
  its peers' rows through raw addresses and meets them at barriers built from
  ``tl.atomic_cas`` on shared signal pads (NOTE [one-shot barrier]).  Odd sizes, fp32,
  bf16 and fp16, the chain's cast variants, against float64 and the exact-dtype reference.
- Compiled offline for sm_90 (no GPU needed): the barrier's memory semantics and parallelism,
  16-byte peer reads when alignment is promised, the chunked epilogue.
- On a CUDA device (``gpu`` marker): symmetric memory and a compiled TP block.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from helpers import run_on_ranks

# (rows, cols, dtype, weight, upcast, mid_dtype, out_dtype): the chain variants the pass records
CASES = [
    (5, 37, torch.float32, True, None, None, None),
    (3, 130, torch.bfloat16, True, torch.float32, torch.bfloat16, None),  # Llama: weight * h.to(bf16)
    (7, 33, torch.bfloat16, True, torch.float32, None, torch.bfloat16),  # _fused_rms_norm decomposition
    (2, 50, torch.float16, True, torch.float32, torch.float16, None),
    (9, 64, torch.float32, False, None, None, None),  # more rows than programs: the persistent loop
    (1, 1, torch.float32, True, None, None, None),
]
MAX_BLOCKS = 2
EPS = 1e-6


def _case_inputs(case: tuple[Any, ...], world_size: int) -> tuple[list[torch.Tensor], torch.Tensor, Any]:
    rows, cols, dtype, has_weight = case[:4]
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    inputs = [torch.randn(rows, cols, generator=g).to(dtype) for _ in range(world_size)]
    residual = torch.randn(rows, cols, generator=g).to(dtype)
    weight = (1 + 0.5 * torch.randn(cols, generator=g)).to(dtype) if has_weight else None
    return inputs, residual, weight


def _interpreted_rank(rank: int, world_size: int, directory: str) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from dynamo_ext.inductor_lowerings.kernels import one_shot_all_reduce_rms_norm as kernel
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import PeerBuffers

    assert os.environ.get("TRITON_INTERPRET") == "1"
    peers = PeerBuffers.open_host_shared(directory, rank=rank, world_size=world_size)
    results = []
    for case in CASES:  # one buffer reused case after case: the exit barrier makes that safe
        rows, cols, dtype, _, upcast, mid, out_dtype = case
        inputs, residual, weight = _case_inputs(case, world_size)
        x = peers.local_tensor((rows, cols), dtype)
        x.copy_(inputs[rank])
        casts = {"upcast": upcast, "mid_dtype": mid, "out_dtype": out_dtype}
        got = kernel.one_shot_all_reduce_residual_rms_norm(
            peers, x, residual, weight, eps=EPS, max_blocks=MAX_BLOCKS, **casts
        )
        exact = kernel.reference(inputs, residual, weight, eps=EPS, **casts)
        truth = kernel.reference_float64(inputs, residual, weight, eps=EPS)
        results.append(
            {
                "case": (rows, cols, str(dtype), weight is not None),
                "dtypes": [t.dtype for t in got] == [t.dtype for t in exact],
                "vs_reference": [(g.double() - e.double()).abs().max().item() for g, e in zip(got, exact)],
                "vs_float64_rel": [((g.double() - t).abs() / (t.abs() + 1)).max().item() for g, t in zip(got, truth)],
            }
        )
    dist.barrier()  # every rank is past its last exit barrier
    results.append({"signal_slots_left_raised": int(peers.keepalive[1][rank].count_nonzero())})
    return results


@pytest.mark.parametrize("world_size", [4])
def test_one_shot_kernel_across_processes_under_the_interpreter(world_size, tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import create_host_shared

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned ranks
    create_host_shared(str(tmp_path), world_size=world_size, buffer_nbytes=1 << 16, max_blocks=MAX_BLOCKS)
    by_rank = run_on_ranks(_interpreted_rank, str(tmp_path), nproc=world_size, plugin=False)
    for rank, results in enumerate(by_rank):
        assert results[-1]["signal_slots_left_raised"] == 0, f"rank {rank}: barrier left slots raised"
        for r, case in zip(results[:-1], CASES):
            dtype = case[2]
            # fp32: only summation order differs; fp16/bf16: at most one ulp of the output dtype
            ulp = {torch.float32: 2e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
            assert r["dtypes"], f"rank {rank} {r['case']}: output dtypes differ from the reference"
            for name, err, scale in zip(("sum", "normed", "rstd"), r["vs_reference"], (8, 8, 1)):
                assert err <= ulp * scale, f"rank {rank} {r['case']}: {name} off the exact reference by {err}"
            for name, err in zip(("sum", "normed", "rstd"), r["vs_float64_rel"]):
                assert err <= 4 * ulp, f"rank {rank} {r['case']}: {name} off float64 by {err} (relative)"


def _nvidia_backend_available() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        return False
    return True


def compile_for_sm90(kernel, world: int, *, int64_args: tuple[str, ...], vec: int = 8, n_chunks: int = 1):
    """Compile a fused all-reduce + RMSNorm kernel for sm_90 offline (bf16 data, weight, bf16 mid cast).

    ``int64_args`` are the kernel's address-table and offset arguments; the rest of
    the signature is shared by the one- and two-shot kernels.
    """
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        **dict.fromkeys(int64_args, "i64"),
        **dict.fromkeys(("residual_ptr", "weight_ptr", "sum_out_ptr", "norm_out_ptr"), "*bf16"),
        "rstd_out_ptr": "*fp32",
        **dict.fromkeys(("n_rows", "n_cols", "rank"), "i32"),
        "eps": "fp32",
        **dict.fromkeys(
            ("WORLD_SIZE", "PEERS", "BLOCK_N", "N_CHUNKS", "VEC", "HAS_WEIGHT", "MID_DTYPE", "PRODUCT_DTYPE"),
            "constexpr",
        ),
    }
    constexprs = {
        "WORLD_SIZE": world,
        "PEERS": triton.next_power_of_2(world),
        "BLOCK_N": 4096,
        "N_CHUNKS": n_chunks,
        "VEC": vec,
        "HAS_WEIGHT": True,
        "MID_DTYPE": tl.bfloat16,
        "PRODUCT_DTYPE": None,
    }
    # what a launch with 16-byte aligned tensors and a hidden size divisible by 16 specializes; nothing
    # about the peer tables or input_offset: their alignment comes from the kernel's own hints (VEC)
    aligned = ("residual_ptr", "weight_ptr", "sum_out_ptr", "norm_out_ptr", "rstd_out_ptr", "n_cols")
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(
        ASTSource(fn=kernel, signature={k: signature[k] for k in kernel.arg_names}, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 16},
    )


def peer_load_widths(ptx: str) -> list[str]:
    """The ``ld.global`` variants in ``ptx`` other than the 64-bit table reads (``b16``: scalar bf16, ``v4``: 16 bytes)."""
    import re

    return [m for m in re.findall(r"ld\.global[.\w]*", ptx) if not m.endswith(".b64")]


@pytest.mark.skipif(not _nvidia_backend_available(), reason="triton without its NVIDIA backend")
@pytest.mark.parametrize(("world", "vec", "n_chunks"), [(2, 8, 1), (8, 8, 4), (3, 1, 1)])
def test_kernel_compiles_for_sm90_with_a_parallel_barrier_and_vector_peer_reads(world, vec, n_chunks):
    """No GPU needed: Triton compiles to PTX and cubin offline (ptxas ships with triton).

    The barrier is one sys-scope release CAS and one acquire CAS per meeting whatever the
    world size (a vector CAS, one lane per peer, not one thread looping over peers); with
    the alignment promised (``VEC``) every peer read is a 16-byte ``v4`` load, without it
    they stay 2-byte scalar loads; the chunked epilogue (rows above ``MAX_BLOCK_N``) compiles.
    """
    from dynamo_ext.inductor_lowerings.kernels._one_shot_all_reduce_rms_norm_kernel import (
        _one_shot_all_reduce_residual_rms_norm_kernel as kernel,
    )

    compiled = compile_for_sm90(
        kernel, world, int64_args=("buffer_ptrs", "signal_pad_ptrs", "input_offset"), vec=vec, n_chunks=n_chunks
    )
    ptx = compiled.asm["ptx"]
    assert "cubin" in compiled.asm
    assert ptx.count("atom.global.release.sys.cas.b32") == 2  # entry and exit barrier, all peers at once
    assert ptx.count("atom.global.acquire.sys.cas.b32") == 2
    loads = peer_load_widths(ptx)
    if vec > 1:
        assert loads and all(".v4." in m for m in loads), loads
    else:
        assert sum(m.endswith(".b16") for m in loads) >= 8 * world, loads  # scalar reads of every peer


# ---- on a CUDA device -----------------------------------------------------------------------
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def one_rank_nccl_group(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_shot_kernel_on_symmetric_memory(one_rank_nccl_group, dtype):
    import torch.distributed._symmetric_memory as symm_mem

    from dynamo_ext.inductor_lowerings.kernels import one_shot_all_reduce_rms_norm as kernel
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import PeerBuffers

    rows, cols = 37, 4099
    x = symm_mem.empty(rows, cols, dtype=dtype, device="cuda")
    inputs, residual, weight = _case_inputs((rows, cols, dtype, True), 1)
    x.copy_(inputs[0])
    peers = PeerBuffers.from_symmetric_memory(x, one_rank_nccl_group)
    upcast = None if dtype == torch.float32 else torch.float32
    mid = None if dtype == torch.float32 else dtype
    got = kernel.one_shot_all_reduce_residual_rms_norm(
        peers, x, residual.cuda(), weight.cuda(), eps=EPS, upcast=upcast, mid_dtype=mid
    )
    exact = kernel.reference(inputs, residual, weight, eps=EPS, upcast=upcast, mid_dtype=mid)
    tol = 2e-6 if dtype == torch.float32 else 2**-7
    for g, e in zip(got, exact):
        torch.testing.assert_close(g.cpu(), e, rtol=tol, atol=tol)


@pytest.mark.gpu
@requires_cuda
def test_compiled_tp_block_uses_the_one_shot_kernel(one_rank_nccl_group, monkeypatch):
    """Opted in with ``options.one_shot``; nothing else to enable (NOTE [symmetric memory route])."""
    from test_lowering_gloo import tp_block
    from torch._inductor.utils import run_and_get_code

    import dynamo_ext
    from dynamo_ext.inductor_lowerings import options

    monkeypatch.setattr(options, "one_shot", True)

    g = torch.Generator().manual_seed(0)
    args = [
        torch.randn(16, 256, generator=g).cuda(),
        (torch.randn(256, 512, generator=g) / 16).cuda(),
        (torch.randn(512, 256, generator=g) / 23).cuda(),
        torch.randn(256, generator=g).cuda(),
    ]
    eager = tp_block(*args, one_rank_nccl_group)
    with dynamo_ext.enabled():
        torch._dynamo.reset()
        compiled, code = run_and_get_code(torch.compile(tp_block, backend="inductor"), *args, one_rank_nccl_group)
    code = "\n".join(code)
    assert "one_shot_all_reduce_residual_rms_norm" in code and "empty_strided_p2p" in code
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
