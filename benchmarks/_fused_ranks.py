"""W simulated ranks on one device for the fused all-reduce kernels: what the benchmark sweep, the race test and
the precompile step of ``scripts/gpu_check.sh`` share.

The ranks are ``harness.InProcessRanks`` (NOTE [in-process ranks] in
``dynamo_ext/inductor_lowerings/kernels/harness.py``).  Imported as ``from _fused_ranks import ...`` (this
directory on ``sys.path``); imports torch only inside functions.
"""

from __future__ import annotations

from typing import Any

EPS = 1e-6
ALGORITHMS = ("one_shot", "two_shot")
DTYPES = ("bfloat16", "float32")
TOKENS_MAX = 8192


def casts_for(dtype: Any) -> dict[str, Any]:
    """A Llama-style RMSNorm's casts: bf16/fp16 upcast to fp32 and the product rounded back; none for fp32."""
    import torch

    return {} if dtype == torch.float32 else {"upcast": torch.float32, "mid_dtype": dtype}


def max_blocks_for(world: int, device: Any) -> int:
    """Programs per rank such that the W ranks' grids are resident together on the one device.

    The W kernels wait for each other in their barriers, so all ``W x max_blocks`` programs
    must be resident at once.  A program has at most 16 warps, and Triton declares that
    block size to ptxas, which then keeps registers to what one SM holds, so every SM takes
    at least one program: ``W x max_blocks`` up to the SM count is safe.  Capped at
    ``MAX_PROGRAMS`` (what a real rank's symmetric-memory pad allows); 4 on the CPU.
    """
    import torch

    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import MAX_PROGRAMS

    if getattr(device, "type", device) != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_PROGRAMS, (sms - 4) // world))


def buffer_nbytes(shapes: list[tuple[int, int]], dtype: Any) -> int:
    """Peer-buffer bytes for the largest of ``shapes``: the input, or the two-shot staging if larger."""
    from dynamo_ext.inductor_lowerings.kernels import two_shot_all_reduce_rms_norm as two_shot

    need = 0
    for shape in shapes:
        nbytes = shape[0] * shape[1] * dtype.itemsize
        need = max(need, nbytes, two_shot.staging_nbytes(shape, dtype, dtype))
    return need + 256


def launch_rank(ranks: Any, algorithm: str, rank: int, x: Any, residual: Any, weight: Any, **kw: Any) -> Any:
    """Rank ``rank``'s fused call on its input ``x`` (in its buffer), as ``InProcessRanks.launch`` makes it.

    ``kw``: ``eps``, the casts, ``max_block_n``.
    """
    from dynamo_ext.inductor_lowerings.kernels import one_shot_all_reduce_rms_norm as one_shot
    from dynamo_ext.inductor_lowerings.kernels import two_shot_all_reduce_rms_norm as two_shot

    common = {"eps": EPS, "max_blocks": ranks.max_blocks, **kw}
    if algorithm == "one_shot":
        return one_shot.one_shot_all_reduce_residual_rms_norm(ranks.peers[rank], x, residual, weight, **common)
    if algorithm == "two_shot":
        return two_shot.two_shot_all_reduce_residual_rms_norm(
            ranks.peers[rank], x, residual, weight, staging=ranks.staging[rank], **common
        )
    raise ValueError(f"algorithm {algorithm!r}: expected one of {ALGORITHMS}")


def reference(inputs: list[Any], residual: Any, weight: Any, **casts: Any) -> tuple[Any, Any, Any]:
    """The fp32 reference on the inputs' device: all-reduce (fp32 sum in rank order, one rounding), residual add,
    RMSNorm with the casts (``harness.reference_same_order`` without the trip to the CPU)."""
    import torch

    from dynamo_ext.inductor_lowerings.kernels.reference import residual_rms_norm_reference

    acc = torch.zeros(inputs[0].shape, dtype=torch.float32, device=inputs[0].device)
    for x in inputs:
        acc = acc + x.float()
    reduced = acc.to(inputs[0].dtype)
    return residual_rms_norm_reference(
        reduced, residual, weight, EPS, casts.get("upcast"), casts.get("mid_dtype"), casts.get("out_dtype")
    )


def bounds(dtype: Any) -> dict[str, float]:
    """Largest error accepted, in units in the last place of the reference: the harness's bounds (fp32: the
    residual sum bit-exact, the norm within 8 ulp from the order of the sum of squares; bf16/fp16: 1 ulp)."""
    import torch

    if dtype == torch.float32:
        return {"sum_ulp": 0.0, "norm_ulp": 8.0}
    return {"sum_ulp": 1.0, "norm_ulp": 1.0}


def errors(got: tuple[Any, Any, Any], want: tuple[Any, Any, Any]) -> Any:
    """``[sum ulp, norm ulp, rstd relative error]`` of one rank's outputs, a float64 tensor on the device (no
    host synchronization)."""
    import torch

    from dynamo_ext.inductor_lowerings.kernels.harness import ulps_tensor

    s, y, rstd = got
    rel = ((rstd.double() - want[2].double()).abs() / want[2].double().abs()).max()
    return torch.stack([ulps_tensor(s, want[0]), ulps_tensor(y, want[1]), rel])
