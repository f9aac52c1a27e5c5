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
under ``<epoch>/<group>/e/<position>/<rank>`` in the default group's store, in
reverse graph order over all the graph's groups (the graph's first collective
last, so a peer that sees an entry sees every later one of the same graph).
Then it waits, bounded, for each peer's entry at the graph's first collective
that peer takes part in (for a peer in one group only: that group's first
position), and compares every position where the peer has written an entry.  A
peer that has not written a later position yet writes it after this rank did,
and compares it then: every position two ranks both reach in a check is
compared by at least one of them.  Waiting for more would deadlock correct
programs: with ``all_reduce(a); if rank == 0: print(); all_reduce(b)``, rank 1's
one graph covers both all-reduces, but rank 0's second graph runs only after the
first all-reduce completes, which needs rank 1; the same holds when ``a`` and
``b`` go to two different groups.

Each entry also says where the rank stands on its *other* groups (``"x"``:
per group, the compiled collectives this rank issued on it before this one;
NOTE [order across groups] in :mod:`.order`).  A mismatch ends the check with
:class:`CollectiveMismatchError` naming the group, the position and each
rank's collective and line (or both groups and the position where their order
differs); the rank writes the group's abort key (``<epoch>/<group>/a``), so a
peer waiting in a check of that group raises too, and every later check of the
group raises at once (call :func:`.stream.reset` on every rank to go on).
While it waits, a rank also publishes where it waits (``w/<rank>``: the
positions and the peers it waits for there); a peer that waits for this rank
at a position this rank has not written cannot be satisfied (the two wait for
each other: another group, another order), which is a mismatch too.  Only a
peer that never writes the position (it issues eager collectives there, or
runs, unchecked, a graph it ran before in the same context; it died) makes the
wait last ``config.collective_check_timeout_s``, or the default group's timeout
when that is shorter, and then it is an error too.

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
from .order import line as _line
from .order import order_difference
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
        crossed: per record, ``(group, count)`` for each other group with collectives earlier in
            the same graph (NOTE [order across groups]).
        base: ``(group, position)`` for this rank's groups when the graph started (positions > 0).
        unknown: groups whose position at the graph's start is not known (not compared).
    """

    group: str
    ranks: tuple[int, ...]
    records: tuple[CollectiveSignature, ...]
    digest: str
    start: int
    crossed: tuple[tuple[tuple[str, int], ...], ...] = ()
    base: tuple[tuple[str, int], ...] = ()
    unknown: frozenset[str] = frozenset()

    def others(self, i: int) -> dict[str, int]:
        """Per other group, the compiled collectives this rank issued on it before ``records[i]`` (0s left out)."""
        counts = {g: n for g, n in self.base if g != self.group and n}
        for g, n in self.crossed[i] if self.crossed else ():
            counts[g] = counts.get(g, 0) + n
        return counts

    def index(self, i: int) -> int:
        """Where ``records[i]`` comes among all the graph's checked collectives (0: the first)."""
        return i + sum(n for _, n in self.crossed[i]) if self.crossed else i


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def group_key(group: str) -> str:
    """The key of ``group`` in the check's store (the same on every rank)."""
    return _digest(group)


def agree(runs: Sequence[GroupRun], *, store: Any, epoch: int | str, rank: int) -> dict[str, bool | None]:
    """Compare ``runs`` (one graph's, one per group) with every peer's entries at the same positions
    (NOTE [collective stream check], NOTE [order across groups]).

    Returns, per group, whether every peer's entry at the run's first position
    starts a graph with the same digest: every rank of the group then runs the
    same collectives with the same data flow from there (what bucketing needs,
    NOTE [buckets only where ranks agree]).  Every rank of the group reads the
    same entries at that position, so they all return the same answer.
    ``None`` where a peer's entry there is not written yet and every entry seen
    agrees: the peer reaches that position only after an earlier collective of
    this graph that it shares with this rank (its graph boundaries differ), so
    the answer waits until this rank has issued that one (:func:`.stream.merge_decision`).

    Raises:
        CollectiveMismatchError: a peer's collective at a compared position
            differs, or the peer issued it after another number of collectives
            of a group both ranks are in, a peer aborted one of these groups, a
            peer waits for this rank elsewhere, or a peer did not write the
            position this rank waits for within the timeout.
    """
    return _Check(runs, store, epoch, rank).run()


