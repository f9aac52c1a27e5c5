"""W ranks in one process: the fused all-reduce kernels run concurrently against eager, and timed.

NOTE [in-process ranks]
Each rank has its own buffer, staging workspace and signal pad on one device, and its
own :class:`PeerBuffers` whose tables hold every rank's addresses, so rank ``r``'s
kernel reads its peers' buffers and meets them at the barriers exactly as it would
over NVLink with symmetric memory.  The W launches must run at the same time (each
waits for the others in its barriers):

- CUDA: one stream per rank, every rank's kernel queued before any is waited for, so
  the W grids are resident together (W x programs must fit on the device at once: the
  harness keeps ``max_blocks`` small);
- Triton interpreter (``TRITON_INTERPRET=1``, CPU): one thread per rank.  The
  interpreter keeps the current program id in one module-level builder and patches
  ``triton.language`` per launch, so :func:`_interpreter_threads` makes the program
  id per thread and holds one patch open while the threads run (the per-launch
  patches then nest inside it).

:meth:`InProcessRanks.race_check` runs ``calls`` back-to-back collectives per size, new
inputs every call, and compares each against eager (:func:`reference_same_order`: fp32
sums in the kernel's order, so the residual sum matches exactly; the norm within a few
ulp), catching ordering and buffer-reuse races: a rank that overwrites its input
before a peer has read it, or a signal slot left raised, shows as a wrong number or a
hang.  What this cannot show: NVLink latency, contention between GPUs, real peer
traffic (see benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import fused_all_reduce_launch as fused_launch
from . import one_shot_all_reduce_rms_norm as one_shot
from . import two_shot_all_reduce_rms_norm as two_shot
from .peer_buffers import PeerBuffers

KERNELS = ("one_shot", "two_shot")


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def _interpreter_threads(kernel: Any) -> Iterator[None]:
    """Let ``kernel`` run under the interpreter in several threads at once (NOTE [in-process ranks])."""
    from triton.runtime import interpreter

    if not (hasattr(interpreter, "interpreter_builder") and hasattr(interpreter, "_patch_lang")):
        raise NotImplementedError(
            "this triton's interpreter has no module-level interpreter_builder / _patch_lang: ranks cannot run as "
            "threads under it (run the multi-process tests, or on a CUDA device)"
        )
    builder = interpreter.interpreter_builder
    local = threading.local()
    base = type(builder)

    def per_thread(name: str) -> property:
        return property(lambda self: getattr(local, name, None), lambda self, v: setattr(local, name, v))

    builder.__class__ = type(
        "PerThreadInterpreterBuilder", (base,), {"grid_idx": per_thread("grid_idx"), "grid_dim": per_thread("grid_dim")}
    )
    scope = interpreter._patch_lang(kernel.fn if hasattr(kernel, "fn") else kernel)
    try:
        yield
    finally:
        scope.restore()
        builder.__class__ = base


@dataclasses.dataclass
class InProcessRanks:
    """``world_size`` ranks on ``device``: buffers of ``buffer_nbytes``, workspaces, signal pads.

    ``max_blocks`` bounds each launch's grid (the W grids must be resident together).
    """

    world_size: int
    buffer_nbytes: int
    device: torch.device
    max_blocks: int = 4

    def __post_init__(self) -> None:
        w, dev = self.world_size, self.device

        def rank_set(pad_slots: int) -> list[PeerBuffers]:
            buffers = [torch.zeros(self.buffer_nbytes, dtype=torch.uint8, device=dev) for _ in range(w)]
            pads = [torch.zeros(pad_slots * w, dtype=torch.int32, device=dev) for _ in range(w)]
            return [PeerBuffers.in_process(buffers, pads, rank=r) for r in range(w)]

        self.peers = rank_set(self.max_blocks)
        self.staging = rank_set(1)  # the workspace's pads are never used: the input's pads hold the barrier
        self.streams = [torch.cuda.Stream(device=dev) for _ in range(w)] if dev.type == "cuda" else []

    def input(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s input, at offset 0 of its buffer (the same offset on every rank)."""
        numel = 1
        for s in shape:
            numel *= s
        if numel * dtype.itemsize > self.buffer_nbytes:
            raise ValueError(f"{shape} {dtype} needs {numel * dtype.itemsize} bytes; buffers are {self.buffer_nbytes}")
        return self.peers[rank].keepalive[0][rank].view(dtype)[:numel].view(shape)

    def signal_slots_raised(self) -> int:
        """Signal slots left non-zero on any rank (0 after every complete collective)."""
        return sum(int(p.count_nonzero()) for p in self.peers[0].keepalive[1])

    def run(self, fn: Callable[[int], Any], *, kernel: Any) -> list[Any]:
        """``fn(rank)`` for every rank at the same time (one stream or thread each); results by rank."""
        if self.streams:
            results = []
            current = torch.cuda.current_stream(self.device)
            for rank, stream in enumerate(self.streams):
                stream.wait_stream(current)  # inputs written on the current stream are in place
                with torch.cuda.stream(stream):
                    results.append(fn(rank))
            for stream in self.streams:
                current.wait_stream(stream)
            for out in results:  # outputs made on a rank's stream, read on this one: keep their memory until then
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        t.record_stream(current)
            return results
        if not interpreted():
            raise RuntimeError("in-process ranks need a CUDA device or TRITON_INTERPRET=1")
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # re-raised below, after every thread stopped
                errors.append(e)

        with _interpreter_threads(kernel):
            threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return results

    def all_reduce_residual_rms_norm(
        self,
        algorithm: str,
        inputs: list[torch.Tensor],
        residual: torch.Tensor,
        weight: torch.Tensor | None,
        *,
        eps: float,
        max_block_n: int = fused_launch.MAX_BLOCK_N,
        **casts: Any,
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """One fused collective on every rank (``algorithm``: "one_shot" or "two_shot"); outputs by rank.

        ``inputs[r]`` is copied into rank ``r``'s buffer first; every rank gets ``residual``
        and ``weight`` (as in tensor parallelism, where they are replicated).
        """
        _kernel(algorithm)  # refuses an unknown algorithm before touching the buffers
        xs = [self.input(r, tuple(x.shape), x.dtype) for r, x in enumerate(inputs)]
        for x, value in zip(xs, inputs):
            x.copy_(value)
        return self.launch(algorithm, xs, residual, weight, eps=eps, max_block_n=max_block_n, **casts)

    def launch(
        self,
        algorithm: str,
        xs: list[torch.Tensor],
        residual: torch.Tensor,
        weight: torch.Tensor | None,
        *,
        eps: float,
        max_block_n: int = fused_launch.MAX_BLOCK_N,
        **casts: Any,
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The collective on inputs already in place (``xs[r] = self.input(r, ...)``): what benchmarks time."""

        def one_rank(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            common = {"eps": eps, "max_blocks": self.max_blocks, "max_block_n": max_block_n, **casts}
            if algorithm == "one_shot":
                return one_shot.one_shot_all_reduce_residual_rms_norm(
                    self.peers[rank], xs[rank], residual, weight, **common
                )
            return two_shot.two_shot_all_reduce_residual_rms_norm(
                self.peers[rank], xs[rank], residual, weight, staging=self.staging[rank], **common
            )

        return self.run(one_rank, kernel=_kernel(algorithm))

    def race_check(
        self,
        algorithm: str,
        shape: tuple[int, int],
        dtype: torch.dtype,
        *,
        calls: int,
        eps: float = 1e-6,
        max_block_n: int = fused_launch.MAX_BLOCK_N,
        seed: int = 0,
        input_sets: int = 4,
    ) -> dict[str, float]:
        """``calls`` back-to-back collectives of ``shape`` / ``dtype`` against eager; the worst errors seen.

        Call ``k`` uses input set ``k % input_sets`` (consecutive calls differ), and each rank
        writes its next input into its buffer on its own stream right before its next
        launch, with no host synchronization between calls: a kernel that let a rank
        overwrite its input while a peer still reads it, or that left a slot raised,
        produces wrong numbers or hangs.  Errors are accumulated on the device and read once.

        Returns ``sum_max_abs`` (vs :func:`reference_same_order`: 0 for fp32),
        ``sum_max_ulp`` / ``norm_max_ulp`` (in ulps of ``dtype`` at the reference value),
        ``rstd_max_rel``, ``ranks_disagree`` (1 if two ranks' outputs differ in any bit) and
        ``slots_raised`` (signal slots left raised afterwards).
        """
        g = torch.Generator().manual_seed(seed)
        dev = self.device
        weight = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
        casts = {} if dtype == torch.float32 else {"upcast": torch.float32, "mid_dtype": dtype}
        sets = []
        for _ in range(max(1, min(calls, input_sets))):
            inputs = [torch.randn(shape, generator=g).to(dtype) for _ in range(self.world_size)]
            residual = torch.randn(shape, generator=g).to(dtype)
            want = reference_same_order(inputs, residual, weight, eps=eps, **casts)
            sets.append(([x.to(dev) for x in inputs], residual.to(dev), [t.to(dev) for t in want]))
        weight = weight.to(dev)
        xs = [self.input(r, shape, dtype) for r in range(self.world_size)]
        worst = {
            k: torch.zeros((), dtype=torch.float64, device=dev) for k in ("sum_abs", "sum_ulp", "norm_ulp", "rstd")
        }
        disagree = torch.zeros((), dtype=torch.bool, device=dev)
        for k in range(calls):
            inputs, residual, want = sets[k % len(sets)]

            def one_rank(rank: int, inputs: list[torch.Tensor] = inputs, residual: torch.Tensor = residual) -> Any:
                xs[rank].copy_(inputs[rank])  # the producer, on this rank's stream, right before the kernel
                common = {"eps": eps, "max_blocks": self.max_blocks, "max_block_n": max_block_n, **casts}
                if algorithm == "one_shot":
                    return one_shot.one_shot_all_reduce_residual_rms_norm(
                        self.peers[rank], xs[rank], residual, weight, **common
                    )
                return two_shot.two_shot_all_reduce_residual_rms_norm(
                    self.peers[rank], xs[rank], residual, weight, staging=self.staging[rank], **common
                )

            outs = self.run(one_rank, kernel=_kernel(algorithm))
            for s, y, rstd in outs:
                torch.maximum(worst["sum_abs"], (s.double() - want[0].double()).abs().max(), out=worst["sum_abs"])
                torch.maximum(worst["sum_ulp"], ulps_tensor(s, want[0]), out=worst["sum_ulp"])
                torch.maximum(worst["norm_ulp"], ulps_tensor(y, want[1]), out=worst["norm_ulp"])
                rel = ((rstd.double() - want[2].double()).abs() / want[2].double().abs()).max()
                torch.maximum(worst["rstd"], rel, out=worst["rstd"])
            for other in outs[1:]:
                for a, b in zip(outs[0], other):
                    disagree |= (a != b).any()
        return {
            "sum_max_abs": worst["sum_abs"].item(),
            "sum_max_ulp": worst["sum_ulp"].item(),
            "norm_max_ulp": worst["norm_ulp"].item(),
            "rstd_max_rel": worst["rstd"].item(),
            "ranks_disagree": float(disagree.item()),
            "slots_raised": float(self.signal_slots_raised()),
        }


def _kernel(algorithm: str) -> Any:
    if algorithm not in KERNELS:
        raise ValueError(f"algorithm {algorithm!r}: expected one of {KERNELS}")
    if algorithm == "one_shot":
        return one_shot._one_shot_all_reduce_residual_rms_norm_kernel
    return two_shot._two_shot_all_reduce_residual_rms_norm_kernel


def reference_same_order(
    inputs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor | None, *, eps: float, **casts: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager, on the CPU, with the kernel's summation order: fp32 ``((0 + x_0) + x_1) + ...``, one rounding.

    Then the aten epilogue (:func:`one_shot.reference`'s), so the residual sum is bit-exact
    and the norm differs only by the order of the row's sum of squares.
    """
    acc = torch.zeros(inputs[0].shape, dtype=torch.float32)
    for x in inputs:
        acc = acc + x.cpu().float()
    reduced = acc.to(inputs[0].dtype)
    w = None if weight is None else weight.cpu()
    from .reference import residual_rms_norm_reference

    return residual_rms_norm_reference(
        reduced, residual.cpu(), w, eps, casts.get("upcast"), casts.get("mid_dtype"), casts.get("out_dtype")
    )


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest ``|got - want|`` in units in the last place of ``want``'s dtype at ``want``."""
    return ulps_tensor(got, want).item()


def ulps_tensor(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """:func:`ulps` as a 0-d float64 tensor on ``want``'s device (no host synchronization)."""
    finfo = torch.finfo(want.dtype)
    w = want.double()
    _, exponent = torch.frexp(torch.clamp(w.abs(), min=finfo.tiny))  # 2**(exponent-1) <= |want| < 2**exponent
    spacing = torch.ldexp(torch.full_like(w, finfo.eps), exponent - 1)
    return ((got.double() - w).abs() / spacing).max()


def main(argv: list[str] | None = None) -> int:
    """``python -m dynamo_ext.inductor_lowerings.kernels.harness``: race checks, one JSON line per case.

    Exit status 2 when ranks cannot run here (this triton's interpreter), 1 when any case breaks its bound (fp32: residual sum exact, norm within
    8 ulp; bf16/fp16: sum and norm within 1 ulp; every rank bit-identical; no signal
    slot left raised).
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", default="1x4096,16x4096,128x4096,1024x8192", help="ROWSxHIDDEN,...")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--algorithms", default="one_shot,two_shot")
    parser.add_argument("--calls", type=int, default=1000, help="back-to-back collectives per case")
    parser.add_argument("--max-blocks", type=int, default=4)
    parser.add_argument("--max-block-n", type=int, default=fused_launch.MAX_BLOCK_N)
    args = parser.parse_args(argv)
    if interpreted():
        try:
            with _interpreter_threads(one_shot._one_shot_all_reduce_residual_rms_norm_kernel):
                pass
        except NotImplementedError as e:
            print(f"skipped: {e}")
            return 2
    device = torch.device("cuda") if torch.cuda.is_available() and not interpreted() else torch.device("cpu")
    failed = False
    for world in args.world:
        for size in args.sizes.split(","):
            rows, hidden = (int(v) for v in size.split("x"))
            for dtype_name in args.dtypes.split(","):
                dtype = getattr(torch, dtype_name)
                nbytes = rows * hidden * dtype.itemsize
                stage = two_shot.staging_nbytes((rows, hidden), dtype, dtype)
                ranks = InProcessRanks(world, max(nbytes, stage) + 256, device, max_blocks=args.max_blocks)
                for algorithm in args.algorithms.split(","):
                    got = ranks.race_check(
                        algorithm, (rows, hidden), dtype, calls=args.calls, max_block_n=args.max_block_n
                    )
                    exact = dtype == torch.float32
                    ok = (
                        (got["sum_max_abs"] == 0 if exact else got["sum_max_ulp"] <= 1)
                        and got["norm_max_ulp"] <= (8 if exact else 1)  # fp32: the sum of squares' order
                        and got["ranks_disagree"] == 0
                        and got["slots_raised"] == 0
                    )
                    failed |= not ok
                    case = {"world": world, "rows": rows, "hidden": hidden, "dtype": dtype_name}
                    print(json.dumps({**case, "algorithm": algorithm, "calls": args.calls, "ok": ok, **got}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
