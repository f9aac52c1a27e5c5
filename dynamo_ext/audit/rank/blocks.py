"""How the audit compiles the graphs it traces, and what the report says of it.

NOTE [the audit compiles each block]
With ``dynamo_ext.config.compile_blocks_once`` (NOTE [blocks compiled once] in ``blocks/split.py``) a
block that runs another block's compile logs no graphs of its own on the structured trace, so the
communication report and the collective sequences the ranks compare would miss its collectives
(three identical blocks, two all-gathers reported).  So ``dynamo-ext audit`` and the in-process
:func:`dynamo_ext.audit.audit` turn ``config.reuse_block_compiles`` off: the graph is cut at the same
places as in a run with the same settings, so its buckets and its numerics are that run's, and every
block is compiled, each logging its AOT graphs in the order the blocks run (the collector joins a Dynamo
graph's AOT graphs into one sequence per side).  Its compile times are then longer than the run's at
depth; the report says so (``plugin["blocks"]``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..schema.events import BLOCKS_EACH_FOR_AUDIT, BLOCKS_WHOLE_BY_USER


def audit_blocks() -> str:
    """The report's ``plugin["blocks"]`` text for the plugin's current settings."""
    from ... import config

    return BLOCKS_EACH_FOR_AUDIT if config.compile_blocks_once else BLOCKS_WHOLE_BY_USER


@contextlib.contextmanager
def every_block_compiled() -> Iterator[None]:
    """Within the block, ``config.reuse_block_compiles`` is off (NOTE [the audit compiles each block])."""
    from ... import config

    with config.patch(reuse_block_compiles=False):
        yield
