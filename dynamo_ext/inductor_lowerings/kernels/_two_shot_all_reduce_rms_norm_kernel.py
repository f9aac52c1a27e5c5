"""Triton kernel: two-shot all-reduce + residual add + RMSNorm over peer-mapped buffers.

NOTE [two-shot all-reduce]
The two-shot all-reduce (reduce-scatter, then all-gather) of PyTorch's symmetric
memory kernels (``two_shot_all_reduce`` in ``torch/csrc/distributed/c10d/symm_mem``)
and of vLLM's custom all-reduce (``cross_device_reduce_2stage``), with the residual
add and the RMSNorm done between the two shots.  Rows are independent for the norm,
so the all-reduce is split by rows: rank ``r`` owns rows
``[r * n_rows // WORLD_SIZE, (r + 1) * n_rows // WORLD_SIZE)``.

1. Entry barrier: every peer's input is in place (as for the one-shot kernel).
2. Reduce-scatter + epilogue: rank ``r`` reads only its own slice from every peer,
   sums it, adds the residual, normalizes, and writes the three results (residual
   sum, normalized output, rstd) to its local outputs and to staging areas in its own
   peer-addressable buffer (after the input, or a separate symmetric workspace).
3. Middle barrier: the peers' finished slices are readable.
4. All-gather: rank ``r`` copies every other rank's staged slice into its outputs.
5. Exit barrier: no peer still reads this rank's staging, so it may be reused.

Each rank reads ``n / WORLD_SIZE`` elements from each of ``WORLD_SIZE`` peers, then
``(WORLD_SIZE - 1) / WORLD_SIZE`` of the outputs, instead of the one-shot kernel's
``n`` elements from each peer: less traffic once the data no longer fits latency.

The barriers are the one-shot kernel's blockwise handshakes (NOTE [one-shot
barrier]): program ``b`` meets only program ``b`` of each peer.  That suffices for
the middle barrier because programs split every slice the same way on every rank:
row ``i`` of a slice belongs to program ``i % n_programs``, so the rows program ``b``
of rank ``r`` gathers from peer ``p`` are exactly the rows program ``b`` of peer
``p`` wrote before it raised its slot (release) and ``r`` lowered it (acquire).
"""

# ruff: noqa: N803  (Triton constexpr parameters are UPPER_CASE, house style)
from __future__ import annotations

import triton
import triton.language as tl

from ._one_shot_all_reduce_rms_norm_kernel import _blockwise_barrier, _fused_row


@triton.jit
def _slice_bounds(slice_rank, n_rows, WORLD_SIZE: tl.constexpr):
    """``[start, end)`` of ``slice_rank``'s rows: a balanced split, sizes differ by at most one."""
    n_rows = tl.cast(n_rows, tl.int64)  # tl.cast: also takes a constexpr (Triton specializes 1)
    slice_rank = tl.cast(slice_rank, tl.int64)
    start = slice_rank * n_rows // WORLD_SIZE
    end = (slice_rank + 1) * n_rows // WORLD_SIZE
    return start, end


