"""GPU benchmark: fused all-reduce + residual add + RMSNorm (one-shot, two-shot) vs the unfused sequence.

    python benchmarks/bench_fused_allreduce_gpu.py [--hidden 4096 8192] [--max-tokens 8192] [--world 2 4 8]
        [--dtypes bfloat16 float32] [--sweep-only] [--json PATH]
    python benchmarks/bench_fused_allreduce_gpu.py --interpret-smoke   # no GPU: tiny shapes, CPU, Triton interpreter
    torchrun --nproc-per-node 8 benchmarks/bench_fused_allreduce_gpu.py --world   # one rank per GPU, NVLink

Two parts, Llama-style epilogue ``weight * rmsnorm(all_reduce(x) + residual)``, for each
hidden size and 1..max tokens (powers of two):

1. World size 1 (one GPU, an NCCL group of one rank), or under ``torchrun`` one rank per
   GPU (``WORLD_SIZE`` > 1: every rank times the same calls a fixed number of times, the
   slowest rank counts), bf16 (left out with ``--sweep-only``):

   - ``stock``: ``torch.compile(backend="inductor")`` without the plugin: NCCL all-reduce,
     then Inductor's own add + RMSNorm kernel;
   - ``kernel``: the kernel ``ops.fused_all_reduce_algorithm`` picks, launched directly on a
     symmetric-memory input;
   - ``compiled``: the same function compiled with the plugin and symmetric memory on
     for the group, so the lowering picks the fused kernel (the input is a graph input
     here, so Inductor first copies it into the comm buffer; in a real block the matmul
     writes there directly).

   Times are ``triton.testing.do_bench`` medians (µs).

2. For each ``--world W`` > 1 (one process), the sweep (NOTE [fused vs unfused on W
   simulated ranks] in ``_fused_allreduce_sweep.py``): W ranks as W streams of the one
   GPU; fused one-shot and fused two-shot against the unfused sequence (the all-reduce,
   then Inductor's add + RMSNorm), bf16 and fp32, every variant checked against the fp32
   reference; CUDA-event medians of ``--reps`` steps, effective bandwidth as a % of the
   measured copy bandwidth, and the crossovers, printed and in ``--json``.  Every rank's
   reads of its peers go to the same memory, so this measures the kernels' barriers and
   traffic on one device, not NVLink (benchmarks/README.md).

GB/s counts the bytes the epilogue must move (every rank's input once, residual, both
outputs, weight) against the device-to-device copy bandwidth measured at the start
(``copy_`` of 1 GiB, bytes read + written).

``--interpret-smoke`` runs both parts on the CPU: the kernels through the Triton
interpreter (host-shared buffers at world size 1, thread-ranks in the sweep), ``stock``
compiled for the CPU on a fake group, the sweep's unfused sequence through Dynamo without
Inductor, wall-clock timers.  It checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "scripts"), os.path.join(HERE, "..")]


def epilogue(x, residual, weight, group_name: str):
    import torch
    import torch.distributed._functional_collectives as funcol

    r = funcol.all_reduce(x, "sum", group_name) + residual
    h32 = r.float()
    return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(r.dtype), r


def _twin(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object: one static-shape compile per shape, no recompile limit."""
    name = f"{fn.__name__}_{tag}"
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name)


class Timer:
    def __init__(self, cuda: bool, world_size: int = 1) -> None:
        self.cuda = cuda
        self.world_size = world_size

    def us(self, fn: Callable[[], Any]) -> float:
        if self.cuda and self.world_size > 1:  # collectives: the same number of calls on every rank
            import torch
            import torch.distributed as dist

            for _ in range(10):
                fn()
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(100):
                fn()
            end.record()
            torch.cuda.synchronize()
            elapsed = torch.tensor([start.elapsed_time(end) * 1e3 / 100], device="cuda")
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            return elapsed.item()
        if self.cuda:
            from triton.testing import do_bench

            return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        fn()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6


def _copy_bandwidth(timer: Timer, device: str) -> float:
    import torch

    nbytes = (1 << 30) if timer.cuda else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (timer.us(lambda: dst.copy_(src)) * 1e-6) / 1e9


def _setup(smoke: bool, tmp: str) -> tuple[str, str]:
    """Initialise the one-rank group; return (device, group name)."""
    import torch
    import torch.distributed as dist

    if smoke:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
        return "cpu", dist.group.WORLD.group_name
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: one rank per GPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    group_name = dist.group.WORLD.group_name
    from dynamo_ext import _compat

    _compat.ensure_symm_mem_for_group(group_name)  # this release's route (NOTE [symmetric memory route])
    return f"cuda:{torch.cuda.current_device()}", group_name


