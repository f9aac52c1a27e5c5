"""What several benchmark scripts share: launching ranks (with cold and warm caches), the bundled Llama, timing
steps, the shared corpus's timed cases.

Imported as ``from _common import ...`` (a script's own directory is on ``sys.path``).
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torch's launcher's rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_corpus_cases(cases: dict[str, Any], env: Any, k: str | None) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(name, case, fn, args)`` of each corpus case to time: matching ``k`` (name or tag), not compiled-autograd,
    not expected to fail; the case's factory is called with ``env``."""
    for name, c in cases.items():
        if k and k not in name and not any(k in t for t in c.tags):
            continue
        if c.compiled_autograd or c.expect_error:
            continue
        made = c.factory(env)
        yield name, c, made[0], made[1]


def launch_on_ranks(fn: Callable[..., Any], *args: Any, nproc: int) -> dict[int, Any]:
    """``fn(*args)`` on ``nproc`` local processes started by torch's elastic launcher; their results by rank.

    Rendezvous: c10d on a free port of 127.0.0.1, ``spawn`` start method, no restarts.  ``fn`` must be a
    module-level function (pickled into the spawned ranks); it creates its own process group.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"bench-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        start_method="spawn",
    )
    return elastic_launch(config, fn)(*args)


def steps_per_second(step: Callable[[int], None], steps: int, *, first: int, rounds: int = 3) -> float:
    """Median over ``rounds`` timed rounds of ``steps`` calls ``step(i)`` (``i`` from ``first`` on) in steps/s.

    Each round starts after a barrier of the default group and is timed by its slowest rank (an all-reduce
    of the elapsed seconds with MAX), so every rank returns the same figure.
    """
    import torch
    import torch.distributed as dist

    rates = []
    for r in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(steps):
            step(first + r * steps + i)
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        rates.append(steps / float(elapsed))
    return statistics.median(rates)


def compare_ways(one_way: Callable[..., dict[str, Any]], ways: tuple[str, ...], *args: Any) -> dict[str, Any]:
    """One rank of a launch: ``one_way(rank, world, way, *args)`` for each way, in one gloo process group.

    Each result's ``"params"`` (tensors after training) becomes ``"param_diff"``: the largest absolute
    difference from the first way's parameters.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        out = {way: one_way(rank, world, way, *args) for way in ways}
        ref = out[ways[0]]["params"]
        for r in out.values():
            r["param_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref, r.pop("params")))
        return out
    finally:
        dist.destroy_process_group()


def max_over_ranks(seconds: float) -> float:
    """The largest ``seconds`` of all ranks of the default group (an all-reduce with MAX): the slowest rank's."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bundled_llama(layers: int, *, fsdp_only: bool) -> tuple[Any, Any, Any]:
    """``(model, config, tokens)``: the bundled Llama (``dynamo_ext.audit.targets.example_llama``, small dims) with
    ``layers`` blocks, on the default (gloo) group.

    TP + FSDP2 on a ``(2, W/2)`` mesh (``example_llama.parallelize``), or with ``fsdp_only`` FSDP2 alone per block
    and at the root on a 1-D mesh of all ranks.  ``tokens``: int64 ``[batch, seq + 1]``, seeded per data-parallel
    rank (the TP ranks of one data-parallel rank see the same batch).  Seeds the model with 0.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dynamo_ext.audit.targets import example_llama as ex

    cfg = ex.Config(n_layers=layers)
    torch.manual_seed(0)
    if fsdp_only:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = ex.Decoder(cfg)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        model, dp_rank = fully_shard(model, mesh=mesh), dist.get_rank()
    else:
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
        model, dp_rank = ex.parallelize(ex.Decoder(cfg), mesh), mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(1234 + dp_rank)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
    return model, cfg, tokens


def llama_loss(model: Callable[[Any], Any], cfg: Any, tokens: Any) -> Any:
    """Next-token cross-entropy of ``model`` on ``tokens`` (``[batch, seq + 1]``): a scalar tensor."""
    import torch.nn.functional as F  # noqa: N812

    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))


def cold_and_warm(launch: Callable[[], Any], *, prefix: str, warm: bool = True) -> tuple[Any, Any]:
    """``(cold, warm)`` results of ``launch()`` run twice with one fresh ``TORCHINDUCTOR_CACHE_DIR``.

    The first launch finds the directory empty (Inductor's FX graph cache, AOTAutograd's cache and the
    collective check's records start cold); the second reads what the first wrote, as a restarted job does.
    With ``warm=False`` the second launch is skipped and ``warm`` is ``None``.
    """
    cache = tempfile.mkdtemp(prefix=prefix)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # inherited by the launched ranks
    try:
        cold = launch()
        return cold, (launch() if warm else None)
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
