"""c10d handlers: ``torch.distributed`` calls traced as functional collectives."""

from __future__ import annotations


def register() -> None:
    """Register the collective polyfills (none yet)."""
