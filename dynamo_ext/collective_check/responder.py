"""A rank answers, from its recent history, a peer's check that waits for a position this rank ran unchecked.

NOTE [answering a peer's check]
A rank checks a graph only where its context is new on that rank (NOTE [when
the stream is checked]).  A context can be new on some ranks only: a
``print`` on rank 0 every 100 steps splits rank 0's graph at step 100, while
the other ranks run the graph they agreed on long ago, unchecked, and write
nothing.  Rank 0's check would wait for their entries at its first position
and end with a false error after the timeout.

So every rank keeps, per group, its last few compiled runs (their first
position, their collectives, whether their buckets ran merged, and which call
of a compiled graph they belong to: the process counts its calls; a ``deque``
append per call), and a daemon thread, started at the rank's first check in
a process group world, answers requests: a rank whose check waits for a
peer's entry at position ``p`` asks that peer (``q/<peer>/<n>`` in the
store), and the peer's thread writes the entries of its run that covers
``p``, as its own check would have: with the same call's runs on its other
groups (the graph's later collectives first, NOTE [collective stream check]),
and each entry's positions on the other groups (NOTE [order across groups]),
rebuilt from the call's place among the runs remembered on each group.  Collectives block until every rank of
the group takes part, so a peer is never more than one graph ahead of a
position some rank still waits to enter: a short history suffices.  A
position the peer has not reached yet is answered when it gets there (or by
its own check, if its context is new there too).  An answer says whether the
run's buckets ran merged, so the asking rank can follow, or raise where it
cannot (NOTE [buckets only where ranks agree]).

The thread reads the store only (one ``check`` per poll), never a
collective, and never holds the GIL while it waits.  It polls every 50 ms
after a request; while none comes, the interval doubles up to
:func:`idle_poll_s` (50 ms for small worlds, up to 2 s at 4,000 ranks), so the
store serves about 1,000 polls per second from the whole world at most and a
waiting check hears back within that interval.
A rank blocked inside a collective (waiting for the asking rank) still
answers: the process group releases the GIL while it waits.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from .. import _compat

log = logging.getLogger(__name__)

HISTORY = 16
"""Runs remembered per group; more than enough (see the NOTE)."""
_POLL_S = 0.05


def idle_poll_s(world_size: int) -> float:
    """Longest interval between two polls of an idle responder, in seconds, for a world of ``world_size`` ranks."""
    return min(2.0, max(_POLL_S, world_size / 1000))


class _Runs(dict):
    """group -> its last :data:`HISTORY` runs (a deque made on first use)."""

    def __missing__(self, group: str) -> collections.deque[tuple[int, Any, bool, int]]:
        runs = self[group] = collections.deque(maxlen=HISTORY)
        return runs


class History:
    """Per group, this rank's last :data:`HISTORY` compiled runs: ``(first position, plan, merged, call)``.

    ``call`` numbers the calls of compiled graphs in this process: the runs of
    one call on several groups share it.  Appended by the main thread, read by
    the responder's (a deque's copy is taken whole).
    """

    def __init__(self) -> None:
        self.runs: dict[str, collections.deque[tuple[int, Any, bool, int]]] = _Runs()

    def get(self, group: str) -> collections.deque[tuple[int, Any, bool, int]]:
        return self.runs[group]

    def covering(self, group: str, position: int) -> tuple[int, Any, bool, int] | None:
        """The run whose collectives on ``group`` include ``position``, if it is still remembered."""
        for run in list(self.runs.get(group, ())):
            if run[0] <= position < run[0] + len(run[1].records):
                return run
        return None

    def call(self, call: int) -> list[tuple[int, Any, bool, int]]:
        """The runs of call ``call`` on every group (one per group)."""
        return [run for runs in list(self.runs.values()) for run in list(runs) if run[3] == call]

    def position_before(self, group: str, call: int) -> int | None:
        """This rank's stream position on ``group`` when call ``call`` started; ``None`` when older than the history.

        Positions on a group are contiguous: the end of the group's last run
        before the call, else 0 when every run of the group is remembered.
        """
        runs = list(self.runs.get(group, ()))
        before = [run for run in runs if run[3] < call]
        if before:
            return before[-1][0] + len(before[-1][1].records)
        at = [run for run in runs if run[3] == call]
        if at:
            return at[0][0]
        return 0 if len(runs) < HISTORY else None


def request_key(peer: int, n: int | str) -> str:
    return f"q/{peer}/{n}"


def ask(store: Any, peer: int, gkey: str, group: str, position: int) -> None:
    """Ask ``peer`` (its thread) for its entries from ``position`` of ``group`` (``store``: the check's prefix store)."""
    n = store.add(request_key(peer, "n"), 1)
    store.set(request_key(peer, n), json.dumps([gkey, group, position]))


class Responder:
    """The daemon thread of one rank in one process group world (NOTE [answering a peer's check]).

    Args:
        store: the check's prefix store for the current epoch.
        rank: this process's global rank.
        history: the runs to answer from.
        issued: per group, the next stream position this rank will take (read only).
        write: ``write(gkey, run, first)`` writes the entries of ``run`` (a :class:`History` row) from position
            ``first``, with its call's runs on other groups.
        alive: whether this responder's world and epoch are still the current ones.
        world_size: the world's size (sets :func:`idle_poll_s`).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        history: History,
        issued: dict[str, int],
        write: Callable[[str, tuple[int, Any, bool, int], int], None],
        alive: Callable[[], bool],
        world_size: int = 1,
    ) -> None:
        self.store, self.rank, self.history, self.issued = store, rank, history, issued
        self.idle_poll_s = idle_poll_s(world_size)
        self.write, self.alive = write, alive
        self.handled = 0
        self.pending: list[tuple[str, str, int]] = []
        self.thread = threading.Thread(target=self._loop, name=f"dynamo_ext-check-responder-{rank}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        stop = threading.Event()
        interval = _POLL_S
        while self.alive() and _compat.distributed_initialized():
            try:
                busy = self._poll()
            except Exception as e:  # noqa: BLE001  (the store went away with its world: nothing left to answer)
                log.debug("collective check responder on rank %d stops: %s", self.rank, e)
                return
            interval = _POLL_S if busy else min(2 * interval, self.idle_poll_s)
            stop.wait(interval)

    def _poll(self) -> bool:
        """Take new requests and answer what can be answered; True while there are requests."""
        while self.store.check([request_key(self.rank, self.handled + 1)]):
            self.handled += 1
            gkey, group, position = json.loads(self.store.get(request_key(self.rank, self.handled)))
            self.pending.append((gkey, group, position))
        busy = bool(self.pending)
        self.pending = [req for req in self.pending if not self._answer(*req)]
        return busy

    def _answer(self, gkey: str, group: str, position: int) -> bool:
        """Write the entries for ``position``; False while this rank has not reached it."""
        if self.store.check([f"{gkey}/e/{position}/{self.rank}"]):
            return True  # written already (this rank's own check, or an earlier request)
        run = self.history.covering(group, position)
        if run is None:
            if self.issued.get(group, 0) > position:
                log.info(
                    "collective check: rank %d cannot answer for position %d of group %r: older than its history",
                    self.rank,
                    position,
                    group,
                )
                return True
            return False
        self.write(gkey, run, position)
        log.debug("collective check: rank %d answered position %d of group %r", self.rank, position, group)
        return True
