"""``install()`` / ``uninstall()`` / ``enabled()`` / ``is_installed()``.

Importing :mod:`dynamo_ext` changes nothing; ``install()`` hooks the variable
registry into Dynamo's builders, registers our trackers, guards, function
handlers and Inductor lowerings, and records every change in
:data:`dynamo_ext._patching.PATCHES`.  ``uninstall()`` undoes all of it.  Both
reset Dynamo's caches so no frame compiled under one regime runs under the
other.

NOTE [install under threads]
``install()`` and ``uninstall()`` patch and reset while holding Dynamo's
compile lock (``_compat.compile_lock()``), so a frame another thread is
compiling is traced wholly with or wholly without the plugin.  ``enabled()``
blocks are counted: the plugin stays installed until the last block that
installed it (in any thread) exits, so one thread's block never uninstalls
under another's.  An explicit ``uninstall()`` takes effect at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ._patching import PATCHES

_lock = threading.RLock()
_installed = False
_by_enabled = False  # installed by an enabled() block (not by install())
_enabled_depth = 0  # enabled() blocks open now that count on the plugin staying installed


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _installed


def install() -> None:
    """Install the plugin into Dynamo and Inductor.  A second call is a no-op.

    On a torch newer than the last release the plugin was verified on
    (``_compat.releases.LAST_VERIFIED_RELEASE``), warns once (``UserWarning``) naming the private torch APIs the
    plugin uses that the release lacks, and installs anyway.

    Raises:
        ImportError: torch is older than 2.11 or lacks ``torch.distributed``.
    """
    with _lock:
        _install()


def _install() -> None:
    global _installed
    if _installed:
        return
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise ImportError("dynamo-ext needs a torch build with torch.distributed (dist.is_available() is False)")
    from . import (
        _compat,
        aot_cache_key,
        aot_cache_policy,
        aot_rng_order,
        async_collective_inputs,
        collective_check,
        guards,
        inductor_lowerings,
        make_fx_meta,
        retrace_meta,
        variables,
    )
    from ._compat import releases
    from .blocks import aot_backward_calls
    from .blocks import reuse as block_reuse
    from .blocks import split as block_split
    from .blocks import trace_once as block_trace_once
    from .spmd import ddp_overlap

    releases.check_torch_release()  # warns once on a torch newer than the last verified release
    with _compat.compile_lock():  # NOTE [install under threads]
        try:
            variables.install(PATCHES)
            guards.install(PATCHES)
            inductor_lowerings.install(PATCHES)
            collective_check.install(PATCHES)  # NOTE [collective check hook]
            aot_cache_policy.install(PATCHES)  # NOTE [our autograd functions in AOTAutograd's cache]
            aot_cache_key.install(PATCHES)  # NOTE [device meshes in the cache key]
            aot_rng_order.install(PATCHES)  # NOTE [rng states after opaque objects]
            async_collective_inputs.install(PATCHES)  # NOTE [grad-requiring AsyncCollectiveTensor inputs]
            ddp_overlap.install(PATCHES)  # NOTE [split for overlap under DDP]
            block_reuse.install(PATCHES)  # NOTE [block reuse]
            block_split.install(PATCHES)  # NOTE [blocks compiled once]
            block_trace_once.install(PATCHES)  # NOTE [blocks traced once]
            retrace_meta.install(PATCHES)  # NOTE [original node meta read once per code object]
            make_fx_meta.install(PATCHES)  # its NOTEs: DTensor snapshots, the capture's tensor_meta
            aot_backward_calls.install(PATCHES)  # NOTE [AOT backward copies traced as one call]
        except BaseException:
            PATCHES.undo_all()
            raise
        torch._dynamo.reset()
        _installed = True


def uninstall() -> None:
    """Undo every change :func:`install` made.  A no-op when not installed."""
    global _by_enabled
    with _lock:
        _by_enabled = False
        _uninstall()


def _uninstall() -> None:
    global _installed
    if not _installed:
        return
    import torch

    from . import _compat

    with _compat.compile_lock():  # NOTE [install under threads]
        PATCHES.undo_all()
        torch._dynamo.reset()
        _installed = False


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Install the plugin for the duration of a ``with`` block (if it was not already).

    Blocks nest and may be open in several threads at once: the plugin is
    uninstalled when the last block exits, and only if a block installed it
    (not :func:`install`).  Raises as :func:`install` does.
    """
    global _by_enabled, _enabled_depth
    with _lock:
        if not _installed:
            _install()
            _by_enabled = True
        _enabled_depth += 1
    try:
        yield
    finally:
        with _lock:
            _enabled_depth -= 1
            if _enabled_depth == 0 and _by_enabled:
                _by_enabled = False
                _uninstall()
