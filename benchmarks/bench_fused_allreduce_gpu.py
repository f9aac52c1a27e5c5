"""GPU benchmark: fused one-shot all-reduce + residual add + RMSNorm vs stock Inductor.

    python benchmarks/bench_fused_allreduce_gpu.py [--hidden 4096 8192] [--max-tokens 4096] [--world 2 4]
    python benchmarks/bench_fused_allreduce_gpu.py --interpret-smoke   # no GPU: tiny shapes, CPU, Triton interpreter
    torchrun --nproc-per-node 8 benchmarks/bench_fused_allreduce_gpu.py --world   # one rank per GPU, NVLink

World size 1 (one GPU, an NCCL group of one rank), or under ``torchrun`` one rank per GPU
(``WORLD_SIZE`` > 1: every rank times the same calls a fixed number of times, the
slowest rank counts), bf16, Llama-style epilogue
``weight * rmsnorm(all_reduce(x) + residual)``, for each hidden size and 1..max tokens:

- ``stock``: ``torch.compile(backend="inductor")`` without the plugin: NCCL all-reduce,
  then Inductor's own add + RMSNorm kernel;
- ``kernel``: our one-shot Triton kernel launched directly on a symmetric-memory input;
- ``compiled``: the same function compiled with the plugin and symmetric memory on
  for the group, so the lowering picks the one-shot kernel (the input is a graph input
  here, so Inductor first copies it into the comm buffer; in a real block the matmul
  writes there directly).

Then, for each ``--world W`` > 1, the in-process harness (NOTE [in-process ranks] in
``dynamo_ext/inductor_lowerings/kernels/harness.py``): W ranks as W streams on the one
GPU, each with its own buffer and signal pad, the kernel ``ops.fused_all_reduce_algorithm``
picks for the size (one-shot, two-shot, or none: then the row says "stock"), all W
launched together and timed as one step.  Every rank's reads of its peers go to the
same HBM, so this measures the kernels' barriers and their traffic on one device, not
NVLink (benchmarks/README.md); stock has no W-rank equivalent in one process.

Times are ``triton.testing.do_bench`` medians (µs).  GB/s counts the bytes the epilogue
must move (every rank's input once, residual, both outputs, weight) and is compared
with the device-to-device copy bandwidth measured at the start (``copy_`` of 1 GiB,
read + write).

``--interpret-smoke`` runs the same loop on the CPU: the kernel through the Triton
interpreter on a host-shared buffer, ``stock`` compiled for the CPU on a fake group,
wall-clock timers.  It checks the script, not the speed.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


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


def _harness_rows(timer: Timer, smoke: bool, shapes: list[Any], data: dict[Any, Any], worlds: list[int]) -> list[Any]:
    """(world, hidden, tokens, kernel, µs per step, GB/s) per W > 1 and shape, from the in-process harness."""
    import torch

    from dynamo_ext.inductor_lowerings import ops
    from dynamo_ext.inductor_lowerings.kernels import harness
    from dynamo_ext.inductor_lowerings.kernels import two_shot_all_reduce_rms_norm as two_shot

    if not worlds or (not smoke and not torch.cuda.is_available()):
        return []
    device = torch.device("cpu" if smoke else "cuda")
    rows = []
    for world in worlds:
        if world < 2:
            continue
        for hidden, tokens in shapes:
            x, res, w = data[(hidden, tokens)]
            nbytes = x.numel() * x.element_size()
            algorithm = ops.fused_all_reduce_algorithm(nbytes)
            if algorithm is None:
                rows.append((world, hidden, tokens, None, 0.0, 0.0))
                continue
            size = max(nbytes, two_shot.staging_nbytes(tuple(x.shape), x.dtype, x.dtype)) + 256
            ranks = harness.InProcessRanks(world, size, device, max_blocks=8)
            xs = [ranks.input(r, tuple(x.shape), x.dtype) for r in range(world)]
            for xr in xs:
                xr.copy_(x)
            casts = {"upcast": torch.float32, "mid_dtype": x.dtype}
            got = ranks.launch(algorithm, xs, res, w, eps=1e-6, **casts)[0][1]
            want = harness.reference_same_order([x] * world, res, w, eps=1e-6, **casts)[1]
            torch.testing.assert_close(got.cpu(), want, rtol=2**-7, atol=2**-7)
            us = timer.us(
                lambda ranks=ranks, a=algorithm, xs=xs, res=res, w=w, c=casts: ranks.launch(
                    a, xs, res, w, eps=1e-6, **c
                )
            )
            moved = world * (
                (world + 3) * nbytes + w.numel() * w.element_size()
            )  # every rank: W inputs, residual, 2 outputs
            rows.append((world, hidden, tokens, algorithm, us, moved / (us * 1e-6) / 1e9))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--interpret-smoke", action="store_true", help="no GPU: tiny shapes on the CPU interpreter")
    parser.add_argument(
        "--world", type=int, nargs="*", default=[2, 4], help="in-process ranks on the one GPU (none under torchrun)"
    )
    a = parser.parse_args()
    smoke = a.interpret_smoke
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
        hiddens, max_tokens = [64, 96], 4
    else:
        hiddens, max_tokens = a.hidden, a.max_tokens
    import torch

    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (run on a GPU, or --interpret-smoke to check the script)")
        return
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
        harness_rows = _harness_rows(timer, smoke, shapes, data, a.world) if world_size == 1 else []
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
    if harness_rows:
        print(f"\nW in-process ranks on {where} (one stream each, launched together; one HBM, no NVLink)")
        print(
            f"{'world':>5s} {'hidden':>6s} {'tokens':>6s} {'kernel':>8s} {'step us':>9s} {'GB/s':>8s} {'% of copy':>9s}"
        )
        for world, hidden, tokens, algorithm, us, gbs in harness_rows:
            if algorithm is None:
                print(f"{world:5d} {hidden:6d} {tokens:6d} {'stock':>8s} {'-':>9s} {'-':>8s} {'-':>9s}")
                continue
            print(
                f"{world:5d} {hidden:6d} {tokens:6d} {algorithm:>8s} {us:9.1f} {gbs:8.1f} {100 * gbs / copy_gbs:8.1f}%"
            )


if __name__ == "__main__":
    main()
