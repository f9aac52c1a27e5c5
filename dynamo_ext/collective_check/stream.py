"""When a compiled graph's collectives are checked, and what this process remembers between checks.

NOTE [when the stream is checked]
A compiled graph is checked (:func:`.exchange.agree`) when it runs in a
*context* this rank has not seen: per process group, the graph that ran last
on the group (its digest: its collectives with shapes, dtypes and issuing
lines, and the data flow between them, :func:`graph_digest`) and this graph,
named by its digest and by its compile.  So a graph is checked at its first
run, and again whenever it follows another graph than before: a graph agreed
once and then run on rank 0 only (the others run something else there) is a
new context on rank 0 and is checked.  Each compile is a context of its own,
even with a digest seen before: a context's bucket decision was taken against
the graphs the peers ran then, and after a new compile (``aot_eager`` then
``inductor``, or after ``torch._dynamo.reset()``) a peer's digest may change
where this rank's does not (docs/collective_check.md, "When a rank checks").
A recompile on one rank only is checked there; its peers answer from their
history (NOTE [answering a peer's check]).  Per call and per
group of the graph, the check costs a dictionary lookup, the count of the
group's positions and an append to the rank's history (NOTE [answering a
peer's check]), plus, per call, the count of calls that numbers those runs;
the positions on other groups that a check compares (NOTE [order across
groups]) are the same counts, read at the check:
``benchmarks/bench_collective_check.py --wrapper-only``.

What a rank cannot see without talking to its peers on every call:

* collectives issued outside compiled graphs (eager ``dist.all_reduce``, a
  graph compiled with ``backend="eager"``) are neither described nor checked;
  a rank blocked inside one is not told apart from a slow rank;
* a divergence between graphs that each already followed the same predecessor
  on their rank (rank 0 runs A after B, rank 1 runs C after B, and both pairs
  were checked before at other positions): no rank checks, the collectives run
  as issued (a hang, or on gloo "Received data size doesn't match"); so too for
  two graphs on one group each whose order changes on one rank after every rank
  ran them (from step 3 rank 1 runs group B's graph before group A's): neither
  context is new;
* a rank whose new graph interleaves two groups otherwise than the graph a peer
  runs unchecked there (a rank-dependent recompile): the checking rank raises
  (the peer's responder answers with its positions on the other groups, NOTE
  [order across groups]); the peer, already inside the collective, ends with
  the process group's timeout or error;
* where a peer's graph boundaries differ, a bucket decision this rank leaves to
  where the bucket runs (:func:`merge_decision`) covers its own buckets only: a
  peer whose later graph merges a bucket on a group where this rank's graph
  has none (possible only where the boundaries changed after the ranks agreed
  on merged buckets there) merges while this rank runs the collectives apart
  (gloo: "Received data size doesn't match"; NCCL: a hang);
* a graph break or data dependency that depends on the rank and appears
  after the others agreed on merged buckets there (Inductor): the ranks that
  see the new context raise at once (NOTE [answering a peer's check]); the
  others wait in the merged collective until the process group fails it;
* a mismatch found at a later position of a graph than its first: the rank
  that writes second raises; the peer, which compared only what it saw, may
  already wait inside the collective and then ends with the process group's
  timeout or error.

NOTE [fake runs are not checked]
A compiled graph may be run on fake tensors at compile time (DDPOptimizer's
submodule compiler runs each compiled submodule to pass fake outputs on):
no collective is issued, so the run has no stream position.  Such a run in a
new context is neither checked nor remembered (its buckets run unmerged, on
fake data); only the test for fake arguments is added to the new-context path.

The bucket decisions (NOTE [buckets only where ranks agree]) are remembered
with the context: each run of a graph sets, per group, whether its buckets run
merged (:func:`merge_decision`), as decided at the check of its context, or,
where that check left it open (a peer's graph boundaries differ), where the
bucket first runs.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed

from .. import _compat, config
from .exchange import GroupRun, agree, exchange_store, write_graph
from .fingerprint import CollectiveSignature
from .order import positions, rebuilt_positions
from .plans import GroupPlan as GroupPlan
from .plans import graph_digest as graph_digest
from .plans import group_plans as group_plans
from .responder import History, Responder

log = logging.getLogger(__name__)


class _Pending:
    """A bucket decision not taken yet (:func:`merge_decision` takes it); false as "not merged"."""

    def __bool__(self) -> bool:
        return False


_PENDING = _Pending()


Context = tuple[str | None, str, int]
"""(digest of the graph that ran last on a group, this graph's digest, its compile: :data:`_compiles`)."""
_compiles = itertools.count()
"""Numbers each compiled graph :func:`checked` wraps (NOTE [when the stream is checked])."""


class _State:
    """This process's stream state, for one default store (one ``init_process_group``)."""

    def __init__(self, epoch: int = 0, store: Any = None) -> None:
        self.epoch = epoch
        self.store = store
        self.last: dict[str, str] = {}
        """group -> digest of the graph that ran last on it."""
        self.seen: dict[Context, bool] = {}
        """(previous digest, digest, compile) -> whether buckets run merged in that context."""
        self.merge: dict[str, bool | _Pending] = {}
        """group -> whether the running graph's buckets on it run merged."""
        self.issued: dict[str, int] = {}
        """group -> collectives of checked compiled graphs this rank has run on it: the next one's stream position."""
        self.direct: dict[str, int] = {}
        """group -> collectives checked by :func:`check_collectives` on it (a stream of their own)."""
        self.merged_away: dict[str, int] = {}
        """group -> collectives merged away by buckets so far (NOTE [where each rank waits])."""
        self.history = History()
        """group -> this rank's last runs on it (NOTE [answering a peer's check])."""
        self.responder: Responder | None = None
        self.started: dict[str, tuple[GroupPlan, int, int]] = {}
        """group -> (the graph that ran last on it, its first position, the group's count of issued collectives
        then); only while positions are tracked."""
        self.calls = 0
        """Calls of checked compiled graphs so far (numbers the history's runs, NOTE [answering a peer's check])."""
        self.pending: dict[str, tuple[GroupRun, Context]] = {}
        """group -> (its run in the running graph, the context) where the bucket decision waits for a peer that
        reaches the group's position only after an earlier collective of the graph (:func:`merge_decision`)."""


_state = _State()
_track = False
"""Whether new wrappers record each run's first position (NOTE [where each rank waits]); off: no cost per call."""


def reset() -> None:
    """Forget every checked context and start a new key space in the store.

    A rank that goes on after a :class:`~dynamo_ext.CollectiveMismatchError`
    (a test, a retry) calls this on every rank of the world before its next
    compiled graph, as it would call ``torch._dynamo.reset()``: the ranks that
    failed may have stopped at different positions.
    """
    global _state
    _state = _State(_state.epoch + 1, _state.store)


def merge_decision(group: str) -> bool:
    """Whether the running graph's collective buckets on ``group`` run merged (False when no check decided).

    Called where a bucket runs.  Where the graph's check could not decide for
    ``group`` (a peer's graph boundaries differ: it reaches the group's position
    only after an earlier collective of this graph, NOTE [collective stream
    check]), decides now, when this rank has issued those: waits for every
    peer's entry at the group's position, as a check would.

    Raises:
        CollectiveMismatchError: from :func:`.exchange.agree`.
    """
    decided = _state.merge.get(group, False)
    if isinstance(decided, _Pending):
        return _decide_pending(_state, group)
    return decided


def _decide_pending(state: _State, group: str) -> bool:
    run, context = state.pending.pop(group)
    store, rank = _compat.default_store(), _compat.global_rank()
    decided = False
    if store is state.store and rank is not None:
        decided = bool(agree([run], store=store, epoch=state.epoch, rank=rank).get(group))
    state.seen[context] = state.merge[group] = decided
    runs = state.history.runs[group]
    if runs and runs[-1][0] == run.start:
        start, plan, _, call = runs[-1]
        runs[-1] = (start, plan, plan.bucketed and decided, call)
    log.debug("collective buckets on group %r run %s (decided where they run)", group, "merged" if decided else "apart")
    return decided


def count_merged_away(group: str, count: int) -> None:
    """Record that a merged bucket issued one collective for ``count + 1`` on ``group``."""
    _state.merged_away[group] = _state.merged_away.get(group, 0) + count


def _check(plans: Sequence[GroupPlan], state: _State, compile_id: int) -> None:
    """Check the plans whose context is new (NOTE [when the stream is checked]); record the decisions."""
    if not config.collective_check:
        return  # nothing remembered: the buckets run as separate collectives
    store = _compat.default_store()
    rank = _compat.global_rank()
    if store is None or rank is None:
        log.debug("collective check skipped: no default store")
        return
    _in_world(state, store)
    runs, contexts = [], {}
    base = positions(state.issued)
    for p in plans:
        context = (state.last.get(p.group), p.digest, compile_id)
        if context in state.seen:
            continue
        contexts[p.group] = context
        if _compat.group_is_fake(p.group):
            state.seen[context] = True  # one process: no peer to disagree with
            continue
        runs.append(GroupRun(p.group, p.ranks, p.records, p.digest, state.issued.get(p.group, 0), p.crossed, base))
    if runs:
        _start_responder(state, store, rank)
        decided = agree(runs, store=store, epoch=state.epoch, rank=rank)
        bucketed = {p.group for p in plans if p.bucketed}
        for run in runs:
            merge = decided.get(run.group)
            state.pending.pop(run.group, None)  # an earlier run's, left open where its graph raised
            if merge is None and run.group in bucketed:
                state.pending[run.group] = (run, contexts[run.group])  # decided where the bucket runs
                continue
            state.seen[contexts[run.group]] = bool(merge)
            if not merge:
                log.debug("collective buckets on group %r run unmerged: the ranks' graphs differ here", run.group)


def _in_world(state: _State, store: Any) -> None:
    """Start ``state`` afresh (same epoch) where ``store`` is not the default store it was made for (a new world,
    or the first check in this process); a tracked run calls it before its record, which this would drop."""
    if state.store is not store:
        state.__init__(state.epoch, store)


def _start_responder(state: _State, store: Any, rank: int) -> None:
    """Answer peers' checks from this rank's history (NOTE [answering a peer's check]), once per world and epoch."""
    if state.responder is not None:
        return
    prefixed = exchange_store(store, state.epoch)

    def write(gkey: str, row: tuple[int, GroupPlan, bool, int], first: int) -> None:
        write_answer(prefixed, rank, state.history, row, first)

    world_size = torch.distributed.get_world_size()
    state.responder = Responder(prefixed, rank, state.history, state.issued, write, lambda: _state is state, world_size)


def write_answer(store: Any, rank: int, history: History, row: tuple[int, GroupPlan, bool, int], first: int) -> None:
    """Write the entries of ``row`` (a :class:`.responder.History` run) from position ``first`` on, for a peer's
    check: with the same call's runs on the other groups, each entry with this rank's positions on its other
    groups then (NOTE [answering a peer's check], NOTE [order across groups])."""
    siblings = history.call(row[3]) or [row]
    base, lost = rebuilt_positions(history, row[3])
    runs = [GroupRun(p.group, p.ranks, p.records, p.digest, s, p.crossed, base, lost) for s, p, _, _ in siblings]
    merged = {p.group: bool(m) for _, p, m, _ in siblings}
    write_graph(store, runs, rank, first=(row[1].group, first), merged=merged)


def checked(compiled: Callable[..., Any], plans: Sequence[GroupPlan]) -> Callable[..., Any]:
    """``compiled``, checked on each call whose context is new (NOTE [when the stream is checked]).

    Keeps ``compiled``'s calling convention (``_boxed_call``).

    Raises (from the returned callable):
        CollectiveMismatchError: from :func:`.exchange.agree`.
    """
    plans, compile_id = tuple(plans), next(_compiles)
    one = len(plans) == 1
    inner = (_checked_one_group if one else _checked_groups)(compiled, plans, compile_id)
    return _tracked(inner, compiled, plans) if _track else inner


def _checked_groups(compiled: Callable[..., Any], plans: tuple[GroupPlan, ...], compile_id: int) -> Callable[..., Any]:
    """:func:`checked` for a graph on several groups: every new context checked in one exchange."""

    def run(*args: Any, **kwargs: Any) -> Any:
        state = _state
        seen, last, merge = state.seen, state.last, state.merge
        for p in plans:
            decided = seen.get((last.get(p.group), p.digest, compile_id))
            if decided is None:
                if _compat.has_fake_tensor(args):
                    return compiled(*args, **kwargs)  # NOTE [fake runs are not checked]
                state = _decide(plans, state, compile_id)
                last, merge = state.last, state.merge
                break
            merge[p.group] = decided
        issued, history = state.issued, state.history.runs
        call = state.calls = state.calls + 1
        for p in plans:
            last[p.group] = p.digest
            start = issued.get(p.group, 0)
            issued[p.group] = start + len(p.records)
            history[p.group].append((start, p, p.bucketed and merge[p.group] is True, call))
        return compiled(*args, **kwargs)

    return _like(run, compiled)


def _decide(plans: tuple[GroupPlan, ...], state: _State, compile_id: int) -> _State:
    """Check the graph's new contexts and set each group's bucket decision for this run; the current state."""
    _check(plans, state, compile_id)
    state = _state
    for p in plans:
        decided = state.seen.get((state.last.get(p.group), p.digest, compile_id))
        if decided is None:
            decided = _PENDING if p.group in state.pending else False
        state.merge[p.group] = decided
    return state


def _checked_one_group(
    compiled: Callable[..., Any], plans: tuple[GroupPlan, ...], compile_id: int
) -> Callable[..., Any]:
    """:func:`checked` for a graph on one group (the common case), with fewer steps per call."""
    plan = plans[0]
    group, digest, count, bucketed = plan.group, plan.digest, len(plan.records), plan.bucketed

    def run(*args: Any, **kwargs: Any) -> Any:
        state = _state
        last = state.last
        decided = state.seen.get((last.get(group), digest, compile_id))
        if decided is None:
            if _compat.has_fake_tensor(args):
                return compiled(*args, **kwargs)  # NOTE [fake runs are not checked]
            _check(plans, state, compile_id)
            state = _state
            last = state.last
            decided = state.seen.get((last.get(group), digest, compile_id), False)
        state.merge[group] = decided
        last[group] = digest
        issued = state.issued
        start = issued.get(group, 0)
        issued[group] = start + count
        call = state.calls = state.calls + 1
        state.history.runs[group].append((start, plan, bucketed and decided, call))
        return compiled(*args, **kwargs)

    return _like(run, compiled)


def _tracked(
    inner: Callable[..., Any], compiled: Callable[..., Any], plans: tuple[GroupPlan, ...]
) -> Callable[..., Any]:
    """``inner`` (a checked ``compiled``) that also records where each run starts on each group
    (NOTE [where each rank waits])."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if _compat.has_fake_tensor(args):
            return inner(*args, **kwargs)
        store = _compat.default_store()
        if store is not None:
            _in_world(_state, store)  # before the record: the run's check (its first in the world) keeps it
        for p in plans:
            seq = _compat.group_sequence_number(p.group)
            if seq is not None:
                count = seq + _state.merged_away.get(p.group, 0)
                _state.started[p.group] = (p, _state.issued.get(p.group, 0), count)
        return inner(*args, **kwargs)

    return _like(run, compiled)


def track_positions(on: bool = True) -> None:
    """Record, from now on, where each checked compiled graph starts on each group (NOTE [where each rank waits]).

    Costs one read of each group's collective count per call of graphs compiled
    while on; the audit switches it on for the ranks it runs.
    """
    global _track
    _track = on


def in_flight() -> list[dict[str, Any]]:
    """Per group a tracked graph ran on: the collective this rank entered last and its stream position.

    NOTE [where each rank waits]
    A rank blocked in a compiled graph's collective shows only the compiled
    code's frames (and a resumed function's line, not the collective's).  With
    positions tracked, each group's count of issued collectives tells which of
    the last graph's collectives was entered last: position ``count - 1``.
    Returned rows (JSON-able): ``group``, ``position`` (the stream position of
    the last compiled collective entered, -1 for none; eager collectives take
    none), ``collective`` (its description, ``""`` when the last collective
    entered was not one of the graph's, e.g. an eager one after it), ``source``
    (its line), ``in_graph`` (whether that collective is one of the last
    graph's: a rank whose stack is inside the graph waits in it).  Safe to call
    from another thread.
    """
    rows = []
    for group, (plan, start, count) in list(_state.started.items()):
        seq = _compat.group_sequence_number(group)
        if seq is None:
            continue
        k = seq + _state.merged_away.get(group, 0) - count
        inside = 0 < k <= len(plan.records)
        c = plan.records[k - 1] if inside else None
        rows.append(
            {
                "group": group,
                # eager collectives after the graph take no stream position: the graph's last one stays the last
                "position": start + min(max(k, 0), len(plan.records)) - 1,
                "collective": c.describe() if c is not None else "",
                "source": c.source if c is not None else "",
                "in_graph": inside,
            }
        )
    return rows


def _like(run: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
    # what AOTAutograd's cache reads from a compiled backward (its FX graph cache key: else no entry is saved)
    run.__dict__.update(_compat.compiled_graph_attributes(compiled))
    run.__name__ = getattr(compiled, "__name__", "compiled")
    run.__wrapped__ = compiled  # type: ignore[attr-defined]
    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


def check_collectives(records: Sequence[CollectiveSignature]) -> None:
    """Check ``records``, which this rank issues next, against the peers' at the same stream positions, now.

    For code that issues collectives outside a checked compiled graph (a traced
    step run as is): its positions are counted apart from the compiled graphs',
    per group, from the collectives checked by this function before, and its
    entries live apart from theirs (they take no part in bucket decisions).
    Returns at once without a group with another rank, with the check off, or
    on a fake group.

    Raises:
        CollectiveMismatchError: from :func:`.exchange.agree`.
    """
    store, rank = _compat.default_store(), _compat.global_rank()
    if not config.collective_check or store is None or rank is None:
        return
    _in_world(_state, store)
    runs = []
    base = positions(_state.direct)
    for p in group_plans(records, ""):
        if _compat.group_is_fake(p.group):
            continue
        runs.append(GroupRun(p.group, p.ranks, p.records, p.digest, _state.direct.get(p.group, 0), p.crossed, base))
    for r in runs:
        _state.direct[r.group] = r.start + len(r.records)
    if runs:
        agree(runs, store=store, epoch=f"{_state.epoch}/direct", rank=rank)
