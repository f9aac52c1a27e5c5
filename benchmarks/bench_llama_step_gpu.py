"""The bundled Llama's training step on one GPU (world size 1, NCCL): stock per-block and the plugin's whole
model with Inductor, first step and steady step, and their numbers against eager.

    python benchmarks/bench_llama_step_gpu.py [--ways per-block plugin] [--layers 8] [--dim 1024] [--steps 5]
        [--json PATH] [--deadline-s S]
    python benchmarks/bench_llama_step_gpu.py --dry-run    # CPU, gloo, the tiny default model, eager only

The model is ``dynamo_ext.audit.targets.example_llama``'s ``Decoder`` (sizes from the
flags; the defaults make steps long enough to time on a GPU), with FSDP2 ``fully_shard``
per block and at the root on a one-rank mesh (as ``bench_compile_time.py --fsdp-only``).
Ways, each in a fresh process with an empty ``TORCHINDUCTOR_CACHE_DIR`` (a cold first step:
Dynamo, AOTAutograd, Inductor and Triton compiles included):

- ``per-block``: stock ``torch.compile`` on each block's forward (torchtitan's way);
- ``plugin``: ``dynamo_ext.install()``, then ``torch.compile(model)``: one graph for the whole
  model, FSDP2's hooks traced (identical blocks traced and compiled once: the defaults).
- ``eager``: no compile (the dry run's only way).

In each process the model is built twice from seed 0; one copy steps eagerly beside the
compiled one on the same tokens (forward, cross-entropy, eager backward, AdamW).  Reported
per way: the first step (s), the median of ``--steps`` steady steps (ms, synchronized),
the eager step in the same process, the losses of both, the largest gradient difference
after the first step and parameter difference after the last, the graphs and graph breaks
Dynamo counted.  fp32 (TF32 off), so compiled and eager agree to rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "scripts"), os.path.join(HERE, "..")]

WAYS = ("eager", "per-block", "plugin")
GPU_MODEL = {"dim": 1024, "n_heads": 16, "hidden": 2816, "n_layers": 8, "seq": 1024, "batch": 4, "vocab": 32000}


def _build(cfg: Any, mesh: Any, device: Any) -> Any:
    import torch
    from torch.distributed.fsdp import fully_shard

    from dynamo_ext.audit.targets import example_llama as ex

    torch.manual_seed(0)
    with device:  # parameters made on the device (both copies alike, from the same seed)
        model = ex.Decoder(cfg)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _locals(tensors: list[Any]) -> list[Any]:
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max((float((x.double() - y.double()).abs().max()) for x, y in zip(a, b)), default=0.0)


def run_way(way: str, cfg_kwargs: dict[str, int], steps: int, backend: str, cuda: bool) -> dict[str, Any]:
    """One way in this process (a child of :func:`main`); the figures of the docstring."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812
    from torch.distributed.device_mesh import init_device_mesh

    import dynamo_ext
    from dynamo_ext.audit.targets import example_llama as ex

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        if cuda:
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
        else:
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            cfg = ex.Config(**cfg_kwargs)
            mesh = init_device_mesh(device.type, (1,))
            reference, model = _build(cfg, mesh, device), _build(cfg, mesh, device)
            if way == "plugin":
                dynamo_ext.install()
                compiled = torch.compile(model, backend=backend)
            elif way == "per-block":
                for block in model.layers:
                    block.forward = torch.compile(block.forward, backend=backend)
                compiled = model
            else:
                compiled = model
            gen = torch.Generator().manual_seed(1234)
            tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen).to(device)
            optims = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)}

            def step(forward: Any, module: Any, keep_grads: bool) -> tuple[float, float, list[Any]]:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                logits = forward(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
                loss.backward()
                grads = [p.grad.detach().clone() for p in module.parameters()] if keep_grads else []
                optims[id(module)].step()
                optims[id(module)].zero_grad()
                if cuda:
                    torch.cuda.synchronize()
                return time.perf_counter() - t0, float(loss.detach()), _locals(grads)

            ref_first, ref_loss, ref_grads = step(reference, reference, True)
            first, loss, grads = step(compiled, model, True)
            losses, ref_losses, times, ref_times = [loss], [ref_loss], [], []
            for _ in range(steps):
                t, loss_value, _ = step(reference, reference, False)
                ref_times.append(t)
                ref_losses.append(loss_value)
                t, loss_value, _ = step(compiled, model, False)
                times.append(t)
                losses.append(loss_value)
            params = _locals([p.detach() for p in model.parameters()])
            ref_params = _locals([p.detach() for p in reference.parameters()])
            counters = torch._dynamo.utils.counters
            return {
                "way": way,
                "backend": backend,
                "first_step_s": round(first, 3),
                "step_ms": round(1e3 * statistics.median(times), 3) if times else None,
                "eager_first_step_s": round(ref_first, 3),
                "eager_step_ms": round(1e3 * statistics.median(ref_times), 3) if ref_times else None,
                "steps": steps,
                "losses": losses,
                "eager_losses": ref_losses,
                "loss_max_abs_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "grad_max_abs_diff_step1": _max_diff(grads, ref_grads),
                "param_max_abs_diff_last": _max_diff(params, ref_params),
                "graphs": int(counters["stats"].get("unique_graphs", 0)),
                "graph_breaks": int(sum(counters["graph_break"].values())),
                "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            }
        finally:
            dynamo_ext.uninstall()
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from gpu_check_watchdog import JsonPart

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ways", nargs="+", default=["per-block", "plugin"], choices=WAYS)
    for name, value in GPU_MODEL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value, dest=name)
    parser.add_argument("--steps", type=int, default=5, help="steady steps timed after the first")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--json", help="write the results here (rewritten after each way)")
    parser.add_argument("--deadline-s", type=float, default=0, help="give the ways this long in all (0: no limit)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo (checks the script)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, the example's tiny model, eager only")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    cfg = {name: getattr(a, name) for name in GPU_MODEL}
    if a.dry_run:
        cfg, a.ways, a.steps, a.device = {}, ["eager"], 1, "cpu"
    if a.child:
        out = run_way(a.child, json.loads(os.environ["GPU_CHECK_LLAMA_CFG"]), a.steps, a.backend, a.device == "cuda")
        JsonPart(a.json).set(**out)
        return 0
    import torch

    part = JsonPart(a.json)
    cuda = a.device == "cuda"
    part.set(model=cfg or "example_llama.Config() defaults", device=a.device, ways={})
    if cuda and not torch.cuda.is_available():
        part.set(skipped="no CUDA device")
        print("no CUDA device: nothing to measure (or --dry-run)")
        return 0
    deadline = time.monotonic() + (a.deadline_s or 1e9)
    failed = 0
    for way in a.ways:
        left = deadline - time.monotonic()
        if left < 10:
            part.data["ways"][way] = {"status": "not run: no time left"}
            part.write()
            continue
        with tempfile.TemporaryDirectory(prefix="llama-inductor-") as cache:
            child_json = os.path.join(cache, "way.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", way, "--json", child_json]
            cmd += ["--steps", str(a.steps), "--backend", a.backend, "--device", a.device]
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "GPU_CHECK_LLAMA_CFG": json.dumps(cfg)}
            print(f"== {way}", flush=True)
            try:
                proc = subprocess.run(cmd, env=env, timeout=left)
                status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                status = f"timed out after {left:.0f} s"
            result = {}
            if os.path.exists(child_json):
                with open(child_json) as f:
                    result = json.load(f)
        failed += status != "ok"
        part.data["ways"][way] = {"status": status, **result}
        part.write()
        print(f"{way}: {json.dumps(part.data['ways'][way])}", flush=True)
    print(format_table(part.data["ways"]))
    return 1 if failed else 0


def format_table(ways: dict[str, Any]) -> str:
    """The ways side by side: first step, steady step, eager step, differences from eager."""
    lines = ["way        first step s  step ms  eager step ms  loss diff  grad diff  param diff  graphs  breaks"]
    for way, r in ways.items():
        if "first_step_s" not in r:
            lines.append(f"{way:10s} {r.get('status')}")
            continue
        lines.append(
            f"{way:10s} {r['first_step_s']:12.2f} {r['step_ms'] or 0:8.1f} {r['eager_step_ms'] or 0:14.1f} "
            f"{r['loss_max_abs_diff']:10.2e} {r['grad_max_abs_diff_step1']:10.2e} {r['param_max_abs_diff_last']:11.2e} "
            f"{r['graphs']:7d} {r['graph_breaks']:7d}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
