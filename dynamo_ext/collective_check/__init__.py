"""Collective-sequence check: ranks agree on each compiled graph's collectives before it first runs.

* :mod:`.fingerprint`: a graph's collectives, rank-invariant (NOTE [collective fingerprint]);
* :mod:`.exchange`: the comparison through the c10d store, bounded (NOTE [collective check meeting point]);
* :mod:`.hook`: where it hooks into AOTAutograd and the compiled callable (NOTE [collective check hook]).

Switched by :data:`dynamo_ext.config.collective_check` (env ``DYNAMO_EXT_COLLECTIVE_CHECK``).
"""

from __future__ import annotations

from .exchange import CollectiveMismatchError, check_collectives, reset
from .fingerprint import Collective, collectives, first_difference, same_collective
from .hook import install

__all__ = [
    "Collective",
    "CollectiveMismatchError",
    "check_collectives",
    "collectives",
    "first_difference",
    "install",
    "reset",
    "same_collective",
]
