"""Compare a compiled graph's collectives with the other ranks' at the same stream positions, through the c10d store.

NOTE [collective stream check]
Ranks agree on the *stream* of collectives each process group sees, in issue
order, not on graphs: graph boundaries may differ per rank (a ``print`` on rank
0 only splits its graph in two where rank 1 has one).  Each rank numbers, per
group, the collectives of the checked compiled graphs it runs (their count so
far is the next one's position, :mod:`.stream`), so when a graph runs, its
collectives on group G occupy positions ``s, s+1, ...`` where ``s`` is the
number of compiled collectives this rank ran on G before: a position every rank
computes locally, without talking to its peers.  A bucket of collectives
merged into one (NOTE [buckets only where ranks agree]) keeps its members'
positions.  The stream holds the compiled graphs' collectives only, not
point-to-point ops (their peers differ per rank by design) nor collectives
issued outside compiled graphs: the process group's own count
(``_get_sequence_number_for_group()``) would include both, and a ``send`` on
some ranks only would then shift every later position on them.

At a check (:func:`agree`) a rank writes one entry per position of its graph
under ``<epoch>/<group>/e/<position>/<rank>`` in the default group's store (the
graph's later positions first, its first position last, so a peer that sees
the first sees them all), then waits, bounded, for every peer of the group to
have written the *first* position, and compares each position where the peer
has written an entry.  A peer that has not written a later position yet writes
it after this rank did, and compares it then: every position two ranks both
reach in a check is compared by at least one of them.  Waiting for every
position would deadlock correct programs: with ``all_reduce(a); if rank == 0:
print(); all_reduce(b)``, rank 1's one graph covers positions 0 and 1, but rank
0's second graph (position 1) runs only after the all-reduce at position 0
completes, which needs rank 1.

A mismatch ends the check with :class:`CollectiveMismatchError` naming the
group, the position and each rank's collective and line; the rank writes the
group's abort key (``<epoch>/<group>/a``), so a peer waiting in a check of that
group raises too, and every later check of the group raises at once (call
:func:`.stream.reset` on every rank to go on).  While it waits, a rank also
publishes where it waits (``w/<rank>``); a peer that waits in another group
for this rank at a position this rank has not written cannot be satisfied (the
two wait for each other: another group, another order), which is a mismatch
too.  Only a peer that never writes the position (it issues eager collectives
there, or runs, unchecked, a graph it ran before in the same context; it died)
makes the wait last ``config.collective_check_timeout_s``, or the default
group's timeout when that is shorter, and then it is an error too.

The store is reached with set/check/get only, never a collective, so the check
cannot itself hang on a rank that never comes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from .. import _compat, config
from ..errors import CollectiveMismatchError
from ..rank_ranges import format_ranks
from .fingerprint import CollectiveSignature, same_collective
from .responder import ask

log = logging.getLogger(__name__)

_PREFIX = "dynamo_ext/collective_check/"


@dataclasses.dataclass(frozen=True)
class GroupRun:
    """One run of a compiled graph, as seen by one process group.

    Attributes:
        group: the group's name.
        ranks: the group's global ranks, sorted.
        records: the graph's collectives on this group, in issue order.
        digest: the graph's collectives and data flow (:func:`.stream.graph_digest`); equal on
            ranks that compiled the same collectives with the same data flow between them.
        start: the stream position of ``records[0]`` on this group.
    """

    group: str
    ranks: tuple[int, ...]
    records: tuple[CollectiveSignature, ...]
    digest: str
    start: int


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def agree(runs: Sequence[GroupRun], *, store: Any, epoch: int | str, rank: int) -> dict[str, bool]:
    """Compare ``runs`` with every peer's entries at the same positions (NOTE [collective stream check]).

    Returns, per group, whether every peer's entry at the run's first position
    starts a graph with the same digest: every rank of the group then runs the
    same collectives with the same data flow from there (what bucketing needs,
    NOTE [buckets only where ranks agree]).  Every rank of the group reads the
    same entries at that position, so they all return the same answer.

    Raises:
        CollectiveMismatchError: a peer's collective at a compared position
            differs, a peer aborted one of these groups, a peer waits for this
            rank elsewhere, or a peer did not write the first position within
            the timeout.
    """
    return _Check(runs, store, epoch, rank).run()


class _Check:
    def __init__(self, runs: Sequence[GroupRun], store: Any, epoch: int | str, rank: int) -> None:
        self.runs, self.rank = list(runs), rank
        self.store = exchange_store(store, epoch)
        self.gkey = {r.group: _digest(r.group) for r in self.runs}
        store_timeout = getattr(getattr(store, "timeout", None), "total_seconds", lambda: float("inf"))()
        # No longer than a collective itself would wait: the store's timeout is init_process_group's.
        self.timeout_s = min(config.collective_check_timeout_s, store_timeout)
        self.peer_groups: set[str] = set()

    def _entry_key(self, gkey: str, position: int, rank: int) -> str:
        return f"{gkey}/e/{position}/{rank}"

    def run(self) -> dict[str, bool]:
        store, rank = self.store, self.rank
        for r in self.runs:
            self._raise_if_aborted(r)
        for r in self.runs:
            write_entries(store, self.gkey[r.group], r, rank)
        store.set(f"w/{rank}", json.dumps([[self.gkey[r.group], r.start, list(r.ranks), r.group] for r in self.runs]))
        start = time.monotonic()
        try:
            firsts = self._wait_for_first_positions(start)
            differences = [d for r in self.runs for d in self._compare(r, firsts)]
            if differences:
                raise CollectiveMismatchError(self._message(differences))
        except CollectiveMismatchError as e:
            for gkey in {*self.gkey.values(), *self.peer_groups}:
                store.set(f"{gkey}/a", f"rank {rank}: {e}")
            raise
        finally:
            store.set(f"w/{rank}", "")
        log.debug("collective stream check on rank %d: peers agree after %.3f s", rank, time.monotonic() - start)
        return {r.group: self._merge(r, firsts) for r in self.runs}

    def _merge(self, r: GroupRun, firsts: dict[tuple[str, int], dict[str, Any]]) -> bool:
        """Whether ``r``'s buckets run merged: every peer starts the same graph here, and merges where it decided.

        An entry a peer's responder wrote (NOTE [answering a peer's check]) says
        how that peer runs its buckets, decided at an earlier check: a peer that
        merges where this rank's graph differs cannot be followed.
        """
        merge = True
        for peer in r.ranks:
            if peer == self.rank:
                continue
            entry = firsts[(r.group, peer)]
            same = entry["s"] == r.start and entry["g"] == r.digest
            if entry.get("m") and not same:
                message = self._message(
                    [
                        f"rank {peer} runs a bucket of merged collectives from position {entry['s']} of group "
                        f"{r.group!r} (agreed when every rank ran that graph), while rank {self.rank}'s graphs "
                        f"there differ (a graph break or data dependency that depends on the rank and appeared "
                        f"after the buckets were agreed); set dynamo_ext.inductor_lowerings.options."
                        f"bucket_all_reduces and bucket_all_gathers_reduce_scatters to False, or keep rank-dependent "
                        f"code out of compiled regions"
                    ]
                )
                self.store.set(f"{self.gkey[r.group]}/a", f"rank {self.rank}: {message}")
                raise CollectiveMismatchError(message)
            merge = merge and same and entry.get("m", True)
        return merge

    def _raise_if_aborted(self, r: GroupRun) -> None:
        key = f"{self.gkey[r.group]}/a"
        if self.store.check([key]):
            raise CollectiveMismatchError(
                f"{self._head(r)} another rank stopped the check of this group: {self.store.get(key).decode()}"
            )

    def _wait_for_first_positions(self, start: float) -> dict[tuple[str, int], dict[str, Any]]:
        store = self.store
        pending = {(r.group, p) for r in self.runs for p in r.ranks if p != self.rank}
        by_group = {r.group: r for r in self.runs}
        firsts: dict[tuple[str, int], dict[str, Any]] = {}
        sleep = 0.0002
        asked: set[tuple[str, int]] = set()
        while True:
            for group, peer in sorted(pending):
                key = self._entry_key(self.gkey[group], by_group[group].start, peer)
                if store.check([key]):
                    firsts[(group, peer)] = json.loads(store.get(key))
                    pending.discard((group, peer))
            if not pending:
                return firsts
            for group, peer in sorted(pending - asked):  # NOTE [answering a peer's check]
                ask(store, peer, self.gkey[group], group, by_group[group].start)
                asked.add((group, peer))
            for r in self.runs:
                self._raise_if_aborted(r)
            elsewhere = [d for peer in sorted({p for _, p in pending}) if (d := self._waiting_elsewhere(peer))]
            if elsewhere:
                raise CollectiveMismatchError(self._message(elsewhere))
            if time.monotonic() - start > self.timeout_s:
                raise CollectiveMismatchError(self._late_message(pending, by_group))
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.002)  # a peer that arrives is seen within 2 ms (compile time counts)

    def _compare(self, r: GroupRun, firsts: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
        out = []
        gkey = self.gkey[r.group]
        for peer in r.ranks:
            if peer == self.rank:
                continue
            for i, mine in enumerate(r.records):
                if i == 0:
                    entry = firsts[(r.group, peer)]
                else:
                    key = self._entry_key(gkey, r.start + i, peer)
                    if not self.store.check([key]):
                        break  # the peer writes this position after this rank: it compares it then
                    entry = json.loads(self.store.get(key))
                theirs = CollectiveSignature.from_json(entry["c"])
                if not same_collective(mine, theirs, self.rank, peer):
                    out.append(self._difference(r, r.start + i, peer, mine, theirs))
                    break
        return out

    def _waiting_elsewhere(self, peer: int) -> str | None:
        """A difference when ``peer`` waits for this rank at a group position this rank has not written."""
        key = f"w/{peer}"
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        if not raw:
            return None
        for gkey, position, scope, group in json.loads(raw):
            if self.rank not in scope or self.store.check([self._entry_key(gkey, position, self.rank)]):
                continue
            self.peer_groups.add(gkey)
            theirs = CollectiveSignature.from_json(
                json.loads(self.store.get(self._entry_key(gkey, position, peer)))["c"]
            )
            mine = ", ".join(
                f"position {r.start} of group {r.group!r} (ranks {format_ranks(r.ranks)})" for r in self.runs
            )
            return (
                f"the stream differs between rank {self.rank} and rank {peer}: "
                f"rank {peer} waits for rank {self.rank} at position {position} of group {group!r} "
                f"(ranks {format_ranks(scope or ())}) with {_line(theirs)}, while rank {self.rank} waits at {mine}: "
                f"the ranks issue their collectives in different orders or on different groups"
            )
        return None

    def _difference(
        self, r: GroupRun, position: int, peer: int, mine: CollectiveSignature, theirs: CollectiveSignature
    ) -> str:
        return (
            f"position {position} of group {r.group!r} (ranks {format_ranks(r.ranks)}) differs between rank "
            f"{self.rank} and rank {peer}:\n  rank {self.rank}: {_line(mine)}\n  rank {peer}: {_line(theirs)}"
        )

    def _head(self, r: GroupRun | None = None) -> str:
        where = f" at position {r.start} of group {r.group!r} (ranks {format_ranks(r.ranks)})" if r is not None else ""
        return f"collective check of a compiled graph on rank {self.rank}{where}:"

    def _message(self, differences: list[str]) -> str:
        return (
            f"{self._head()} the ranks' collective streams differ; running on would hang or exchange "
            "wrong data.\n" + "\n".join(differences[:4]) + "\nMake every rank issue the same collectives in "
            "the same order (a branch on the rank, or rank-dependent shapes, around a collective), or set "
            "DYNAMO_EXT_COLLECTIVE_CHECK=0 to skip this check."
        )

    def _late_message(self, pending: set[tuple[str, int]], by_group: dict[str, GroupRun]) -> str:
        parts = []
        for group in sorted({g for g, _ in pending}):
            r = by_group[group]
            late = format_ranks(p for g, p in pending if g == group)
            parts.append(
                f"rank(s) {late} did not reach position {r.start} of group {group!r} (ranks {format_ranks(r.ranks)}) in a "
                f"checked compiled graph within {self.timeout_s:g} s"
            )
        mine = "\n".join(
            f"  position {r.start + i} of group {r.group!r}: {_line(c)}"
            for r in self.runs
            for i, c in enumerate(r.records)
        )
        return (
            f"{self._head()} " + "; ".join(parts) + " (dynamo_ext.config.collective_check_timeout_s, or the "
            "process group's timeout if shorter). They issue something else there: eager collectives, another "
            "graph they ran before in the same order, no collective at all; or they compile for longer than "
            f"that. This rank's collectives:\n{mine}"
        )


def exchange_store(store: Any, epoch: int | str) -> Any:
    """The default group's ``store`` under the check's key prefix for ``epoch``."""
    return _compat.prefix_store(f"{_PREFIX}{epoch}/", store)


def write_entries(
    store: Any, gkey: str, r: GroupRun, rank: int, *, first: int | None = None, merged: bool | None = None
) -> None:
    """Write ``r``'s entries from position ``first`` (default: its start), the first of them last.

    ``merged``: whether the run's buckets ran merged, for entries written after
    the run's context was decided (NOTE [answering a peer's check]).
    """
    first = r.start if first is None else first
    for position in reversed(range(first, r.start + len(r.records))):  # NOTE [collective stream check]
        entry: dict[str, Any] = {"c": r.records[position - r.start].to_json(), "s": r.start, "g": r.digest}
        if merged is not None:
            entry["m"] = merged
        store.set(f"{gkey}/e/{position}/{rank}", json.dumps(entry))


def _line(c: CollectiveSignature | None) -> str:
    if c is None:
        return "no collective"
    return f"{c.describe()} at {c.source or '<unknown source>'}"
