"""A rank answers a peer's check from its history (NOTE [answering a peer's check]), in one process.

The store is a ``HashStore``; "rank 1" is simulated by writing its entries or running its responder.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from dynamo_ext.collective_check import CollectiveMismatchError, CollectiveSignature, exchange
from dynamo_ext.collective_check.exchange import GroupRun, agree, exchange_store, write_entries
from dynamo_ext.collective_check.responder import History, Responder, ask
from dynamo_ext.collective_check.stream import GroupPlan


def _c(line: int) -> CollectiveSignature:
    return CollectiveSignature(
        op="_c10d_functional.all_reduce",
        group="0",
        ranks=(0, 1),
        reduce_op="sum",
        tensors=("float32[4]",),
        args=(),
        phase="forward",
        source=f"train.py:{line}: all_reduce(x)",
    )


def _run(start: int, lines: tuple[int, ...], digest: str) -> GroupRun:
    return GroupRun("0", (0, 1), tuple(_c(n) for n in lines), digest, start)


def _wait_for(store, key: str, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if store.check([key]):
            return True
        time.sleep(0.01)
    return False


def test_a_peer_that_merges_where_this_rank_does_not_is_refused_at_once():
    store = dist.HashStore()
    gkey = exchange._digest("0")  # the group's key in the store, as every rank computes it
    # Rank 1 runs the graph agreed long ago (positions 4-5), its two all-reduces merged into one bucket.
    peer = _run(4, (10, 12), "whole")
    write_entries(exchange_store(store, 0), gkey, peer, 1, merged=True)
    # Rank 0 splits that graph (a rank-dependent graph break): its first graph holds position 4 only.
    start = time.monotonic()
    with pytest.raises(CollectiveMismatchError, match="rank 1 runs a bucket of merged collectives from position 4"):
        agree([_run(4, (10,), "first half")], store=store, epoch=0, rank=0)
    assert time.monotonic() - start < 5
    # Followed where the peer runs the same graph from the same position: merged only where it merges.
    write_entries(exchange_store(store, 1), gkey, peer, 1, merged=False)
    assert agree([peer], store=store, epoch=1, rank=0) == {"0": False}
    write_entries(exchange_store(store, 2), gkey, peer, 1, merged=True)
    assert agree([peer], store=store, epoch=2, rank=0) == {"0": True}


def test_the_responder_answers_from_history_and_waits_for_positions_not_reached(monkeypatch):
    from dynamo_ext import _compat

    monkeypatch.setattr(_compat, "distributed_initialized", lambda: True)
    store = exchange_store(dist.HashStore(), 0)
    history, issued = History(), {"0": 0}
    plan = GroupPlan("0", (0, 1), (_c(10), _c(12)), "whole", bucketed=True)

    def write(gkey, row, first):
        start, plan, merged, _ = row
        write_entries(
            store,
            gkey,
            GroupRun(plan.group, plan.ranks, plan.records, plan.digest, start),
            1,
            first=first,
            merged=merged,
        )

    alive = [True]
    responder = Responder(store, 1, history, issued, write, lambda: alive[0])
    try:
        history.get("0").append((0, plan, True, 1))
        issued["0"] = 2
        ask(store, 1, "g0", "0", 1)  # rank 0 waits at position 1, which rank 1 ran unchecked
        assert _wait_for(store, "g0/e/1/1")
        assert not store.check(["g0/e/0/1"])  # only from the asked position on
        ask(store, 1, "g0", "0", 2)  # not reached yet: answered once rank 1 runs it
        time.sleep(0.3)
        assert not store.check(["g0/e/2/1"])
        history.get("0").append((2, plan, False, 2))
        issued["0"] = 4
        assert _wait_for(store, "g0/e/2/1")
        assert b'"m": false' in store.get("g0/e/2/1")
    finally:
        alive[0] = False
        responder.thread.join(timeout=5)
    assert not responder.thread.is_alive()


def test_an_idle_responder_polls_less_often_in_large_worlds():
    from dynamo_ext.collective_check.responder import idle_poll_s

    assert idle_poll_s(4) == 0.05  # small worlds: a waiting check hears back within 50 ms
    assert idle_poll_s(1000) == 1.0  # about 1,000 polls per second reach the store from the whole world
    assert idle_poll_s(100_000) == 2.0
