"""Communication order on 2 real gloo ranks under ``backend="inductor"``: eager's values and no hang, with Inductor's
``simple_overlap`` on and off where the release has it (NOTE [buckets keep the communication order],
NOTE [communication order under Inductor's passes]).

One launch of 2 ranks runs every part.  Each program runs on a process group of its own with a 30 s gloo
timeout, so a hang ends in a gloo error within the part instead of holding the launch; the tests then read
``error`` first.
"""

from __future__ import annotations

import datetime
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import run_parts_on_ranks
from test_lowering_comm_order import simple_overlap_patch

pytestmark = pytest.mark.gloo  # one 2-process launch for the file

TIMEOUT = datetime.timedelta(seconds=30)


def _settings() -> list[bool | None]:
    from dynamo_ext import _compat

    return [None] if _compat.simple_overlap_enabled() is None else [True, False]


def _compile_and_run(fn, args: tuple[Any, ...], simple_overlap: bool | None) -> Any:
    from dynamo_ext import _compat

    patch = {"fx_graph_cache": False}  # rank 1 would hit rank 0's entry (one cache directory): another graph
    if simple_overlap is not None:
        patch.update(simple_overlap_patch(simple_overlap))
    torch._dynamo.reset()
    with _compat.inductor_config().patch(patch):
        return torch.compile(fn, backend="inductor")(*args)


def _against_eager(program, make_args, rank: int, world_size: int) -> dict[str, Any]:
    """``program(*make_args(rank), group)`` eager, then compiled per ``simple_overlap`` setting: max error or the error."""
    out: dict[str, Any] = {}
    for setting in _settings():
        group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        eager = program(*make_args(rank), group)
        try:
            compiled = _compile_and_run(program, (*make_args(rank), group), setting)
            out[str(setting)] = {
                "error": None,
                "max_err": max((c.double() - e.double()).abs().max().item() for c, e in zip(compiled, eager)),
            }
        except Exception as e:  # a gloo timeout: the ranks waited for each other
            out[str(setting)] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "max_err": None}
    return out


# ---- a blocking ring exchange, then two all-reduces a bucket merges ------------------------------
def ring(a, b, buf, group):
    """Even ranks send then receive, odd ranks receive then send (deadlock-free), then two all-reduces."""
    rank = dist.get_rank()
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if rank % 2 == 0:
        dist.send(a, dst=peer, group=group)
        dist.recv(buf, src=peer, group=group)
    else:
        dist.recv(buf, src=peer, group=group)
        dist.send(a, dst=peer, group=group)
    c = a + buf.sum()
    dist.all_reduce(c, group=group)
    dist.all_reduce(b, group=group)
    return c, b, buf


def relay(a, b, buf, group):
    """An all-reduce before the ring whose result odd ranks pass on: their data flow keeps it apart from the one
    after the ring, so a bucket of the two moved it across the ring on even ranks only (a hang on ``a25f398``)."""
    rank = dist.get_rank()
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    x = a * 2
    dist.all_reduce(x, group=group)
    if rank % 2 == 0:
        dist.send(a, dst=peer, group=group)
        dist.recv(buf, src=peer, group=group)
    else:
        dist.recv(buf, src=peer, group=group)
        dist.send(x, dst=peer, group=group)
    dist.all_reduce(b, group=group)
    return x, b, buf


def _ring_args(rank: int) -> tuple[torch.Tensor, ...]:
    return torch.arange(4.0) + 10 * rank, torch.full((4,), rank + 1.0), torch.zeros(4)


# ---- a bucket, then an all-reduce simple_overlap would hoist above it on one rank only ---------------------
def hoisted(a, b, c, group):
    """On odd ranks the max all-reduce reads the bucket's result; on even ranks ``simple_overlap`` issued it
    before the bucket (wrong numbers on ``a25f398`` with 2.15: the ranks paired other all-reduces)."""
    x, y = a * 2, b * 3
    dist.all_reduce(x, group=group)
    dist.all_reduce(y, group=group)
    if dist.get_rank() % 2:
        c = c + x.sum()
    dist.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
    return x, y, c


def bucket_next_to_another_group(a, b, c, group):
    """A bucket on ``group`` next to a stock all-reduce on the default group (same ranks, another group)."""
    x, y = a * 2, b * 3
    dist.all_reduce(x, group=group)
    dist.all_reduce(y, group=group)
    dist.all_reduce(c)
    return x, y, c


def barrier_between(a, b, c, group):
    """Bucketable all-reduces with a barrier between them."""
    x, y = a * 2, b * 3
    dist.all_reduce(x, group=group)
    dist.barrier(group=group)
    dist.all_reduce(y, group=group)
    return x, y, c


