"""The order of collectives across process groups (NOTE [order across groups]), in one process.

The store is a ``HashStore``; the peer ("rank 1" or "rank 2") is simulated by
writing its entries, or by answering from a history as its responder would.
Group names stand for groups whose ranks ``_compat.group_ranks`` is patched to
return.  The same cases on real gloo ranks: ``test_collective_check_groups_gloo.py``.
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from dynamo_ext import _compat
from dynamo_ext.collective_check import CollectiveMismatchError, CollectiveSignature, stream
from dynamo_ext.collective_check.exchange import GroupRun, agree, exchange_store, group_key, write_graph
from dynamo_ext.collective_check.responder import HISTORY, History

GROUPS = {"A": (0, 1), "B": (0, 1), "W": (0, 1, 2, 3), "tp0": (0, 1), "tp1": (2, 3), "dp0": (0, 2)}


@pytest.fixture(autouse=True)
def _groups(monkeypatch):
    monkeypatch.setattr(_compat, "group_ranks", lambda name: GROUPS.get(name, ()))


def _c(group: str, line: int = 7) -> CollectiveSignature:
    return CollectiveSignature(
        op="_c10d_functional.all_reduce",
        group=group,
        ranks=GROUPS[group],
        reduce_op="sum",
        tensors=("float32[4]",),
        args=(),
        phase="forward",
        source=f"train.py:{line}: dist.all_reduce(t, group=group)",
    )


def _graph(order: list[str], starts: dict[str, int] | None = None, base=(), digest: str = "g") -> list[GroupRun]:
    """One graph's runs, one all-reduce per entry of ``order`` (a group name), as :func:`stream.group_plans`
    and the check build them."""
    plans = stream.group_plans([_c(g) for g in order], "")
    starts = starts or {}
    return [GroupRun(p.group, p.ranks, p.records, digest, starts.get(p.group, 0), p.crossed, base) for p in plans]


def test_group_plans_count_each_collectives_earlier_collectives_on_other_groups(monkeypatch):
    monkeypatch.setattr(_compat, "global_rank", lambda: 0)
    plans = {p.group: p for p in stream.group_plans([_c("A"), _c("B"), _c("A"), _c("W"), _c("B")], "")}
    assert plans["A"].crossed == ((), (("B", 1),))
    assert plans["B"].crossed == ((("A", 1),), (("A", 2), ("W", 1)))
    assert plans["W"].crossed == ((("A", 2), ("B", 1)),)


def test_two_groups_interleaved_in_another_order_by_a_peer_are_refused_naming_both(monkeypatch):
    monkeypatch.setattr(_compat, "global_rank", lambda: 0)
    store = dist.HashStore()
    write_graph(exchange_store(store, 0), _graph(["B", "A"]), 1)  # rank 1: B then A, each group alike
    with pytest.raises(CollectiveMismatchError) as raised:
        agree(_graph(["A", "B"]), store=store, epoch=0, rank=0)  # rank 0: A then B
    message = str(raised.value)
    assert (
        "the order of groups 'A' (ranks 0, 1) and 'B' (ranks 0, 1) differs between rank 0 and rank 1: before "
        "position 0 of group 'A', rank 0 issued 0 collective(s) on group 'B' and rank 1 1, so rank 1 issues "
        "position 0 of group 'B' before it and rank 0 after it:\n"
        "  rank 0: forward all_reduce(float32[4], sum) on group 'A' (ranks 0, 1) at train.py:7: "
        "dist.all_reduce(t, group=group)\n"
        "  rank 1: forward all_reduce(float32[4], sum) on group 'A' (ranks 0, 1) at train.py:7: "
        "dist.all_reduce(t, group=group)\n"
        "  position 0 of group 'B' on rank 0: forward all_reduce(float32[4], sum) on group 'B' (ranks 0, 1) at "
        "train.py:7"
    ) in message
    assert exchange_store(store, 0).check([f"{group_key('A')}/a"])  # a peer waiting in a check raises too
    # The same order on both ranks agrees; buckets merge (same graph from the same positions).
    write_graph(exchange_store(store, 1), _graph(["A", "B"]), 1)
    assert agree(_graph(["A", "B"]), store=store, epoch=1, rank=0) == {"A": True, "B": True}


def test_positions_left_by_earlier_graphs_are_compared(monkeypatch):
    monkeypatch.setattr(_compat, "global_rank", lambda: 0)
    store = dist.HashStore()
    # rank 1 ran one collective on B before this graph, rank 0 two: B's position 1 is before A's 0 on rank 0 only
    write_graph(exchange_store(store, 0), _graph(["A"], base=(("B", 1),)), 1)
    with pytest.raises(CollectiveMismatchError, match="rank 0 issued 2 collective.s. on group 'B' and rank 1 1"):
        agree(_graph(["A"], base=(("B", 2),)), store=store, epoch=0, rank=0)
    # a position the peer could not rebuild (older than its history) is not compared
    peer = [
        GroupRun(r.group, r.ranks, r.records, r.digest, r.start, r.crossed, r.base, frozenset({"B"}))
        for r in _graph(["A"], base=(("B", 1),))
    ]
    write_graph(exchange_store(store, 1), peer, 1)
    assert agree(_graph(["A"], base=(("B", 2),)), store=store, epoch=1, rank=0) == {"A": True}


def test_only_groups_both_ranks_are_in_are_compared(monkeypatch):
    # A (dp, tp) = (2, 2) mesh: ranks 0 and 2 share dp0 (and the world group W), not their tp groups.
    store = dist.HashStore()
    monkeypatch.setattr(_compat, "global_rank", lambda: 2)
    rank_2 = _graph(["dp0", "tp1"], base=(("W", 3),), digest="rank 2's")  # rank 2: dp, then tp1
    write_graph(exchange_store(store, 0), rank_2, 2)
    monkeypatch.setattr(_compat, "global_rank", lambda: 0)
    # rank 0: tp0 then dp: its dp0 collective comes after one on tp0, rank 2's after none on tp1: no mismatch
    assert agree(
        [r for r in _graph(["tp0", "dp0"], base=(("W", 3),)) if r.group == "dp0"], store=store, epoch=0, rank=0
    ) == {"dp0": False}  # another graph: buckets run apart
    # the world group both use: rank 0 ran one more collective on it before dp0 than rank 2
    with pytest.raises(CollectiveMismatchError, match="the order of groups 'dp0' .ranks 0, 2. and 'W' .ranks 0.3."):
        agree([r for r in _graph(["tp0", "dp0"], base=(("W", 4),)) if r.group == "dp0"], store=store, epoch=0, rank=0)


def test_a_group_the_peer_reaches_later_is_left_undecided(monkeypatch):
    """Rank 1 prints between its all-reduces on A and B: its B graph runs after A's all-reduce, which needs rank
    0; rank 0's one graph waits for rank 1's entry on A only, and leaves B's bucket decision for later."""
    monkeypatch.setattr(_compat, "global_rank", lambda: 0)
    store = dist.HashStore()
    write_graph(exchange_store(store, 0), _graph(["A"], digest="first half"), 1)
    assert agree(_graph(["A", "B"]), store=store, epoch=0, rank=0) == {"A": False, "B": None}
    # with the peer's entry on B at hand, B is decided too (another graph there: its buckets run apart)
    write_graph(exchange_store(store, 1), _graph(["A", "B"], digest="rank 1's"), 1)
    assert agree(_graph(["A", "B"]), store=store, epoch=1, rank=0) == {"A": False, "B": False}


