"""Where a rank finds its peers' buffers and signal pads, for the one-shot and two-shot kernels.

Two sources give the same :class:`PeerBuffers`:

- :meth:`PeerBuffers.from_symmetric_memory`: CUDA symmetric memory (the tables of
  peer addresses live on the device, from ``rendezvous``), and
  :meth:`PeerBuffers.symmetric_workspace` for the group's workspace;
- :func:`create_host_shared` + :meth:`PeerBuffers.open_host_shared`: one file per
  rank (buffer) and per rank (signal pad) in a directory, mapped ``MAP_SHARED`` into
  every process with ``torch.from_file(shared=True)``, so kernels run by the Triton
  interpreter in separate CPU processes read each other's memory through raw
  addresses, exactly as GPUs read peers' memory over NVLink.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from ... import _compat

SIGNAL_SLOT_BYTES = 4  # one int32 per (program, peer)
MAX_PROGRAMS = 32
"""Most programs a fused kernel launches per rank, whatever the device.

Agreed, not local: the grid must be identical on every rank (program ``b`` meets
program ``b`` of each peer), so it never comes from the local SM count (ranks on
different GPU models or MIG slices would disagree and hang).  Bounded: these programs
spin in barriers, and a side-stream NCCL kernel must still find free SMs (32 of 108 on
an A100, of 132 on an H100)."""


@dataclasses.dataclass(frozen=True)
class PeerBuffers:
    """Addresses a kernel on ``rank`` needs; ``keepalive`` holds what backs them."""

    rank: int
    world_size: int
    buffer_ptrs: int
    """Address of an int64[world_size] table: each rank's buffer base, as this process sees it."""
    signal_pad_ptrs: int
    """Address of an int64[world_size] table: each rank's signal pad."""
    local_buffer: int
    buffer_nbytes: int
    max_blocks: int
    """Programs a launch may use: the signal pads' slots (``signal_pad_bytes / 4 / world_size``, the same
    size on every rank), at most :data:`MAX_PROGRAMS`."""
    keepalive: tuple[Any, ...] = ()
    aligned: bool = False
    """Every rank's buffer starts on a 16-byte boundary (the kernels then vectorize peer reads)."""

    def element_offset(self, tensor: torch.Tensor) -> int:
        """``tensor``'s offset in elements inside this rank's buffer (the same on every rank)."""
        start = tensor.data_ptr() - self.local_buffer
        end = start + tensor.numel() * tensor.element_size()
        if start < 0 or end > self.buffer_nbytes or start % tensor.element_size():
            raise ValueError(
                f"tensor at 0x{tensor.data_ptr():x} ({tensor.numel()} x {tensor.dtype}) is not inside rank "
                f"{self.rank}'s peer buffer [0x{self.local_buffer:x}, +{self.buffer_nbytes}); allocate it from "
                "the buffer (symm_mem.empty / PeerBuffers.local_tensor)"
            )
        return start // tensor.element_size()

    def local_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, *, offset: int = 0) -> torch.Tensor:
        """A tensor over this rank's own buffer (host-shared buffers only)."""
        storage = self.keepalive[0] if self.keepalive else None
        if not isinstance(storage, list):
            raise TypeError("local_tensor() is for host-shared buffers; with symmetric memory use symm_mem.empty()")
        numel = 1
        for s in shape:
            numel *= s
        return storage[self.rank].view(dtype)[offset : offset + numel].view(shape)

    @classmethod
    def from_symmetric_memory(cls, tensor: torch.Tensor, group_name: str) -> PeerBuffers:
        """Rendezvous ``tensor`` (a symmetric-memory allocation) on ``group_name``.

        Raises RuntimeError when ``tensor`` was not allocated from symmetric memory.
        """
        return cls._from_handle(_compat.symm_mem_rendezvous(tensor, group_name), tensor.device)

    @classmethod
    def symmetric_workspace(cls, group_name: str, min_nbytes: int, device: torch.device) -> PeerBuffers:
        """The group's symmetric-memory workspace (``get_symm_mem_workspace``), at least ``min_nbytes``.

        Collective when it grows (every rank must ask for the same size); raises
        RuntimeError where it would have to grow during CUDA graph capture.
        """
        return cls._from_handle(_compat.symm_mem_module().get_symm_mem_workspace(group_name, min_nbytes), device)

    @classmethod
    def _from_handle(cls, symm: Any, device: torch.device) -> PeerBuffers:
        slots = int(symm.signal_pad_size) // SIGNAL_SLOT_BYTES // symm.world_size
        return cls(
            rank=symm.rank,
            world_size=symm.world_size,
            buffer_ptrs=symm.buffer_ptrs_dev,
            signal_pad_ptrs=symm.signal_pad_ptrs_dev,
            local_buffer=symm.buffer_ptrs[symm.rank],
            buffer_nbytes=symm.buffer_size,
            max_blocks=max(1, min(slots, MAX_PROGRAMS)),
            keepalive=(symm,),
            aligned=all(int(p) % 16 == 0 for p in symm.buffer_ptrs),
        )

    @classmethod
    def open_host_shared(cls, directory: str, *, rank: int, world_size: int) -> PeerBuffers:
        """Map every rank's files made by :func:`create_host_shared` into this process."""
        buffers = [_map(os.path.join(directory, f"buffer{r}")) for r in range(world_size)]
        pads = [_map(os.path.join(directory, f"signal{r}")) for r in range(world_size)]
        buffer_table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        pad_table = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
        return cls(
            rank=rank,
            world_size=world_size,
            buffer_ptrs=buffer_table.data_ptr(),
            signal_pad_ptrs=pad_table.data_ptr(),
            local_buffer=buffers[rank].data_ptr(),
            buffer_nbytes=buffers[rank].numel(),
            max_blocks=max(1, min(MAX_PROGRAMS, pads[rank].numel() // SIGNAL_SLOT_BYTES // world_size)),
            keepalive=(buffers, pads, buffer_table, pad_table),
            aligned=all(b.data_ptr() % 16 == 0 for b in buffers),
        )

    @classmethod
    def in_process(cls, buffers: list[torch.Tensor], pads: list[torch.Tensor], *, rank: int) -> PeerBuffers:
        """Rank ``rank`` of ranks that live in this process (one device): ``buffers[r]`` / ``pads[r]`` are rank
        ``r``'s buffer (uint8) and zeroed signal pad (int32, ``max_blocks * world_size`` slots).

        What the multi-rank harness uses: W ranks as W streams (CUDA) sharing one address
        space, so a peer's memory is addressed directly, as over NVLink with symmetric memory.
        """
        world_size = len(buffers)
        device = buffers[rank].device
        buffer_table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
        pad_table = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=device)
        return cls(
            rank=rank,
            world_size=world_size,
            buffer_ptrs=buffer_table.data_ptr(),
            signal_pad_ptrs=pad_table.data_ptr(),
            local_buffer=buffers[rank].data_ptr(),
            buffer_nbytes=buffers[rank].numel() * buffers[rank].element_size(),
            max_blocks=max(1, min(MAX_PROGRAMS, pads[rank].numel() // world_size)),
            keepalive=([*buffers], [*pads], buffer_table, pad_table),
            aligned=all(b.data_ptr() % 16 == 0 for b in buffers),
        )


def _map(path: str) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)


def create_host_shared(directory: str, *, world_size: int, buffer_nbytes: int, max_blocks: int) -> None:
    """Create zeroed buffer and signal-pad files for ``world_size`` ranks (once, before any rank maps them)."""
    pad_nbytes = max_blocks * world_size * SIGNAL_SLOT_BYTES
    for r in range(world_size):
        for name, size in ((f"buffer{r}", buffer_nbytes), (f"signal{r}", pad_nbytes)):
            with open(os.path.join(directory, name), "wb") as f:
                f.truncate(size)