class _Check:
    def __init__(self, runs: Sequence[GroupRun], store: Any, epoch: int | str, rank: int) -> None:
        self.runs, self.rank = sorted(runs, key=lambda r: r.index(0)), rank  # graph order of first use
        self.store = exchange_store(store, epoch)
        self.gkey = {r.group: group_key(r.group) for r in self.runs}
        store_timeout = getattr(getattr(store, "timeout", None), "total_seconds", lambda: float("inf"))()
        # No longer than a collective itself would wait: the store's timeout is init_process_group's.
        self.timeout_s = min(config.collective_check_timeout_s, store_timeout)
        self.peer_groups: set[str] = set()
        self.waits = self._first_shared()
        self._group_ranks: dict[str, tuple[int, ...]] = {r.group: r.ranks for r in self.runs}

    def _entry_key(self, gkey: str, position: int, rank: int) -> str:
        return f"{gkey}/e/{position}/{rank}"

    def _first_shared(self) -> dict[str, list[int]]:
        """Per group, the peers this rank waits for at its run's first position: each peer where the graph
        first issues a collective it takes part in (NOTE [collective stream check])."""
        waits: dict[str, list[int]] = {}
        placed = {self.rank}
        for r in self.runs:
            peers = [p for p in r.ranks if p not in placed]
            placed.update(peers)
            if peers:
                waits[r.group] = peers
        return waits

    def run(self) -> dict[str, bool | None]:
        store, rank = self.store, self.rank
        for r in self.runs:
            self._raise_if_aborted(r)
        write_graph(store, self.runs, rank)
        by_group = {r.group: r for r in self.runs}
        waiting = [
            [self.gkey[g], by_group[g].start, list(by_group[g].ranks), g, peers] for g, peers in self.waits.items()
        ]
        store.set(f"w/{rank}", json.dumps(waiting))
        start = time.monotonic()
        try:
            firsts = self._wait_for_first_positions(start)
            self._read_other_firsts(firsts)
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

    def _read_other_firsts(self, firsts: dict[tuple[str, int], dict[str, Any]]) -> None:
        """Add the peers' entries at each run's first position that this rank did not wait for, where written."""
        for r in self.runs:
            for peer in r.ranks:
                if peer != self.rank and (r.group, peer) not in firsts:
                    key = self._entry_key(self.gkey[r.group], r.start, peer)
                    if self.store.check([key]):
                        firsts[(r.group, peer)] = json.loads(self.store.get(key))

    def _merge(self, r: GroupRun, firsts: dict[tuple[str, int], dict[str, Any]]) -> bool | None:
        """Whether ``r``'s buckets run merged: every peer starts the same graph here, and merges where it decided.

        An entry a peer's responder wrote (NOTE [answering a peer's check]) says
        how that peer runs its buckets, decided at an earlier check: a peer that
        merges where this rank's graph differs cannot be followed.  ``None``
        where a peer's entry is missing and every one seen agrees.
        """
        merge, missing = True, False
        for peer in r.ranks:
            if peer == self.rank:
                continue
            entry = firsts.get((r.group, peer))
            if entry is None:
                missing = True
                continue
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
        return None if missing and merge else merge

    def _raise_if_aborted(self, r: GroupRun) -> None:
        key = f"{self.gkey[r.group]}/a"
        if self.store.check([key]):
            raise CollectiveMismatchError(
                f"{self._head(r)} another rank stopped the check of this group: {self.store.get(key).decode()}"
            )

    def _wait_for_first_positions(self, start: float) -> dict[tuple[str, int], dict[str, Any]]:
        store = self.store
        pending = {(group, p) for group, peers in self.waits.items() for p in peers}
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
                    entry = firsts.get((r.group, peer))
                    if entry is None:
                        break  # the peer's graph there comes later (NOTE [collective stream check])
                else:
                    key = self._entry_key(gkey, r.start + i, peer)
                    if not self.store.check([key]):
                        break  # the peer writes this position after this rank: it compares it then
                    entry = json.loads(self.store.get(key))
                theirs = CollectiveSignature.from_json(entry["c"])
                if not same_collective(mine, theirs, self.rank, peer):
                    out.append(self._difference(r, r.start + i, peer, mine, theirs))
                    break
                crossing = order_difference(r, i, self.rank, peer, entry, theirs, self._ranks_of, self._own_record)
                if crossing:
                    out.append(crossing)
                    break
        return out

    def _ranks_of(self, group: str) -> tuple[int, ...]:
        ranks = self._group_ranks.get(group)
        if ranks is None:
            ranks = self._group_ranks[group] = _compat.group_ranks(group)
        return ranks

    def _own_record(self, group: str, position: int) -> CollectiveSignature | None:
        for r in self.runs:
            if r.group == group and r.start <= position < r.start + len(r.records):
                return r.records[position - r.start]
        return None

    def _waiting_elsewhere(self, peer: int) -> str | None:
        """A difference when ``peer`` waits for this rank at a group position this rank has not written."""
        key = f"w/{peer}"
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        if not raw:
            return None
        for gkey, position, scope, group, *waited in json.loads(raw):
            waits_for = waited[0] if waited else scope
            if self.rank not in waits_for or self.store.check([self._entry_key(gkey, position, self.rank)]):
                continue
            self.peer_groups.add(gkey)
            theirs = CollectiveSignature.from_json(
                json.loads(self.store.get(self._entry_key(gkey, position, peer)))["c"]
            )
            mine = ", ".join(
                f"position {r.start} of group {r.group!r} (ranks {format_ranks(r.ranks)}) with {_line(r.records[0])}"
                for r in self.runs
                if r.group in self.waits and peer in self.waits[r.group]
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


def _entry(r: GroupRun, i: int, merged: bool | None) -> str:
    entry: dict[str, Any] = {"c": r.records[i].to_json(), "s": r.start, "g": r.digest, "x": r.others(i)}
    if r.unknown:
        entry["u"] = sorted(r.unknown)
    if merged is not None:
        entry["m"] = merged
    return json.dumps(entry)


def write_entries(
    store: Any, gkey: str, r: GroupRun, rank: int, *, first: int | None = None, merged: bool | None = None
) -> None:
    """Write ``r``'s entries from position ``first`` (default: its start), the first of them last.

    ``merged``: whether the run's buckets ran merged, for entries written after
    the run's context was decided (NOTE [answering a peer's check]).
    """
    first = r.start if first is None else first
    for position in reversed(range(first, r.start + len(r.records))):  # NOTE [collective stream check]
        store.set(f"{gkey}/e/{position}/{rank}", _entry(r, position - r.start, merged))


def write_graph(
    store: Any,
    runs: Sequence[GroupRun],
    rank: int,
    *,
    first: tuple[str, int] | None = None,
    merged: dict[str, bool] | None = None,
) -> None:
    """Write the entries of one graph's ``runs`` (one per group) in reverse graph order, the first collective last.

    ``first``: ``(group, position)``: only that collective's entry and the graph's later ones.
    ``merged``: per group, whether the run's buckets ran merged (entries written after the decision).
    """
    order = [(r.index(i), r, i) for r in runs for i in range(len(r.records))]
    if first is not None:
        group, position = first
        at = min((r.index(position - r.start) for r in runs if r.group == group), default=0)
        order = [o for o in order if o[0] >= at]
    for _, r, i in sorted(order, key=lambda o: -o[0]):  # NOTE [collective stream check]
        m = None if merged is None else merged.get(r.group)
        store.set(f"{group_key(r.group)}/e/{r.start + i}/{rank}", _entry(r, i, m))
