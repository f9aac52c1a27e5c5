"""Whether the audit compiles identical blocks once or each graph whole, and what the report says of it.

NOTE [the audit compiles each graph whole]
With ``dynamo_ext.config.compile_blocks_once`` (NOTE [blocks compiled once] in ``block_split.py``) a
block that runs another block's compile has no graphs of its own on the structured trace, so the
communication report would miss its collectives (three identical blocks, two all-gathers reported).  So ``dynamo-ext audit`` and the in-process
:func:`dynamo_ext.audit.audit` compile each graph whole, unless ``DYNAMO_EXT_COMPILE_BLOCKS_ONCE`` is
set, and the report says which (``plugin["blocks"]``): a run with the plugin's defaults compiles
faster than the audit's compile times show.
"""

from __future__ import annotations

import os

from ..schema.events import BLOCKS_ONCE, BLOCKS_WHOLE_BY_USER, BLOCKS_WHOLE_FOR_AUDIT

ENV = "DYNAMO_EXT_COMPILE_BLOCKS_ONCE"


def audit_blocks() -> tuple[str, bool]:
    """(the report's ``plugin["blocks"]`` text, whether the audit must turn ``compile_blocks_once`` off).

    Off unless ``DYNAMO_EXT_COMPILE_BLOCKS_ONCE`` is set; when it is set, the setting it gave stands.
    """
    from ... import config

    if ENV not in os.environ:
        return BLOCKS_WHOLE_FOR_AUDIT, True
    return (BLOCKS_ONCE if config.compile_blocks_once else BLOCKS_WHOLE_BY_USER), False
