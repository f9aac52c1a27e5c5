"""Compare a graph's collective fingerprint across ranks through the c10d store, with a bounded wait.

NOTE [collective check meeting point]
Ranks meet in the default group's store (set/check/get only: no collective,
so the check cannot itself hang on a rank that never comes), under keys that
need no agreement on compile order:

* a graph meets once per process group its collectives use, with that group's
  ranks (names of groups are the same on every rank).  A rank of a 2-D mesh
  meets its tensor-parallel peers in the ``tp`` group's meeting and its
  data-parallel peers in the ``dp`` group's: no single set of ranks would do,
  since rank 0's groups span ranks {0, 1, 2} and rank 1's {0, 1, 3};
* a rank numbers the fingerprints it has not seen agreed before, per group:
  the n-th new fingerprint first run on group G meets under ``G/n``.  A graph
  compiled again on one rank only (a recompile, a cache miss) with the same
  collectives was agreed already and meets no one, so ranks do not drift apart.

Each rank writes its whole fingerprint under ``e/G/n/<rank>`` for each of its
groups G and reads every other member's, then compares the whole sequences
(:func:`.fingerprint.first_difference`).  While it waits it also watches for:

* a peer that aborted one of these meetings (``a/G/n``: it found a mismatch, or
  timed out): this rank raises too, with the peer's message;
* a peer waiting in a meeting of a group holding this rank that this rank has
  not joined (``w/<rank>``): the two wait on each other, so they run different
  collectives (another group, another order).

Only when a peer never comes (it runs no compiled graph with collectives
there, it died) does the wait last ``config.collective_check_timeout_s``, or
the default group's timeout (``init_process_group(timeout=...)``, which the
store carries) when that is shorter: no longer than a collective would wait.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from .. import _compat, config
from ..errors import CollectiveMismatchError
from .fingerprint import Collective, first_difference

log = logging.getLogger(__name__)

_PREFIX = "dynamo_ext/collective_check/"


class _State:
    """What this process has agreed with its peers, for one default store."""

    def __init__(self, store: Any, epoch: int = 0) -> None:
        self.store = store
        self.epoch = epoch
        self.next_index: dict[str, int] = {}
        self.agreed: set[str] = set()
        self.joined: set[str] = set()


_state: _State | None = None


def _current_state(store: Any) -> _State:
    global _state
    if _state is None or _state.store is not store:
        _state = _State(store)
    return _state


def reset() -> None:
    """Forget what was agreed and start numbering meetings afresh, in a new key space.

    A rank that goes on after a :class:`CollectiveMismatchError` (a test, a
    retry) calls this on every rank of the world before its next compiled
    graph, as it would call ``torch._dynamo.reset()``: the ranks that failed
    may have stopped at different meetings.
    """
    global _state
    if _state is not None:
        _state = _State(_state.store, _state.epoch + 1)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def check_collectives(records: Sequence[Collective]) -> None:
    """Agree ``records`` (one compiled graph's forward and backward collectives) with the other ranks.

    Returns at once when there is nothing to agree (no collectives, no
    initialized default group, one rank, a fake group, the check switched off
    in :mod:`dynamo_ext.config`, or a fingerprint agreed before).

    Raises:
        CollectiveMismatchError: another rank of the scope runs different
            collectives here, aborted this meeting, or did not come within
            ``config.collective_check_timeout_s`` seconds.
    """
    if not records or not config.collective_check:
        return
    rank = _compat.global_rank()
    groups: dict[str, tuple[int, ...]] = {}
    for c in records:
        if c.group and len(c.ranks) > 1 and rank in c.ranks:
            groups.setdefault(c.group, c.ranks)
    if rank is None or not groups:
        log.debug("collective check: no group with another rank in this graph, nothing to agree")
        return
    if any(_compat.group_is_fake(g) for g in groups):
        log.debug("collective check skipped: fake process group (one process, no peer to meet)")
        return
    store = _compat.default_store()
    if store is None:
        log.debug("collective check skipped: no default store")
        return
    state = _current_state(store)
    payload = json.dumps([c.to_json() for c in records])
    own = _digest(json.dumps([c.to_json()[:-1] for c in records]))  # without source lines
    if own in state.agreed:
        log.debug("collective check: these %d collectives were agreed before, no meeting", len(records))
        return
    meetings = {}
    for group, ranks in sorted(groups.items()):
        key = _digest(group)
        index = state.next_index.get(key, 0)
        state.next_index[key] = index + 1
        meetings[f"{state.epoch}/{key}/{index}"] = ranks
    _Meeting(state, meetings, rank, list(records), payload).run()
    state.agreed.add(own)


class _Meeting:
    """One graph's meetings, one per group (NOTE [collective check meeting point])."""

    def __init__(
        self, state: _State, meetings: dict[str, tuple[int, ...]], rank: int, records: list[Collective], payload: str
    ) -> None:
        self.state, self.meetings, self.rank = state, meetings, rank
        self.records, self.payload = records, payload
        self.store = _compat.prefix_store(_PREFIX, state.store)
        self.scope = tuple(sorted({r for ranks in meetings.values() for r in ranks}))
        # No longer than the collective itself would wait: the store's timeout is init_process_group's.
        store_timeout = getattr(getattr(state.store, "timeout", None), "total_seconds", lambda: float("inf"))()
        self.timeout_s = min(config.collective_check_timeout_s, store_timeout)
        self.peer_meetings: set[str] = set()

    def run(self) -> None:
        store, rank = self.store, self.rank
        for meeting in self.meetings:
            store.set(f"e/{meeting}/{rank}", self.payload)
            self.state.joined.add(meeting)
        store.set(f"w/{rank}", json.dumps([[m, list(r)] for m, r in self.meetings.items()]))
        start = time.monotonic()
        try:
            self._wait(start)
        except CollectiveMismatchError as e:
            # Stop these meetings and those of the peers found waiting elsewhere: their fellows end too.
            for meeting in {*self.meetings, *self.peer_meetings}:
                store.set(f"a/{meeting}", f"rank {rank}: {e}")
            raise
        finally:
            store.set(f"w/{rank}", "")
        log.debug(
            "collective check on rank %d: ranks %s agree after %.3f s",
            rank,
            _ranks(self.scope),
            time.monotonic() - start,
        )

    def _wait(self, start: float) -> None:
        store = self.store
        pending = {(m, p) for m, ranks in self.meetings.items() for p in ranks if p != self.rank}
        compared: set[int] = set()
        differences: list[str] = []
        sleep = 0.0002
        while pending:
            for meeting, peer in sorted(pending):
                key = f"e/{meeting}/{peer}"
                if store.check([key]):
                    pending.discard((meeting, peer))
                    if peer in compared:
                        continue
                    compared.add(peer)
                    theirs = [Collective.from_json(r) for r in json.loads(store.get(key))]
                    diff = self._compare(peer, theirs)
                    if diff:
                        differences.append(diff)
            if differences:
                raise CollectiveMismatchError(self._message(differences))
            if not pending:
                return
            for meeting in self.meetings:
                if store.check([f"a/{meeting}"]):
                    raise CollectiveMismatchError(
                        f"{self._head()} another rank stopped it: {store.get(f'a/{meeting}').decode()}"
                    )
            for peer in sorted({p for _, p in pending}):
                elsewhere = self._waiting_elsewhere(peer)
                if elsewhere is not None:
                    differences.append(elsewhere)
            if differences:
                raise CollectiveMismatchError(self._message(differences))
            if time.monotonic() - start > self.timeout_s:
                late = ", ".join(map(str, sorted({p for _, p in pending})))
                raise CollectiveMismatchError(
                    f"{self._head()} rank(s) {late} did not reach a compiled graph with "
                    f"these collectives within {self.timeout_s:g} s (dynamo_ext.config.collective_check_timeout_s, "
                    f"or the process group's timeout if shorter); they run other code here (eager collectives, a graph without "
                    f"collectives, another branch), or compile for longer than that. This rank's collectives:\n"
                    + "\n".join(
                        f"  #{i}: {c.describe()} at {c.source or '<unknown source>'}"
                        for i, c in enumerate(self.records)
                    )
                )
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.002)  # a peer that arrives is seen within 2 ms (compile time counts)

    def _waiting_elsewhere(self, peer: int) -> str | None:
        """A difference when ``peer`` waits in a meeting of a group holding this rank, which this rank never joined."""
        key = f"w/{peer}"
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        if not raw:
            return None
        for meeting, scope in json.loads(raw):
            same_epoch = meeting.startswith(f"{self.state.epoch}/")
            if meeting in self.meetings or not same_epoch or self.rank not in scope or meeting in self.state.joined:
                continue
            self.peer_meetings.add(meeting)
            theirs = [Collective.from_json(r) for r in json.loads(self.store.get(f"e/{meeting}/{peer}"))]
            return self._compare(peer, theirs, other_scope=tuple(scope))
        return None

    def _compare(self, peer: int, theirs: list[Collective], other_scope: tuple[int, ...] | None = None) -> str | None:
        i = first_difference(self.records, theirs, self.rank, peer)
        if i is None:
            if other_scope is None:
                return None
            return (
                f"rank {peer} waits for this rank at another graph with the same collectives: the ranks run "
                f"their compiled graphs in different orders"
            )
        mine = self.records[i] if i < len(self.records) else None
        their = theirs[i] if i < len(theirs) else None
        where = f" (rank {peer} waits for this rank at a graph on ranks {_ranks(other_scope)})" if other_scope else ""
        return (
            f"collective #{i} differs between rank {self.rank} and rank {peer}{where}:\n"
            f"  rank {self.rank}: {_line(mine)}\n"
            f"  rank {peer}: {_line(their)}"
        )

    def _head(self) -> str:
        return f"collective check of a compiled graph on rank {self.rank} (ranks {_ranks(self.scope)}):"

    def _message(self, differences: list[str]) -> str:
        return (
            f"{self._head()} ranks compiled graphs that issue different collectives; running them would hang "
            f"or exchange wrong data.\n" + "\n".join(differences[:4]) + "\nMake every rank run the same collectives "
            "in the same order (a branch on the rank, or rank-dependent shapes, around a collective), or set "
            "DYNAMO_EXT_COLLECTIVE_CHECK=0 to skip this check."
        )


def _ranks(scope: Sequence[int] | None) -> str:
    scope = list(scope or ())
    if len(scope) > 1 and scope == list(range(scope[0], scope[-1] + 1)):
        return f"{scope[0]}-{scope[-1]}"
    return ",".join(map(str, scope))


def _line(c: Collective | None) -> str:
    if c is None:
        return "no collective (its graph ends here)"
    return f"{c.describe()} at {c.source or '<unknown source>'}"