def test_a_pending_bucket_decision_is_taken_where_the_bucket_runs(monkeypatch):
    monkeypatch.setattr(_compat, "global_rank", lambda: 0)
    store = dist.HashStore()
    monkeypatch.setattr(_compat, "default_store", lambda: store)
    state = stream._State(0, store)
    monkeypatch.setattr(stream, "_state", state)
    run_b = _graph(["A", "B"])[1]
    state.pending["B"] = (run_b, (None, "g"))
    state.merge["B"] = stream._PENDING
    rank_1 = _graph(["B"], base=(("A", 1),), digest="second half")  # rank 1's graph after its print
    write_graph(exchange_store(store, 0), rank_1, 1)
    assert stream.merge_decision("B") is False
    assert state.seen[(None, "g")] is False and "B" not in state.pending
    assert stream.merge_decision("B") is False  # decided once


def test_a_responder_answers_with_the_calls_other_groups_and_the_positions_then(monkeypatch):
    monkeypatch.setattr(_compat, "global_rank", lambda: 1)
    history = History()
    a1 = stream.group_plans([_c("A")], "")[0]
    b1 = stream.group_plans([_c("B")], "")[0]
    history.get("A").append((0, a1, False, 1))  # call 1: one all-reduce on A
    history.get("B").append((0, b1, False, 2))  # call 2: one on B
    both = {p.group: p for p in stream.group_plans([_c("A"), _c("B")], "")}
    history.get("A").append((1, both["A"], True, 3))  # call 3: A then B
    history.get("B").append((1, both["B"], False, 3))
    store = exchange_store(dist.HashStore(), 0)
    stream.write_answer(store, 1, history, history.covering("A", 1), 1)  # a peer waits at A's position 1
    a, b = (json.loads(store.get(f"{group_key(g)}/e/1/1")) for g in ("A", "B"))
    assert (a["x"], a["m"], b["x"], b["m"]) == ({"B": 1}, True, {"A": 2}, False)
    assert not store.check([f"{group_key('A')}/e/0/1"])
    # asked at B's position 1 (after A's in the call): A's entry, earlier in the graph, is not written
    store = exchange_store(dist.HashStore(), 1)
    stream.write_answer(store, 1, history, history.covering("B", 1), 1)
    assert json.loads(store.get(f"{group_key('B')}/e/1/1"))["x"] == {"A": 2}
    assert not store.check([f"{group_key('A')}/e/1/1"])


def test_a_position_older_than_the_history_is_unknown(monkeypatch):
    monkeypatch.setattr(_compat, "global_rank", lambda: 1)
    history = History()
    a1 = stream.group_plans([_c("A")], "")[0]
    b1 = stream.group_plans([_c("B")], "")[0]
    for call in range(1, HISTORY + 2):  # A runs at calls 1..17: call 1 is forgotten
        history.get("A").append((call - 1, a1, False, call))
    history.get("B").append((0, b1, False, 0))  # B at call 0, before every A run remembered
    assert history.position_before("A", 1) is None and history.position_before("A", 3) == 2
    store = exchange_store(dist.HashStore(), 0)
    stream.write_answer(store, 1, history, history.covering("B", 0), 0)
    entry = json.loads(store.get(f"{group_key('B')}/e/0/1"))
    assert entry["x"] == {} and entry["u"] == ["A"]
