"""Inductor lowerings and post-grad passes that fuse collectives with their neighbours."""

from __future__ import annotations

from .._patching import Patcher


def install(patches: Patcher) -> None:
    """Register the lowerings and passes (none yet)."""