@triton.jit
def _two_shot_all_reduce_residual_rms_norm_kernel(
    buffer_ptrs,
    signal_pad_ptrs,
    staging_ptrs,
    input_offset,
    sum_stage_offset,
    norm_stage_offset,
    rstd_stage_offset,
    residual_ptr,
    weight_ptr,
    sum_out_ptr,
    norm_out_ptr,
    rstd_out_ptr,
    n_rows,
    n_cols,
    eps,
    rank,
    WORLD_SIZE: tl.constexpr,
    PEERS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    VEC: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    MID_DTYPE: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
):
    """Reduce this rank's slice of rows over all peers, normalize it, then gather the others' slices.

    Shapes and dtypes: the input (in every rank's peer buffer at element offset
    ``input_offset``), ``residual_ptr``, ``sum_out_ptr``: ``[n_rows, n_cols]`` of the
    input dtype; ``norm_out_ptr``: ``[n_rows, n_cols]`` of the output dtype;
    ``rstd_out_ptr``: ``[n_rows]`` fp32; ``weight_ptr``: ``[n_cols]`` (read only with
    ``HAS_WEIGHT``).  ``buffer_ptrs`` / ``signal_pad_ptrs`` are addresses of int64
    tables of each rank's buffer and signal pad as this process sees them;
    ``staging_ptrs`` of an int64 table of each rank's staging buffer (``buffer_ptrs``
    itself, or a separate symmetric workspace).  The ``*_stage_offset`` arguments are
    element offsets (in the input dtype, the output dtype and fp32) of the staging
    areas, each ``[n_rows, ...]``, in every rank's staging buffer; they must not
    overlap the input or each other.  Numerics are the one-shot
    kernel's (``_fused_row``), and so are ``PEERS``, ``BLOCK_N`` / ``N_CHUNKS`` and ``VEC``.
    """
    pid = tl.program_id(0).to(tl.int64)
    n_programs = tl.num_programs(0).to(tl.int64)
    dtype: tl.constexpr = residual_ptr.dtype.element_ty
    out_dtype: tl.constexpr = norm_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    n_cols = tl.cast(n_cols, tl.int64)  # tl.cast: also takes a constexpr (Triton specializes 1)
    eps = tl.cast(eps, tl.float32)  # a Python float under the interpreter, fp32 when compiled
    table = buffer_ptrs.to(tl.pointer_type(tl.int64))
    stage_table = staging_ptrs.to(tl.pointer_type(tl.int64))
    local_base = tl.load(stage_table + rank)
    sum_stage = local_base.to(tl.pointer_type(dtype)) + sum_stage_offset  # pyright: ignore[reportArgumentType]  # Triton DSL: a constexpr dtype
    norm_stage = local_base.to(tl.pointer_type(out_dtype)) + norm_stage_offset  # pyright: ignore[reportArgumentType]  # Triton DSL: a constexpr dtype
    rstd_stage = local_base.to(tl.pointer_type(tl.float32)) + rstd_stage_offset

    # 1-2. reduce-scatter this rank's rows, with the residual add and the norm
    _blockwise_barrier(signal_pad_ptrs, pid, rank, WORLD_SIZE, PEERS)
    start, end = _slice_bounds(rank, n_rows, WORLD_SIZE)
    for row in range(start + pid, end, n_programs):
        offs = row * n_cols
        _fused_row(
            table, input_offset + offs, residual_ptr + offs, weight_ptr, sum_out_ptr + offs,
            norm_out_ptr + offs, rstd_out_ptr + row, sum_stage + offs, norm_stage + offs, rstd_stage + row,
            n_cols, eps, dtype, out_dtype, WORLD_SIZE, BLOCK_N, N_CHUNKS, VEC, HAS_WEIGHT, True,  # pyright: ignore[reportArgumentType]  # Triton DSL: a bool constexpr
            MID_DTYPE, PRODUCT_DTYPE,
        )  # fmt: skip

    # 3-4. all-gather the peers' finished rows (the same rows program pid wrote there)
    _blockwise_barrier(signal_pad_ptrs, pid, rank, WORLD_SIZE, PEERS)
    for step in tl.static_range(1, WORLD_SIZE):  # pyright: ignore[reportGeneralTypeIssues]  # Triton DSL: unrolled by the compiler
        peer = (rank + step) % WORLD_SIZE  # staggered, so ranks do not all read one peer at once
        peer_base = tl.load(stage_table + peer)
        peer_sum = peer_base.to(tl.pointer_type(dtype)) + sum_stage_offset  # pyright: ignore[reportArgumentType]  # Triton DSL: a constexpr dtype
        peer_norm = peer_base.to(tl.pointer_type(out_dtype)) + norm_stage_offset  # pyright: ignore[reportArgumentType]  # Triton DSL: a constexpr dtype
        peer_rstd = peer_base.to(tl.pointer_type(tl.float32)) + rstd_stage_offset
        peer_start, peer_end = _slice_bounds(peer, n_rows, WORLD_SIZE)
        for row in range(peer_start + pid, peer_end, n_programs):
            for chunk in range(N_CHUNKS):  # copies: any chunk size holds in registers
                offs = row * n_cols + chunk * BLOCK_N + cols
                mask = chunk * BLOCK_N + cols < n_cols
                sum_ptrs = peer_sum + offs
                norm_ptrs = peer_norm + offs
                if VEC > 1:  # staging areas start 16-byte aligned, rows are multiples of VEC
                    sum_ptrs = tl.multiple_of(sum_ptrs, [16])
                    norm_ptrs = tl.multiple_of(norm_ptrs, [16])
                tl.store(sum_out_ptr + offs, tl.load(sum_ptrs, mask=mask, other=0.0), mask=mask)
                tl.store(norm_out_ptr + offs, tl.load(norm_ptrs, mask=mask, other=0.0), mask=mask)
            tl.store(rstd_out_ptr + row, tl.load(peer_rstd + row))

    # 5. no peer reads this rank's input or staging any more
    _blockwise_barrier(signal_pad_ptrs, pid, rank, WORLD_SIZE, PEERS)