def _three_args(rank: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(4, generator=g), torch.randn(4, generator=g), torch.randn(4, generator=g) + rank


# ---- a two-stage pipeline with gradient all-reduces around its exchange ----------------------------------
def pipeline_step(w, tied, x, target, prev_grad, act, grad_buf, group):
    """One SGD step of a two-stage pipeline (rank 0: stage 0, rank 1: stage 1), gradients by hand.

    Stage 0 computes ``h = tanh(x @ w + tied)`` and sends it; stage 1 computes ``out = h @ w + tied`` and the
    MSE loss, and sends back the gradient of ``h``.  ``tied`` is shared by the stages (as tied embeddings
    are): its gradient is summed across them.  Around the exchange: the all-reduce of the previous step's
    tied gradient before, of the loss (zero on stage 0) after.
    """
    rank = dist.get_rank()
    reduced = prev_grad * 1.0
    dist.all_reduce(reduced, group=group)
    tied = tied - 0.1 * reduced
    if rank == 0:
        h = torch.tanh(x @ w + tied)
        dist.send(h, dst=1, group=group)
        dist.recv(grad_buf, src=1, group=group)
        d_pre = grad_buf * (1 - h * h)
        grad_w, grad_tied = x.t() @ d_pre, d_pre.sum(0)
        loss = torch.zeros(())
    else:
        dist.recv(act, src=0, group=group)
        out = act @ w + tied
        loss = ((out - target) ** 2).mean()
        d_out = 2 * (out - target) / out.numel()
        grad_w, grad_tied = act.t() @ d_out, d_out.sum(0)
        dist.send(d_out @ w.t(), dst=0, group=group)
    dist.all_reduce(loss, group=group)
    return loss, grad_w, w - 0.1 * grad_w, tied, grad_tied


def _pipeline(rank: int, world_size: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + rank)
    w0, tied0 = torch.randn(6, 6, generator=g) / 3, torch.randn(6, generator=torch.Generator().manual_seed(7)) / 3
    x, target = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)

    def train(step_fn) -> list[torch.Tensor]:
        w, tied, prev = w0.clone(), tied0.clone(), torch.zeros(6)
        record = []
        for _ in range(3):
            loss, grad_w, w, tied, prev = step_fn(w, tied, x, target, prev, torch.zeros(5, 6), torch.zeros(5, 6))
            record += [loss, grad_w, prev]
        return [*record, w, tied]

    out: dict[str, Any] = {}
    for setting in _settings():
        group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        eager = train(functools.partial(pipeline_step, group=group))
        from dynamo_ext import _compat

        patch = {"fx_graph_cache": False, **({} if setting is None else simple_overlap_patch(setting))}
        torch._dynamo.reset()
        compiled_step = torch.compile(pipeline_step, backend="inductor")
        try:
            with _compat.inductor_config().patch(patch):
                compiled = train(functools.partial(compiled_step, group=group))
            err = max((c - e).abs().max().item() for c, e in zip(compiled, eager))
            out[str(setting)] = {"error": None, "max_err": err}
        except Exception as e:
            out[str(setting)] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "max_err": None}
    return out


PARTS = {
    "ring": functools.partial(_against_eager, ring, _ring_args),
    "relay": functools.partial(_against_eager, relay, _ring_args),
    "hoisted": functools.partial(_against_eager, hoisted, _three_args),
    "other_group": functools.partial(_against_eager, bucket_next_to_another_group, _three_args),
    "barrier": functools.partial(_against_eager, barrier_between, _three_args),
    "pipeline": _pipeline,
}


@pytest.fixture(scope="module")
def ranks():
    """Every part of this file, in one launch of 2 ranks."""
    return run_parts_on_ranks(PARTS, nproc=2)


def _check(ranks, part: str, tol: float) -> None:
    for rank, by_setting in enumerate(ranks[part]):
        for setting, r in by_setting.items():
            assert r["error"] is None, f"rank {rank}, simple_overlap {setting}: {r['error']}"
            assert r["max_err"] <= tol, f"rank {rank}, simple_overlap {setting}: compiled vs eager {r['max_err']}"


def test_ring_exchange_then_bucketed_all_reduces_matches_eager(ranks):
    _check(ranks, "ring", 0.0)


def test_an_all_reduce_is_never_moved_across_the_ring(ranks):
    _check(ranks, "relay", 0.0)


def test_a_collective_after_a_bucket_keeps_its_place_on_every_rank(ranks):
    _check(ranks, "hoisted", 1e-6)


def test_a_bucket_next_to_a_stock_collective_on_another_group(ranks):
    _check(ranks, "other_group", 1e-6)


def test_a_barrier_between_bucketable_collectives(ranks):
    _check(ranks, "barrier", 1e-6)


def test_pipeline_loss_gradients_and_parameters_after_3_steps_match_eager(ranks):
    _check(ranks, "pipeline", 1e-5)
