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

NOTE [barrier memory ordering]
Why data written before a handshake is seen after it, in the PTX memory model (the
same pattern as PyTorch's symmetric-memory ``sync_remote_blocks`` and vLLM's custom
all-reduce):

1. ``tl.debug_barrier()`` (``bar.sync``) before the signalling CAS orders every memory
   access of every thread of the program before the one lane per peer that signals.
2. The signal is ``atom.release.sys.cas``.  A release is cumulative: the accesses
   ordered before it, other threads' included (1), are visible to any thread that
   acquires the same slot and reads the value it wrote.  The scope is ``sys`` because
   the peers are other GPUs reading and writing over NVLink; ``gpu`` scope orders
   nothing for them.
3. The receiver's ``atom.acquire.sys.cas`` reads that 1 (and lowers it), then
   ``tl.debug_barrier()`` orders every thread's later accesses after the acquire.
   So on entry, a peer's input, written by its producer kernel earlier on its stream
   (stream order puts those writes before the peer kernel's release), is seen by
   every program that then reads it; in the two-shot kernel's middle barrier the
   staged slices are seen the same way.
4. On exit the order runs the other way: release orders earlier loads as well as
   stores, so a rank's reads of its peers' buffers happen before the peers acquire
   its signal, and with it before their kernels end and their next producers
   overwrite those buffers.
5. Peer data is read and written with plain loads and stores; only the atomics carry
   ordering, and the compiler moves no memory access across them or ``bar.sync``.

What one GPU cannot check: the in-process harness puts every rank on one device,
where ``gpu`` scope would already suffice and every access goes to the same memory,
so a missing ``sys`` scope or a reordering across NVLink would still pass there; only
a run on several GPUs shows this argument holds on the hardware.
"""

# ruff: noqa: N803  (Triton constexpr parameters are UPPER_CASE, house style)
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _blockwise_barrier(signal_pad_ptrs, block_id, rank, WORLD_SIZE: tl.constexpr, PEERS: tl.constexpr):
    """Program ``block_id`` of every rank meets here (NOTE [one-shot barrier]), one lane per peer.

    As PyTorch's symmetric-memory ``sync_remote_blocks`` (one thread per peer): lane
    ``p`` raises this rank's slot in peer ``p``'s pad, then lowers peer ``p``'s slot in
    this rank's pad, every peer at once.  A lane that is done (or a padding lane,
    ``p >= WORLD_SIZE``, aimed at this rank's own slot) compares against 2, a value no
    slot holds, so its compare-and-swap never writes.  ``PEERS``: ``WORLD_SIZE`` rounded
    up to a power of two.
    """
    pads = signal_pad_ptrs.to(tl.pointer_type(tl.int64))
    peer = tl.arange(0, PEERS)
    active = peer < WORLD_SIZE
    local_pad = tl.load(pads + rank)
    peer_pads = tl.load(pads + peer, mask=active, other=local_pad)
    first = block_id * WORLD_SIZE
    send = peer_pads.to(tl.pointer_type(tl.int32)) + first + rank
    recv = local_pad.to(tl.pointer_type(tl.int32)) + first + tl.where(active, peer, rank)
    tl.debug_barrier()
    pending = active
    while tl.max(pending.to(tl.int32), axis=0) > 0:  # pyright: ignore[reportOperatorIssue]  # Triton DSL: tl.max of a block is a scalar
        old = tl.atomic_cas(send, tl.where(pending, 0, 2), tl.where(pending, 1, 2), sem="release", scope="sys")
        pending = pending & (old != 0)
    pending = active
    while tl.max(pending.to(tl.int32), axis=0) > 0:  # pyright: ignore[reportOperatorIssue]  # Triton DSL: tl.max of a block is a scalar
        old = tl.atomic_cas(recv, tl.where(pending, 1, 2), tl.where(pending, 0, 2), sem="acquire", scope="sys")
        pending = pending & (old != 1)
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
def _peer_sum_plus_residual(table, input_base, cols, mask, residual_row, DTYPE: tl.constexpr,
                            WORLD_SIZE: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    """Columns ``cols`` of one row summed over every peer's buffer, rounded, plus the residual, rounded.

    ``table``: int64 addresses of each rank's buffer; ``input_base``: the row's first
    element there (a multiple of ``VEC``, and every buffer 16-byte aligned, when
    ``VEC > 1``: the launcher checks both, so peer reads vectorize to 16 bytes).
    Accumulates in fp32 in rank order, rounds once to ``DTYPE`` (the all-reduce
    result), then the residual add rounds once more, as the aten ops do.
    """
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for peer in tl.static_range(WORLD_SIZE):  # pyright: ignore[reportGeneralTypeIssues]  # Triton DSL: unrolled by the compiler
        ptrs = tl.load(table + peer).to(tl.pointer_type(DTYPE)) + input_base + cols  # pyright: ignore[reportArgumentType]  # Triton DSL: a constexpr dtype
        if VEC > 1:  # a pointer from a table carries no alignment: say it (16 bytes), or reads stay scalar
            ptrs = tl.multiple_of(ptrs, [16])
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    reduced = _round(acc, DTYPE)
    res = tl.load(residual_row + cols, mask=mask, other=0.0).to(tl.float32)
    return _round(reduced + res, DTYPE)


@triton.jit
def _normalize(h, rstd, weight_ptr, cols, mask, OUT_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
               MID_DTYPE: tl.constexpr, PRODUCT_DTYPE: tl.constexpr):  # fmt: skip
    """``h * rstd`` with the chain's casts (``MID_DTYPE`` before the weight, ``PRODUCT_DTYPE`` after)."""
    y = h * rstd
    if MID_DTYPE is not None:
        y = _round(y, MID_DTYPE)
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if PRODUCT_DTYPE is not None:
            y = _round(y, PRODUCT_DTYPE)
    return _round(y, OUT_DTYPE).to(OUT_DTYPE)


@triton.jit
def _fused_row(
    table,
    input_base,
    residual_row,
    weight_ptr,
    sum_row,
    norm_row,
    rstd_slot,
    sum_stage_row,
    norm_stage_row,
    rstd_stage_slot,
    n_cols,
    eps,
    DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    WORLD_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    VEC: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_STAGE: tl.constexpr,
    MID_DTYPE: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
):
    """One row, shared by the one- and two-shot kernels: writes ``sum``, ``normalized``, ``rstd``.

    ``*_row`` / ``*_slot`` point at the row's first element / its rstd; with
    ``HAS_STAGE`` each result is also written to the ``*_stage_*`` copies (two-shot).
    With ``N_CHUNKS == 1`` the row (``BLOCK_N >= n_cols``) stays in registers.  Above
    that the row is walked in ``N_CHUNKS`` chunks of ``BLOCK_N`` twice: the first pass
    reduces over the peers, stores the residual sum and accumulates the sum of squares;
    the second re-reads the stored sum (local memory, already rounded to ``DTYPE``, so
    the same values) and normalizes, so registers hold one chunk, never the row.
    """
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    if N_CHUNKS == 1:
        mask = cols < n_cols
        h = _peer_sum_plus_residual(table, input_base, cols, mask, residual_row, DTYPE, WORLD_SIZE, VEC)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols.to(tl.float32) + eps)
        y = _normalize(h, rstd, weight_ptr, cols, mask, OUT_DTYPE, HAS_WEIGHT, MID_DTYPE, PRODUCT_DTYPE)
        tl.store(sum_row + cols, h.to(DTYPE), mask=mask)
        tl.store(norm_row + cols, y, mask=mask)
        if HAS_STAGE:
            tl.store(sum_stage_row + cols, h.to(DTYPE), mask=mask)
            tl.store(norm_stage_row + cols, y, mask=mask)
    else:
        squares = tl.zeros([BLOCK_N], dtype=tl.float32)
        for chunk in range(N_CHUNKS):
            c = chunk * BLOCK_N + cols
            mask = c < n_cols
            h = _peer_sum_plus_residual(table, input_base, c, mask, residual_row, DTYPE, WORLD_SIZE, VEC)
            tl.store(sum_row + c, h.to(DTYPE), mask=mask)
            if HAS_STAGE:
                tl.store(sum_stage_row + c, h.to(DTYPE), mask=mask)
            squares += h * h
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / n_cols.to(tl.float32) + eps)
        tl.debug_barrier()  # the sums this program stored are visible to all its threads
        for chunk in range(N_CHUNKS):
            c = chunk * BLOCK_N + cols
            mask = c < n_cols
            h = tl.load(sum_row + c, mask=mask, other=0.0).to(tl.float32)
            y = _normalize(h, rstd, weight_ptr, c, mask, OUT_DTYPE, HAS_WEIGHT, MID_DTYPE, PRODUCT_DTYPE)
            tl.store(norm_row + c, y, mask=mask)
            if HAS_STAGE:
                tl.store(norm_stage_row + c, y, mask=mask)
    tl.store(rstd_slot, rstd)
    if HAS_STAGE:
        tl.store(rstd_stage_slot, rstd)


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
    PEERS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    VEC: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    MID_DTYPE: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
):
    """Rows ``pid, pid + grid, ...``: sum the row over all peers, add the residual, normalize.

    ``buffer_ptrs`` / ``signal_pad_ptrs`` are addresses of int64 tables of each rank's
    buffer and signal pad as this process sees them; ``input_offset`` is the input's
    element offset inside every rank's buffer (the same on all ranks).  Numerics:
    :func:`_fused_row`.  ``PEERS``: ``WORLD_SIZE`` rounded up to a power of two;
    ``BLOCK_N`` / ``N_CHUNKS``: the row in one block or in chunks; ``VEC``: elements per
    aligned 16-byte peer read (1: no alignment promised).
    """
    pid = tl.program_id(0).to(tl.int64)
    n_programs = tl.num_programs(0)
    dtype: tl.constexpr = residual_ptr.dtype.element_ty
    out_dtype: tl.constexpr = norm_out_ptr.dtype.element_ty
    n_cols = tl.cast(n_cols, tl.int64)  # tl.cast: also takes a constexpr (Triton specializes 1)
    eps = tl.cast(eps, tl.float32)  # a Python float under the interpreter, fp32 when compiled
    table = buffer_ptrs.to(tl.pointer_type(tl.int64))

    _blockwise_barrier(signal_pad_ptrs, pid, rank, WORLD_SIZE, PEERS)
    for row in range(pid, n_rows, n_programs):
        offs = row * n_cols
        _fused_row(
            table, input_offset + offs, residual_ptr + offs, weight_ptr, sum_out_ptr + offs,
            norm_out_ptr + offs, rstd_out_ptr + row, sum_out_ptr, norm_out_ptr, rstd_out_ptr, n_cols, eps,
            dtype, out_dtype, WORLD_SIZE, BLOCK_N, N_CHUNKS, VEC, HAS_WEIGHT, False, MID_DTYPE, PRODUCT_DTYPE,  # pyright: ignore[reportArgumentType]  # Triton DSL: a bool constexpr
        )  # fmt: skip
    _blockwise_barrier(signal_pad_ptrs, pid, rank, WORLD_SIZE, PEERS)
