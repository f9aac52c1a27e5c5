"""A compiled graph's collective records kept beside AOTAutograd's cache entry, for warm restarts.

NOTE [collective records beside AOTAutograd's cache]
On a hit, ``AOTAutogradCache`` returns the compiled forward and backward without
calling the partitioner or the compilers, so the check (NOTE [collective check
hook]) would not see the graphs' collectives.  So the records the check reads
at a miss (forward and backward collectives and data flows, :class:`GraphRecords`)
are written to a file of their own, beside the cache (``<cache_dir>/dynamo_ext_collectives/``),
and read back at a hit.  A hit whose records are missing, unreadable or stale
is turned into a miss at the lookup: AOTAutograd compiles the graph again (its
kernels still come from Inductor's FX graph cache), the check reads it, and
both entries are written anew.  A hit is never taken without records.

The file's key is AOTAutograd's cache key plus what that key leaves out but
the records depend on:

* the stack traces of the Dynamo graph's nodes (AOTAutograd's key strips node
  metadata; the records name the user's line of each collective, which comes
  from these traces);
* this process's global rank and world size (the records hold each group's
  global ranks; a group name can stand for other ranks on another rank);
* where torch and dynamo-ext are installed and dynamo-ext's source (which
  frames count as the user's, how records are read).

On a read, each record's group must still have the ranks recorded.  Records
live only in the local directory: an entry served by a remote AOTAutograd cache
without a local record file is compiled again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from .. import _compat
from .fingerprint import CollectiveSignature

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""Written into each record file and checked on read."""


@dataclasses.dataclass(frozen=True)
class GraphRecords:
    """What the check reads from one AOTAutograd compile.

    Attributes:
        forward: the forward (or inference) graph's collectives, graph order.
        forward_flow: the forward graph's :func:`.fingerprint.data_flow`.
        backward: the backward graph's collectives; ``None`` for an inference graph (no backward).
        backward_flow: the backward graph's data flow (``""`` without a backward).
        forward_bucketed, backward_bucketed: the groups on which each compiled graph has buckets
            (NOTE [answering a peer's check]).
    """

    forward: tuple[CollectiveSignature, ...]
    forward_flow: str
    backward: tuple[CollectiveSignature, ...] | None = None
    backward_flow: str = ""
    forward_bucketed: frozenset[str] = frozenset()
    backward_bucketed: frozenset[str] = frozenset()

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "forward": [c.to_json() for c in self.forward],
            "forward_flow": self.forward_flow,
            "backward": None if self.backward is None else [c.to_json() for c in self.backward],
            "backward_flow": self.backward_flow,
            "forward_bucketed": sorted(self.forward_bucketed),
            "backward_bucketed": sorted(self.backward_bucketed),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GraphRecords:
        """Raises ``ValueError`` for another format version, ``KeyError``/``TypeError``/``ValueError`` for bad data."""
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {data.get('version')!r}, expected {FORMAT_VERSION}")
        backward = data["backward"]
        return cls(
            tuple(CollectiveSignature.from_json(row) for row in data["forward"]),
            str(data["forward_flow"]),
            None if backward is None else tuple(CollectiveSignature.from_json(row) for row in backward),
            str(data["backward_flow"]),
            frozenset(map(str, data["forward_bucketed"])),
            frozenset(map(str, data["backward_bucketed"])),
        )


@functools.cache
def _install_digest() -> str:
    """Where torch and dynamo-ext live and dynamo-ext's source (read once per process)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256(f"{torch.__version__}\0{os.path.dirname(torch.__file__)}\0{package}".encode())
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, package).encode())
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _stack_digest(gm: Any) -> str:
    """A digest of the stack traces of ``gm``'s nodes and its submodules' (what AOTAutograd's key leaves out)."""
    h = hashlib.sha256()
    gm = getattr(gm, "gm", gm)  # torch._dynamo.utils.GmWrapper
    modules = gm.named_modules() if callable(getattr(gm, "named_modules", None)) else ()
    for name, module in modules:
        graph = getattr(module, "graph", None)
        if graph is None:
            continue
        h.update(f"\0module {name}\0".encode())
        for node in graph.nodes:
            h.update(f"{node.name}\0{node.meta.get('stack_trace') or ''}\0".encode())
    return h.hexdigest()


def records_key(aot_key: str, gm: Any) -> str:
    """The record file's key for AOTAutograd cache key ``aot_key`` and Dynamo graph ``gm`` in this process."""
    import torch.distributed as dist

    world = dist.get_world_size() if _compat.distributed_initialized() else 0
    parts = [FORMAT_VERSION, aot_key, _compat.global_rank(), world, _install_digest(), _stack_digest(gm)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _path(key: str) -> str:
    return os.path.join(_compat.records_dir(), key[:2], key + ".json")


def _groups_unchanged(records: Sequence[CollectiveSignature]) -> bool:
    return all(not c.group or _compat.group_ranks(c.group) == c.ranks for c in records)


def load(key: str) -> GraphRecords | None:
    """The records stored under ``key``; ``None`` when absent, unreadable, of another format,
    or naming a group whose ranks are not the recorded ones."""
    path = _path(key)
    try:
        with open(path, encoding="utf-8") as f:
            records = GraphRecords.from_json(json.load(f))
    except FileNotFoundError:
        log.debug("collective records: none for key %s", key)
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.debug("collective records: %s unreadable (%s)", path, e)
        return None
    if not _groups_unchanged((*records.forward, *(records.backward or ()))):
        log.debug("collective records: %s names a group whose ranks changed", path)
        return None
    return records


def store(key: str, records: GraphRecords) -> None:
    """Write ``records`` under ``key`` (atomically: a reader sees the old file, the new one or none).

    A failure to write is logged and ignored: the next lookup then misses and compiles again.
    """
    path = _path(key)
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(records.to_json(), f)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        log.warning("collective check: could not write %s (%s); this graph compiles again on a restart", path, e)