def _peer_input(smoke: bool, tmp: str, tokens: int, hidden: int, dtype: Any, group_name: str) -> tuple[Any, Any]:
    """(input tensor in peer-visible memory, PeerBuffers); the symmetric-memory rendezvous is collective."""
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import PeerBuffers, create_host_shared

    if smoke:
        directory = tempfile.mkdtemp(dir=tmp)
        nbytes = tokens * hidden * dtype.itemsize
        create_host_shared(directory, world_size=1, buffer_nbytes=nbytes, max_blocks=4)
        peers = PeerBuffers.open_host_shared(directory, rank=0, world_size=1)
        return peers.local_tensor((tokens, hidden), dtype), peers
    import torch
    import torch.distributed._symmetric_memory as symm_mem

    x = symm_mem.empty(tokens, hidden, dtype=dtype, device=f"cuda:{torch.cuda.current_device()}")
    return x, PeerBuffers.from_symmetric_memory(x, group_name)


def _world_one(smoke: bool, hiddens: list[int], max_tokens: int) -> None:
    """World size 1 (one GPU, an NCCL group of one rank) or one rank per GPU under torchrun: stock, kernel, compiled."""
    import torch
    import torch.distributed as dist

    import dynamo_ext
    from dynamo_ext.inductor_lowerings import ops, options
    from dynamo_ext.inductor_lowerings.kernels import one_shot_all_reduce_rms_norm as kernel
    from dynamo_ext.inductor_lowerings.kernels import two_shot_all_reduce_rms_norm as two_shot
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import PeerBuffers

    options.one_shot = True  # the kernels are opt-in (NOTE [fused all-reduce kernels opt-in]); this measures them
    dtype = torch.bfloat16
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    timer = Timer(cuda=not smoke, world_size=world_size)
    tokens_list = [1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens]
    with tempfile.TemporaryDirectory() as tmp:
        device, group_name = _setup(smoke, tmp)
        copy_gbs = _copy_bandwidth(timer, device)
        g = torch.Generator().manual_seed(0)
        shapes = [(h, t) for h in hiddens for t in tokens_list]
        data = {
            s: tuple(
                torch.randn(shape, generator=g).to(dtype).to(device) for shape in ((s[1], s[0]), (s[1], s[0]), (s[0],))
            )
            for s in shapes
        }

        stock: dict[tuple[int, int], float] = {}
        for s in shapes:  # stock Inductor first: install() below resets Dynamo
            fn = torch.compile(_twin(epilogue, f"stock_{s[0]}_{s[1]}"), backend="inductor", dynamic=False)
            x, res, w = data[s]
            stock[s] = timer.us(lambda fn=fn, x=x, res=res, w=w: fn(x, res, w, group_name))

        dynamo_ext.install()
        rows = []
        for s in shapes:
            hidden, tokens = s
            x, res, w = data[s]
            peer_x, peers = _peer_input(smoke, tmp, tokens, hidden, dtype, group_name)
            peer_x.copy_(x)
            casts = {"upcast": torch.float32, "mid_dtype": dtype}

            nbytes_in = tokens * hidden * dtype.itemsize
            algorithm = ops.fused_all_reduce_algorithm(nbytes_in) if peers.world_size > 1 else "one_shot"
            staging = None
            if algorithm == "two_shot":  # the group's workspace, as the op uses (a collective call)
                need = two_shot.staging_nbytes((tokens, hidden), dtype, dtype)
                staging = PeerBuffers.symmetric_workspace(group_name, need, peer_x.device)

            def fused(peers=peers, peer_x=peer_x, res=res, w=w, casts=casts, algorithm=algorithm, staging=staging):
                if algorithm == "two_shot":
                    return two_shot.two_shot_all_reduce_residual_rms_norm(
                        peers, peer_x, res, w, eps=1e-6, staging=staging, **casts
                    )
                return kernel.one_shot_all_reduce_residual_rms_norm(peers, peer_x, res, w, eps=1e-6, **casts)

            if algorithm is None:  # above options.two_shot_max_bytes: the op runs stock NCCL + our epilogue
                kernel_us = float("nan")
            else:
                got, want = fused()[1], epilogue(x, res, w, group_name)[0]
                torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
                kernel_us = timer.us(fused)
            fn = torch.compile(_twin(epilogue, f"ours_{hidden}_{tokens}"), backend="inductor", dynamic=False)
            compiled_us = timer.us(lambda fn=fn, x=x, res=res, w=w: fn(x, res, w, group_name))
            nbytes = (peers.world_size + 3) * tokens * hidden * dtype.itemsize + hidden * dtype.itemsize
            rows.append((hidden, tokens, stock[s], kernel_us, compiled_us, nbytes / (kernel_us * 1e-6) / 1e9))
        dynamo_ext.uninstall()
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return

    where = "CPU, Triton interpreter (script check only)" if smoke else torch.cuda.get_device_name()
    print(f"{where}; torch {torch.__version__}; bf16; world size {world_size}; D2D copy {copy_gbs:.0f} GB/s")
    print(
        f"{'hidden':>6s} {'tokens':>6s} {'stock us':>9s} {'kernel us':>9s} {'compiled us':>11s} "
        f"{'stock/kernel':>12s} {'kernel GB/s':>11s} {'% of copy':>9s}"
    )
    for hidden, tokens, s_us, k_us, c_us, gbs in rows:
        print(
            f"{hidden:6d} {tokens:6d} {s_us:9.1f} {k_us:9.1f} {c_us:11.1f} {s_us / k_us:11.2f}x "
            f"{gbs:11.1f} {100 * gbs / copy_gbs:8.1f}%"
        )


