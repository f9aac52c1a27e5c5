"""GPU benchmark: fused one-shot all-reduce + residual add + RMSNorm vs stock Inductor.

    python benchmarks/bench_fused_allreduce_gpu.py [--hidden 4096 8192] [--max-tokens 4096]
    python benchmarks/bench_fused_allreduce_gpu.py --interpret-smoke   # no GPU: tiny shapes, CPU, Triton interpreter

World size 1 (one GPU, an NCCL group of one rank), bf16, Llama-style epilogue
``weight * rmsnorm(all_reduce(x) + residual)``, for each hidden size and 1..max tokens:

- ``stock``: ``torch.compile(backend="inductor")`` without the plugin: NCCL all-reduce,
  then Inductor's own add + RMSNorm kernel;
- ``kernel``: our one-shot Triton kernel launched directly on a symmetric-memory input;
- ``compiled``: the same function compiled with the plugin and symmetric memory on
  for the group, so the lowering picks the one-shot kernel (the input is a graph input
  here, so Inductor first copies it into the comm buffer; in a real block the matmul
  writes there directly).

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
import warnings
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
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def us(self, fn: Callable[[], Any]) -> float:
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
    store = dist.FileStore(os.path.join(tmp, "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    group_name = dist.group.WORLD.group_name
    import torch.distributed._symmetric_memory as symm_mem

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated on 2.13+, still how older releases enable it
        symm_mem.enable_symm_mem_for_group(group_name)
    return "cuda", group_name


def _peer_input(smoke: bool, tmp: str, tokens: int, hidden: int, dtype: Any, group_name: str) -> tuple[Any, Any]:
    """(input tensor in peer-visible memory, PeerBuffers) for world size 1."""
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import PeerBuffers, create_host_shared

    if smoke:
        directory = tempfile.mkdtemp(dir=tmp)
        nbytes = tokens * hidden * dtype.itemsize
        create_host_shared(directory, world_size=1, buffer_nbytes=nbytes, max_blocks=4)
        peers = PeerBuffers.open_host_shared(directory, rank=0, world_size=1)
        return peers.local_tensor((tokens, hidden), dtype), peers
    import torch.distributed._symmetric_memory as symm_mem

    x = symm_mem.empty(tokens, hidden, dtype=dtype, device="cuda")
    return x, PeerBuffers.from_symmetric_memory(x, group_name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--interpret-smoke", action="store_true", help="no GPU: tiny shapes on the CPU interpreter")
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
    from dynamo_ext.inductor_lowerings.kernels import one_shot_all_reduce_rms_norm as kernel

    dtype = torch.bfloat16
    timer = Timer(cuda=not smoke)
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

            def fused(peers=peers, peer_x=peer_x, res=res, w=w, casts=casts):
                return kernel.one_shot_all_reduce_residual_rms_norm(peers, peer_x, res, w, eps=1e-6, **casts)

            got, want = fused()[1], epilogue(x, res, w, group_name)[0]
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
            kernel_us = timer.us(fused)
            fn = torch.compile(_twin(epilogue, f"ours_{hidden}_{tokens}"), backend="inductor", dynamic=False)
            compiled_us = timer.us(lambda fn=fn, x=x, res=res, w=w: fn(x, res, w, group_name))
            nbytes = (peers.world_size + 3) * tokens * hidden * dtype.itemsize + hidden * dtype.itemsize
            rows.append((hidden, tokens, stock[s], kernel_us, compiled_us, nbytes / (kernel_us * 1e-6) / 1e9))
        dynamo_ext.uninstall()
        dist.destroy_process_group()

    where = "CPU, Triton interpreter (script check only)" if smoke else torch.cuda.get_device_name()
    print(f"{where}; torch {torch.__version__}; bf16; world size 1; D2D copy {copy_gbs:.0f} GB/s")
    print(
        f"{'hidden':>6s} {'tokens':>6s} {'stock us':>9s} {'kernel us':>9s} {'compiled us':>11s} "
        f"{'stock/kernel':>12s} {'kernel GB/s':>11s} {'% of copy':>9s}"
    )
    for hidden, tokens, s_us, k_us, c_us, gbs in rows:
        print(
            f"{hidden:6d} {tokens:6d} {s_us:9.1f} {k_us:9.1f} {c_us:11.1f} {s_us / k_us:11.2f}x "
            f"{gbs:11.1f} {100 * gbs / copy_gbs:8.1f}%"
        )


if __name__ == "__main__":
    main()
