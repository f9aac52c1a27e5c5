"""Triton kernel: one-shot all-reduce + residual add + RMSNorm over peer-mapped buffers.

NOTE [one-shot barrier]
Each rank's input sits in a buffer every peer can address (CUDA symmetric memory,
or on the CPU a shared file mapped into each process), and each rank owns a signal
pad of ``max_blocks * WORLD_SIZE`` int32 slots, zero at rest.  Program ``b`` of rank
``r`` meets program ``b`` of every peer twice: on entry (every peer's input is in
place: its kernel started, so its producer finished) and on exit (every peer has
finished reading this rank's rows, so the next producer may overwrite them).
Meeting is a handshake per slot with one writer per transition: rank ``r`` raises
slot ``(b, r)`` of peer ``p`` from 0 to 1 (release), peer ``p`` lowers it back to 0
(acquire) once it sees it.  Because only the sender moves 0 -> 1 and only the
receiver moves 1 -> 0, the protocol stays correct even where a compare-and-swap is
atomic only within one process (the Triton interpreter), and every slot is zero
again when the kernel returns.  Programs of one rank never wait on each other, so
no co-residency is needed, and an interpreter that runs programs one after another
in the same order on every rank cannot deadlock.
"""

# ruff: noqa: N803  (Triton constexpr parameters are UPPER_CASE, house style)
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _blockwise_barrier(signal_pad_ptrs, block_id, rank, WORLD_SIZE: tl.constexpr):
    """Program ``block_id`` of every rank meets here (NOTE [one-shot barrier])."""
    pads = signal_pad_ptrs.to(tl.pointer_type(tl.int64))
    local_pad = tl.load(pads + rank).to(tl.pointer_type(tl.int32))
    tl.debug_barrier()
    for peer in tl.static_range(WORLD_SIZE):
        remote_pad = tl.load(pads + peer).to(tl.pointer_type(tl.int32))
        slot = remote_pad + block_id * WORLD_SIZE + rank
        while tl.atomic_cas(slot, 0, 1, sem="release", scope="sys") != 0:
            pass
    for peer in tl.static_range(WORLD_SIZE):
        slot = local_pad + block_id * WORLD_SIZE + peer
        while tl.atomic_cas(slot, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``DTYPE``, returned as fp32.

    bf16 by integer arithmetic: the Triton interpreter truncates fp32 -> bf16 casts
    (``cast_impl`` ignores the rounding mode), hardware rounds to nearest even; this
    gives the hardware result on both.  NaN passes through unchanged.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _reduce_row_residual_rms_norm(
    table,
    input_offset,
    offs,
    mask,
    residual_ptr,
    w,
    n_cols,
    eps,
    DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    WORLD_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    MID_DTYPE: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
):
    """One row, shared by the one- and two-shot kernels: ``(sum, normalized, rstd)``.

    Sums the row at ``offs`` over every peer's buffer (``table``: int64 addresses)
    in fp32, rounds once to ``DTYPE`` (the all-reduce result), adds the residual
    (rounded once more, as aten does), then RMSNorm with the chain's casts
    (``MID_DTYPE`` before the weight, ``PRODUCT_DTYPE`` after).  ``sum`` is
    ``DTYPE``, ``normalized`` ``OUT_DTYPE``, ``rstd`` an fp32 scalar.
    """
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for peer in tl.static_range(WORLD_SIZE):
        peer_input = tl.load(table + peer).to(tl.pointer_type(DTYPE))
        acc += tl.load(peer_input + input_offset + offs, mask=mask, other=0.0).to(tl.float32)
    reduced = _round(acc, DTYPE)
    res = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = _round(reduced + res, DTYPE)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols.to(tl.float32) + eps)
    y = h * rstd
    if MID_DTYPE is not None:
        y = _round(y, MID_DTYPE)
    if HAS_WEIGHT:
        y = y * w
        if PRODUCT_DTYPE is not None:
            y = _round(y, PRODUCT_DTYPE)
    return h.to(DTYPE), _round(y, OUT_DTYPE).to(OUT_DTYPE), rstd


@triton.jit
def _one_shot_all_reduce_residual_rms_norm_kernel(
    buffer_ptrs,
    signal_pad_ptrs,
    input_offset,
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
    BLOCK_N: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    MID_DTYPE: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
):
    """Rows ``pid, pid + grid, ...``: sum the row over all peers, add the residual, normalize.

    ``buffer_ptrs`` / ``signal_pad_ptrs`` are addresses of int64 tables of each rank's
    buffer and signal pad as this process sees them; ``input_offset`` is the input's
    element offset inside every rank's buffer (the same on all ranks).  The sum is
    accumulated in fp32 and rounded once to the input dtype (the all-reduce result),
    the residual add rounds once more, as the aten ops do; ``MID_DTYPE`` and
    ``PRODUCT_DTYPE`` (None or a low-precision dtype) replay the chain's casts before
    and after the weight.
    """
    pid = tl.program_id(0).to(tl.int64)
    n_programs = tl.num_programs(0)
    dtype: tl.constexpr = residual_ptr.dtype.element_ty
    out_dtype: tl.constexpr = norm_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    n_cols = tl.cast(n_cols, tl.int64)  # tl.cast: also takes a constexpr (Triton specializes 1)
    mask = cols < n_cols
    eps = tl.cast(eps, tl.float32)  # a Python float under the interpreter, fp32 when compiled
    table = buffer_ptrs.to(tl.pointer_type(tl.int64))

    _blockwise_barrier(signal_pad_ptrs, pid, rank, WORLD_SIZE)
    # Without HAS_WEIGHT, weight_ptr is the residual: a valid read whose value is never used.
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, n_rows, n_programs):
        offs = row * n_cols + cols
        h, y, rstd = _reduce_row_residual_rms_norm(
            table, input_offset, offs, mask, residual_ptr, w, n_cols, eps,
            dtype, out_dtype, WORLD_SIZE, BLOCK_N, HAS_WEIGHT, MID_DTYPE, PRODUCT_DTYPE,
        )  # fmt: skip
        tl.store(sum_out_ptr + offs, h, mask=mask)
        tl.store(rstd_out_ptr + row, rstd)
        tl.store(norm_out_ptr + offs, y, mask=mask)
    _blockwise_barrier(signal_pad_ptrs, pid, rank, WORLD_SIZE)
