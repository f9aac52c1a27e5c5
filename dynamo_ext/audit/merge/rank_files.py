"""Read a directory of rank files (``python -m dynamo_ext.audit.collect --out DIR``) into one report.

``merge_dir(DIR)`` is what ``dynamo-ext audit merge DIR`` and the local
``dynamo-ext audit --nproc N`` both call: the files are read one at a time and
folded by :class:`.merge.Merger` (NOTE [streaming merge]).  The world size
comes from the files' headers (NOTE [rank file] in :mod:`..rank.collect`); a rank
the headers promise but the directory lacks is ``missing``, a file without its
``end`` line was cut short (``died``), and both are named with their host.  A
directory without rank files but with ``TORCH_TRACE`` logs is read by
:mod:`.trace_reader` instead.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

from ..model.kinds import INCOMPLETE, RankStatus
from ..model.records import AuditReport
from ..schema import events as ev
from .merger import Merger

logger = logging.getLogger(__name__)

RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


def rank_files(directory: str) -> dict[int, str]:
    """``{rank: path}`` of the rank files in ``directory``."""
    out = {}
    for name in os.listdir(directory):
        m = RANK_FILE.match(name)
        if m:
            out[int(m.group(1))] = os.path.join(directory, name)
    return out


class _RankFile:
    """Streams one rank file's typed events and remembers what its header, end and damage said."""

    def __init__(self, rank: int, path: str) -> None:
        self.rank = rank
        self.path = path
        self.header: ev.Start | None = None
        self.end: ev.End | None = None
        self.error: ev.Error | None = None
        self.events = 0
        self.last = "nothing"
        self.torn = False  # the last line is incomplete: the process died while writing it
        self.bad_lines = 0

    def __iter__(self) -> Iterator[ev.Event]:
        """The events in file order (NOTE [rank-file format]).

        Raises:
            RankFileVersionError: the header's format version is not the one this dynamo-ext reads.
        """
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    e = ev.parse_event(json.loads(line))
                except json.JSONDecodeError:
                    if line.endswith("\n"):
                        self.bad_lines += 1
                    else:
                        self.torn = True
                    continue
                except ValueError as why:
                    logger.debug("%s: skipped a line: %s", self.path, why)
                    self.bad_lines += 1
                    continue
                self.events += 1
                self.last = e.KIND.value
                if isinstance(e, ev.Start):
                    ev.check_format_version(e, self.path)
                    self.header = e
                elif isinstance(e, ev.End):
                    self.end = e
                elif isinstance(e, ev.Error) and self.error is None:
                    self.error = e
                yield e

    def status(self) -> dict[str, Any]:
        """This rank's status from what its file holds (see :class:`..model.records.RankSummary`)."""
        if self.error is not None:
            st = RankStatus.STOPPED if self.error.type == "Terminated" else RankStatus.ERROR
            return {"status": st, "error": self.error.message}
        if self.end is not None:
            code = self.end.status
            return (
                {"status": RankStatus.OK} if code == 0 else {"status": RankStatus.ERROR, "error": f"exit status {code}"}
            )
        if self.header is None:
            return {
                "status": RankStatus.DIED,
                "error": "rank file has no header: the process ended before writing anything",
            }
        return {
            "status": RankStatus.DIED,
            "error": f"rank file cut short after {self.events} record(s) (last: {self.last}"
            + (", then a torn line" if self.torn else "")
            + "): the process was killed before it finished",
        }


def _infer_host(rank: int, headers: dict[int, dict[str, Any]]) -> tuple[str, int | None]:
    """Host and node rank of a rank without a file, when the other ranks' layout gives them.

    torchrun and srun (block distribution) place ranks node by node:
    ``rank == node_rank * local_world_size + local_rank``.  When every header
    fits that with one local world size, the missing rank's node is known and
    so is the host of that node's other ranks.  Else ``("", None)``.
    """
    sizes = {h.get("local_world_size") for h in headers.values()}
    if len(sizes) != 1 or not isinstance(lws := next(iter(sizes)), int) or lws < 1:
        return "", None
    nodes: dict[int, str] = {}
    for r, h in headers.items():
        node, local = h.get("node_rank"), h.get("local_rank")
        if not isinstance(node, int) or not isinstance(local, int) or r != node * lws + local:
            return "", None
        nodes[node] = str(h.get("host") or "")
    node = rank // lws
    return nodes.get(node, ""), node


