"""``install()`` / ``uninstall()`` / ``enabled()`` / ``is_installed()``.

Importing :mod:`dynamo_ext` changes nothing; ``install()`` hooks the variable
registry into Dynamo's builders, registers our trackers, guards, function
handlers and Inductor lowerings, and records every change in
:data:`dynamo_ext._patching.PATCHES`.  ``uninstall()`` undoes all of it.  Both
reset Dynamo's caches so no frame compiled under one regime runs under the
other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ._patching import PATCHES

_lock = threading.Lock()
_installed = False


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _installed


def install() -> None:
    """Install the plugin into Dynamo and Inductor.  A second call is a no-op.

    Raises:
        ImportError: torch is older than 2.11 or lacks ``torch.distributed``.
    """
    global _installed
    with _lock:
        if _installed:
            return
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            raise ImportError("dynamo-ext needs a torch build with torch.distributed (dist.is_available() is False)")
        from . import collective_check, guards, inductor_lowerings, variables

        try:
            variables.install(PATCHES)
            guards.install(PATCHES)
            inductor_lowerings.install(PATCHES)
            collective_check.install(PATCHES)  # NOTE [collective check hook]
        except BaseException:
            PATCHES.undo_all()
            raise
        torch._dynamo.reset()
        _installed = True


def uninstall() -> None:
    """Undo every change :func:`install` made.  A no-op when not installed."""
    global _installed
    with _lock:
        if not _installed:
            return
        import torch

        PATCHES.undo_all()
        torch._dynamo.reset()
        _installed = False


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Install the plugin for the duration of a ``with`` block (if it was not already)."""
    was = is_installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()
