"""What identifies a graph and a recompile across ranks.

NOTE [graph identity]
A graph is identified by its code object (``file:firstline function``, resume
functions named after the function they resume) and why it was compiled: the
first compile has no suffix, a recompile ``| recompile: <failed guard>``.  Not
by compile order: an extra recompile on one rank leaves every other identity
as it was.  Compiles with the same identity on a rank are one row, with their
collective sequences concatenated in compile order.
"""

from __future__ import annotations

import re
from typing import Any

from ..schema import events as ev

RESUME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_(\d+)$")
_CID_PREFIX = re.compile(r"^\s*!?[\d/]+:\s*", re.M)
# Guards that compare an object's id() (ID_MATCH, TYPE_MATCH): the number differs per process.
_GUARD_ID = re.compile(r"(___check_(?:obj|type)_id\([^()]*?,\s*)\d+(\))")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def recompile_reason(raw: Any) -> str:
    """A recompile's failed guard without what differs between processes (compile id, object ids, addresses).

    An ``id()`` guard (``___check_obj_id(forward.__code__, 94211665358448)``) fails on every rank for the
    same cause with a different number, so the number would split one recompile into a row per rank.
    """
    reason = _CID_PREFIX.sub("", str(raw or "")).strip()
    return _ADDRESS.sub("0x…", _GUARD_ID.sub(r"\1<id>\2", reason))


def graph_id(e: ev.Compile) -> str:
    """The identity of a compiled graph: its code object and why it was compiled (see NOTE [graph identity])."""
    base = f"{e.file}:{e.line} {e.function}"
    reason = recompile_reason(e.recompile_reason)
    return f"{base} | recompile: {reason.splitlines()[0].split('  #')[0].strip()}" if reason else base