def merge_dir(
    directory: str,
    *,
    world_size: int | None = None,
    statuses: dict[int, dict[str, Any]] | None = None,
    errors: tuple[str, ...] = (),
    backend: str = "",
) -> AuditReport:
    """The merged report of every rank file in ``directory``.

    ``world_size``: the number of ranks expected (default: the largest world
    size in the headers).  ``statuses[rank]``: what the caller knows better than
    the files (the local launcher: timeouts, exit codes); it replaces the
    file-derived status of that rank.  ``errors``: the caller's own lines.

    Raises:
        FileNotFoundError: ``directory`` does not exist.
        ValueError: it holds neither rank files nor ``TORCH_TRACE`` logs.
        RankFileVersionError: (a ``ValueError``) a rank file of another format version (NOTE [rank-file format]).
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no such directory: {directory!r}")
    files = rank_files(directory)
    if not files:
        from .trace_reader import is_trace_dir, merge_trace_dir

        if is_trace_dir(directory):
            return merge_trace_dir(directory)
        raise ValueError(
            f"{directory!r} holds no rank files (rank<R>.jsonl, written by python -m dynamo_ext.audit.collect "
            "--out DIR) and no TORCH_TRACE logs (dedicated_log_torch_trace_rank_*.log)"
        )
    merger = Merger()
    headers: dict[int, dict[str, Any]] = {}
    found: dict[int, dict[str, Any]] = {}
    target = ""
    torch_versions: set[str] = set()
    for rank in sorted(files):
        rf = _RankFile(rank, files[rank])
        merger.add_rank(rank, rf)
        found[rank] = rf.status()
        if rf.header is not None:
            h = rf.header
            headers[rank] = {"world_size": h.world_size, "host": h.host, "node_rank": h.node_rank,
                             "local_rank": h.local_rank, "local_world_size": h.local_world_size}  # fmt: skip
            target = target or h.target
            torch_versions.add(h.torch_version)
        if rf.bad_lines:
            logger.warning("%s: %d line(s) that are not audit records were skipped", rf.path, rf.bad_lines)
    worlds = {int(h.get("world_size") or 0) for h in headers.values()}
    lines = list(errors)
    if len(worlds) > 1:
        lines.append(
            f"rank files disagree on the world size ({', '.join(map(str, sorted(worlds)))}): files from "
            "different jobs in one directory? Give each job its own --out"
        )
    world = world_size or max([*worlds, max(files) + 1])
    for rank in range(world):
        if rank in found:
            continue
        host, node = _infer_host(rank, headers)
        where = f"host {host}, node {node}" if host else "host unknown"
        found[rank] = {
            "status": RankStatus.MISSING,
            "error": f"no rank file for rank {rank} of {world} ({where}): the rank never started or wrote elsewhere",
            "host": host,
            "node_rank": node,
        }
    for rank, st in (statuses or {}).items():
        found[rank] = {**found.get(rank, {}), **st}
    return merger.report(
        target=target,
        world_size=world,
        backend=backend,
        statuses=found,
        errors=tuple(lines),
        torch_version=", ".join(sorted(v for v in torch_versions if v)) or None,
    )


def incomplete_ranks(report: AuditReport) -> list[str]:
    """One line per rank whose findings are incomplete (missing, cut short, raised, stopped), with its host."""
    out = []
    for r in report.ranks:
        if r.status in INCOMPLETE:
            where = f"host {r.host}" + (f", node {r.node_rank}" if r.node_rank is not None else "") if r.host else ""
            out.append(f"rank {r.rank} ({where or 'host unknown'}): {r.status}: {r.error}")
    return out