def _sweep(a: argparse.Namespace, smoke: bool, worlds: list[int]) -> int:
    """The W-rank sweep (NOTE [fused vs unfused on W simulated ranks]); 1 when a variant gave a wrong number."""
    import _fused_allreduce_sweep as sweep
    import torch
    from gpu_check_watchdog import JsonPart, Watchdog

    if smoke:  # the script's paths, not its speed: tiny sizes, a few steps, Dynamo without Inductor
        hiddens, tokens, reps, warmup = [64], [1, 4], 2, 0
    else:
        hiddens, reps, warmup = a.hidden, a.reps, a.warmup
        tokens = [1 << i for i in range(a.max_tokens.bit_length()) if 1 << i <= a.max_tokens]
    part = JsonPart(a.json)
    where = "CPU, Triton interpreter (script check only)" if smoke else torch.cuda.get_device_name()
    part.set(device=where, worlds=worlds, hiddens=hiddens, tokens=tokens, dtypes=a.dtypes, reps=reps, warmup=warmup)
    watchdog = None
    if a.watchdog_s:
        watchdog = Watchdog(a.watchdog_s, name="bench", on_fire=lambda report: part.set(watchdog=report)).start()
    deadline = time.monotonic() + (a.deadline_s or 1e9)
    print(f"\nW in-process ranks on {where} (one stream each; one memory, no NVLink)")
    print(sweep.header())
    rows = sweep.run_sweep(
        worlds=worlds,
        hiddens=hiddens,
        tokens=tokens,
        dtypes=a.dtypes,
        cuda=not smoke,
        part=part,
        watchdog=watchdog,
        reps=reps,
        warmup=warmup,
        unfused_backend="eager" if smoke else a.unfused_backend,
        deadline=deadline,
    )
    if watchdog is not None:
        watchdog.stop()
    print(f"\ncopy bandwidth {part.data['copy_gbs']} GB/s; crossovers (tokens; None: never / from the first size)")
    print("\n".join(sweep.format_crossovers(part.data["crossovers"])))
    wrong = [r for r in rows if not all(r.get(f"{v}_ok") for v in ("one_shot", "two_shot"))]
    part.set(wrong_rows=len(wrong), done=True)
    return 1 if wrong else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens 1, 2, 4, ... up to this")
    parser.add_argument("--interpret-smoke", action="store_true", help="no GPU: tiny shapes on the CPU interpreter")
    parser.add_argument(
        "--world", type=int, nargs="*", default=[2, 4, 8], help="in-process ranks on the one GPU (none under torchrun)"
    )
    parser.add_argument("--sweep-only", action="store_true", help="only the W-rank sweep, not the world-size-1 rows")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=100, help="timed steps per size (the median is reported)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--unfused-backend", default="inductor", help="torch.compile backend of the unfused sequence")
    parser.add_argument("--json", help="the sweep's rows, crossovers and copy bandwidth (rewritten after each size)")
    parser.add_argument("--deadline-s", type=float, default=0, help="stop the sweep after this many seconds (0: none)")
    parser.add_argument("--watchdog-s", type=float, default=0, help="end a run stuck this long, with the ranks' state")
    a = parser.parse_args(argv)
    smoke = a.interpret_smoke
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
    import torch

    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (run on a GPU, or --interpret-smoke to check the script)")
        return 0
    if not a.sweep_only:
        _world_one(smoke, [64, 96] if smoke else a.hidden, 4 if smoke else a.max_tokens)
    worlds = [w for w in a.world if w > 1] if int(os.environ.get("WORLD_SIZE", "1")) == 1 else []
    return _sweep(a, smoke, worlds) if worlds else 0


if __name__ == "__main__":
    raise SystemExit(main())
