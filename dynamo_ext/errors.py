"""Exceptions dynamo-ext raises at run time (importing this module imports nothing from torch)."""

from __future__ import annotations


class CollectiveMismatchError(RuntimeError):
    """Ranks compiled graphs that issue different collectives; running them would hang.

    Raised on every rank of a compiled graph's groups before the graph first runs
    (:mod:`dynamo_ext.collective_check`).  The message names the first differing
    collective on each rank and its user source line.
    """
