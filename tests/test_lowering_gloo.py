"""Both fusions on 4 real gloo ranks, compiled with ``backend="inductor"`` (CPU C++ codegen) vs eager.

One launch of 4 processes serves every test (the ``ranks`` fixture); the rank
functions return what they measured and the assertions run here, so a failure
names the rank.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from helpers import run_parts_on_ranks

pytestmark = pytest.mark.gloo  # one 4-process launch for the file, about 40 CPU-seconds

HIDDEN, FFN, TOKENS = 64, 128, 24


# ---- residual RMSNorm fusion: a tensor-parallel MLP block -----------------------------------
def _tp_weights(rank: int, world_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    full = {
        "x": torch.randn(TOKENS, HIDDEN, generator=g),
        "w_in": torch.randn(HIDDEN, FFN, generator=g) / HIDDEN**0.5,
        "w_out": torch.randn(FFN, HIDDEN, generator=g) / FFN**0.5,
        "norm": 1 + 0.1 * torch.randn(HIDDEN, generator=g),
    }
    shard = slice(rank * FFN // world_size, (rank + 1) * FFN // world_size)
    local = {
        "x": full["x"],
        "w_in_local": full["w_in"][:, shard].contiguous(),  # column parallel
        "w_out_local": full["w_out"][shard, :].contiguous(),  # row parallel: partial sums
        "norm": full["norm"],
    }
    return {k: v.to(dtype) for k, v in {**full, **local}.items()}


def tp_block(x, w_in_local, w_out_local, norm, group_name: str, layers: int = 2):
    """``layers`` x (column-parallel in, SiLU, row-parallel out, all-reduce, + residual, RMSNorm)."""
    import torch.distributed._functional_collectives as funcol

    h = x
    for _ in range(layers):
        partial = torch.nn.functional.silu(h @ w_in_local) @ w_out_local
        r = funcol.all_reduce(partial, "sum", group_name) + h
        h32 = r.float()
        h = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(r.dtype) * norm
    return h, r


def _tp_reference_float64(w: dict[str, torch.Tensor], layers: int = 2) -> torch.Tensor:
    h = w["x"].double()
    for _ in range(layers):
        r = torch.nn.functional.silu(h @ w["w_in"].double()) @ w["w_out"].double() + h
        h = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6) * w["norm"].double()
    return h


def _tp_block_rank(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    group_name = dist.group.WORLD.group_name
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = _tp_weights(rank, world_size, dtype)
        args = (w["x"], w["w_in_local"], w["w_out_local"], w["norm"], group_name)
        eager = tp_block(*args)
        torch._dynamo.reset()
        compiled, code = run_and_get_code(torch.compile(tp_block, backend="inductor"), *args)
        code = "\n".join(code)
        name = str(dtype).removeprefix("torch.")
        out[name] = {
            "max_err_vs_eager": max((c.double() - e.double()).abs().max().item() for c, e in zip(compiled, eager)),
            "max_err_vs_float64": (compiled[0].double() - _tp_reference_float64(w)).abs().max().item(),
            "fused_epilogue_calls": len(re.findall(r"cpp_fused_residual_rms_norm\w*\(buf", code)),
            "all_reduce_calls": len(re.findall(r"_c10d_functional\.all_reduce_\.default\(", code)),
            "stored_sum_reread": "loadu(out_ptr" in code[code.find("cpp_fused_residual_rms_norm") :],
        }
    return out


def test_tp_block_matches_eager_and_fuses_the_epilogue_on_4_ranks(ranks):
    results = ranks["tp_block"]
    for rank, res in enumerate(results):
        f32, bf16 = res["float32"], res["bfloat16"]
        assert f32["max_err_vs_eager"] <= 1e-5, f"rank {rank}: fp32 compiled vs eager {f32['max_err_vs_eager']}"
        assert f32["max_err_vs_float64"] <= 1e-4, f"rank {rank}: fp32 vs float64 {f32['max_err_vs_float64']}"
        assert bf16["max_err_vs_eager"] <= 0.0625, f"rank {rank}: bf16 compiled vs eager {bf16['max_err_vs_eager']}"
        for name, r in res.items():
            assert r["all_reduce_calls"] == 2 and r["fused_epilogue_calls"] == 2, f"rank {rank} {name}: {r}"
            assert not r["stored_sum_reread"], f"rank {rank} {name}: the epilogue re-reads a stored sum"


# ---- bucketing: 32 gradient all-reduces --------------------------------------------------------
def _grads(rank: int, n: int = 32, *, exact: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    out = []
    for i in range(n):
        numel = int(256 * 64 ** (i / (n - 1))) // 16 * 16  # 1 KiB .. 64 KiB of fp32
        t = torch.randn(numel, generator=g)
        out.append(torch.round(t * 64) / 64 if exact else t)  # dyadic values: every summation order agrees
    return out


def _sync_grads(*grads):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    return [funcol.all_reduce(g * 0.25, "sum", dist.group.WORLD) for g in grads]


def _bucketing_rank(rank: int, world_size: int) -> dict[str, Any]:
    from torch._inductor.utils import run_and_get_code

    out: dict[str, Any] = {}
    for exact in (True, False):
        grads = _grads(rank, exact=exact)
        eager = [t.wait() if hasattr(t, "wait") else t for t in _sync_grads(*grads)]
        torch._dynamo.reset()
        compiled, code = run_and_get_code(torch.compile(_sync_grads, backend="inductor"), *grads)
        code = "\n".join(code)
        out["exact" if exact else "random"] = {
            "all_reduce_calls": len(re.findall(r"_c10d_functional\.all_reduce_\.default\(", code)),
            "bitwise_equal": all(torch.equal(c, e) for c, e in zip(compiled, eager)),
            "max_err": max((c - e).abs().max().item() for c, e in zip(compiled, eager)),
        }
    return out


def test_32_gradient_all_reduces_bucket_into_one_on_4_ranks(ranks):
    results = ranks["bucketing"]
    for rank, res in enumerate(results):
        assert res["exact"]["all_reduce_calls"] <= 2, f"rank {rank}: {res['exact']}"
        assert res["exact"]["bitwise_equal"], f"rank {rank}: bucketed results differ from eager: {res['exact']}"
        assert res["random"]["max_err"] <= 1e-6, f"rank {rank}: {res['random']}"


# ---- bucketing: FSDP-style all-gathers and reduce-scatters ------------------------------------
def _fsdp_tensors(rank: int, world_size: int, n: int = 16) -> list[torch.Tensor]:
    """``n`` parameter shards (256 B .. 16 KiB) then ``n`` unsharded gradients (dim 0 a multiple of the world size)."""
    g = torch.Generator().manual_seed(rank)
    shards, grads = [], []
    for i in range(n):
        numel = int(64 * 64 ** (i / (n - 1))) // 16 * 16
        shards.append(torch.round(torch.randn(numel, generator=g) * 64) / 64)  # dyadic: exact in any order
        rows = world_size * (1 + i)
        grads.append(torch.round(torch.randn(rows, 3 + i % 4, generator=g) * 64) / 64)
    shards = [s.reshape(-1, 4) if i % 3 == 1 else s for i, s in enumerate(shards)]
    return shards + grads


def _fsdp_collectives(*ts):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    n = len(ts) // 2
    gathered = [funcol.all_gather_tensor(s, 0, dist.group.WORLD) for s in ts[:n]]
    scattered = [funcol.reduce_scatter_tensor(g * 0.25, "sum", 0, dist.group.WORLD) for g in ts[n:]]
    return gathered + scattered


def _fsdp_bucketing_rank(rank: int, world_size: int) -> dict[str, Any]:
    import warnings

    from torch._inductor.utils import run_and_get_code

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_tensor's rename notice
    ts = _fsdp_tensors(rank, world_size)
    eager = [t.wait() if hasattr(t, "wait") else t for t in _fsdp_collectives(*ts)]
    torch._dynamo.reset()
    compiled, code = run_and_get_code(torch.compile(_fsdp_collectives, backend="inductor"), *ts)
    code = "\n".join(code)
    call = code[code.index("def call") :]
    return {
        "all_gather_calls": len(re.findall(r"_c10d_functional\.all_gather_into_tensor(?:_out)?\.default\(", call)),
        "reduce_scatter_calls": len(re.findall(r"_c10d_functional\.reduce_scatter_tensor(?:_out)?\.default\(", call)),
        "shapes_match": all(c.shape == e.shape for c, e in zip(compiled, eager)),
        "bitwise_equal": all(torch.equal(c, e) for c, e in zip(compiled, eager)),
    }


def test_fsdp_all_gathers_and_reduce_scatters_bucket_on_4_ranks(ranks):
    results = ranks["fsdp_bucketing"]
    for rank, res in enumerate(results):
        assert res["all_gather_calls"] <= 2 and res["reduce_scatter_calls"] <= 2, f"rank {rank}: {res}"
        assert res["shapes_match"] and res["bitwise_equal"], f"rank {rank}: bucketed results differ from eager: {res}"


@pytest.fixture(scope="module")
def ranks():
    """Every rank function of this file, in one launch of 4 ranks."""
    parts = {"tp_block": _tp_block_rank, "bucketing": _bucketing_rank, "fsdp_bucketing": _fsdp_bucketing_rank}
    return run_parts_on_ranks(parts, nproc=4)
