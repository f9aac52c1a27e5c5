"""The ranks of a data-parallel step agree on their batch sizes before any of them traces.

NOTE [batch sizes agreed before tracing]
A rank whose part of the batch cannot be traced (fewer than 2 samples on a
batch dim: the dim could not stay symbolic) would raise on its own while its
peers trace and then wait for it at the collective check until its timeout.
So before a trace for a new argument structure (a cache miss that every rank
has at the same call, since the structure is the same on every rank) each
rank writes the shapes of its tensor arguments to the default group's c10d
store and reads every peer's (set/check/get only, no collective, bounded by
``config.collective_check_timeout_s`` and the group's timeout); when any rank
has too few samples, every rank raises the same ``ValueError`` at once.
A retrace of a known structure for one rank's new batch size (a failed shape
guard) is local and does not meet: the peers may not retrace.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence

from .. import _compat, config
from ..errors import CollectiveMismatchError

log = logging.getLogger(__name__)

_PREFIX = "dynamo_ext/data_parallel/"
_meetings: dict[str, int] = {}
"""Per group name, how many agreements this process has joined (the next one's number)."""


def _too_small(shapes: Sequence[Sequence[int]], dims: Sequence[int | None]) -> list[str]:
    out = []
    for n, (shape, dim) in enumerate(zip(shapes, dims)):
        if dim is None or not -len(shape) <= dim < len(shape):
            continue  # no batch dim, or out of range (trace_step says so, the same on every rank)
        if shape[dim] < 2:
            out.append(
                f"tensor argument {n} has {shape[dim]} sample(s) on its batch dim {dim % len(shape)} "
                f"(shape {tuple(shape)})"
            )
    return out


def agree_batch_sizes(group_name: str, shapes: Sequence[Sequence[int]], dims: Sequence[int | None]) -> None:
    """Check every rank's batch sizes before a new trace (NOTE [batch sizes agreed before tracing]).

    Args:
        group_name: the data-parallel process group's name.
        shapes: this rank's tensor arguments' shapes, in flattened-argument order.
        dims: their batch dims (None: no batch dim).

    Raises:
        ValueError: on every rank, when a tensor argument of some rank has fewer
            than 2 samples on its batch dim (the message names the ranks).
        CollectiveMismatchError: a peer did not start the step within the
            timeout (it runs other code).
    """
    rank = _compat.global_rank()
    ranks = _compat.group_ranks(group_name)
    store = _compat.default_store()
    mine = [list(s) for s in shapes]
    if rank is None or len(ranks) < 2 or store is None or _compat.group_is_fake(group_name):
        by_rank = {rank or 0: mine}
    else:
        by_rank = _exchange(store, group_name, rank, ranks, mine)
    problems = [f"rank {r}: {p}" for r in sorted(by_rank) for p in _too_small(by_rank[r], dims)]
    if problems:
        raise ValueError(
            "data_parallel needs at least 2 samples per rank on every batch dim (a size-1 dim cannot stay "
            "symbolic) when it traces the step: " + "; ".join(problems) + ". Give every rank at least 2 "
            "samples (drop or pad the last, smaller batch; DataLoader(drop_last=True))."
        )


def _exchange(
    store: object, group_name: str, rank: int, ranks: Sequence[int], mine: list[list[int]]
) -> dict[int, list[list[int]]]:
    group_key = hashlib.sha1(group_name.encode()).hexdigest()[:16]
    index = _meetings.get(group_key, 0)
    _meetings[group_key] = index + 1
    prefixed = _compat.prefix_store(_PREFIX, store)
    prefixed.set(f"{group_key}/{index}/{rank}", json.dumps(mine))
    store_timeout = getattr(getattr(store, "timeout", None), "total_seconds", lambda: float("inf"))()
    timeout_s = min(config.collective_check_timeout_s, store_timeout)
    pending = {r for r in ranks if r != rank}
    out = {rank: mine}
    start, sleep = time.monotonic(), 0.0002
    while pending:
        for r in sorted(pending):
            key = f"{group_key}/{index}/{r}"
            if prefixed.check([key]):
                out[r] = json.loads(prefixed.get(key))
                pending.discard(r)
        if not pending:
            break
        if time.monotonic() - start > timeout_s:
            raise CollectiveMismatchError(
                f"data_parallel on rank {rank}: rank(s) {', '.join(map(str, sorted(pending)))} did not start "
                f"tracing the step within {timeout_s:g} s (dynamo_ext.config.collective_check_timeout_s, or the "
                "process group's timeout if shorter); every rank must call the step with arguments of the same "
                "structure at the same time"
            )
        time.sleep(sleep)
        sleep = min(sleep * 2, 0.002)
    log.debug("data_parallel: batch shapes agreed after %.3f s: %s", time.monotonic() - start, out)
    return out
