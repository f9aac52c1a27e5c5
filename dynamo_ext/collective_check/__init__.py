"""Collective-stream check: ranks agree on the collectives each process group sees, in issue order.

* :mod:`.fingerprint`: a graph's collectives, rank-invariant (NOTE [collective fingerprint]);
* :mod:`.exchange`: the comparison per stream position through the c10d store, bounded
  (NOTE [collective stream check]);
* :mod:`.order`: the order of each two groups' collectives on the ranks in both (NOTE [order across groups]);
* :mod:`.plans`: a compiled graph's collectives per group, what each group's check compares;
* :mod:`.stream`: when a graph is checked, and what a process remembers (NOTE [when the stream is checked]);
* :mod:`.responder`: a rank answers, from its last runs, a peer's check that waits for it
  (NOTE [answering a peer's check]);
* :mod:`.hook`: where it hooks into AOTAutograd and the compiled callable (NOTE [collective check hook]).

Switched by :data:`dynamo_ext.config.collective_check` (env ``DYNAMO_EXT_COLLECTIVE_CHECK``).
"""

from __future__ import annotations

from ..errors import CollectiveMismatchError
from .exchange import GroupRun, agree
from .fingerprint import CollectiveSignature, collectives, data_flow, first_difference, same_collective
from .hook import install
from .stream import check_collectives, merge_decision, reset

__all__ = [
    "CollectiveSignature",
    "CollectiveMismatchError",
    "GroupRun",
    "agree",
    "check_collectives",
    "collectives",
    "data_flow",
    "first_difference",
    "install",
    "merge_decision",
    "reset",
    "same_collective",
]
