"""The generic probe: an attribute of a torch module that some releases lack.

Every release difference dynamo-ext handles is a feature probe (an import
attempt, ``hasattr``, a signature check), never a comparison of version
strings, so a point release that back-ports a feature is handled too.
"""

from __future__ import annotations

import importlib
from typing import Any


def optional_attr(module: str, name: str) -> Any:
    """``module.name`` or ``None`` when this torch release lacks it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
