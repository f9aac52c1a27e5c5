"""Frames loaded from Dynamo's precompile cache never run while the plugin is installed.

NOTE [precompile packages written without the plugin]
A package written without the plugin (``TORCH_CACHING_PRECOMPILE=1``, then
``torch.compiler.save_cache_artifacts()``) holds each frame's guards as Dynamo
saved them: without its ``ID_MATCH``, ``CLOSURE_MATCH``, ``WEAKREF_ALIVE`` and
``DICT_VERSION`` guards (NOTE [frames kept out of the precompile cache]) and
without the guards the plugin's trackers add (process groups, meshes, FSDP2
state).  Loaded into a process with the plugin installed, such a frame ran
whatever the writer saw: a global function replaced after the load was not
called (9.28 where eager gives 76.96, 2.13).  A package written with the plugin
installed holds no frame to run (every frame was bypassed when it was written).

So while the plugin is installed, a package's saved frames are never loaded:

- a package loaded after ``install()``: ``CompilePackage.initialize`` gets, of
  a package that holds saved frames, only the compiled function's own code
  entry, bypassed (the flag Dynamo sets for a frame whose backend was not
  saved), so ``install`` loads nothing and Dynamo traces the function again
  with every guard.  Its resume functions' entries are dropped, not bypassed:
  ``install`` would still put a bypassed resume function in the module's
  globals, under the name the new trace's own resume function takes (2.13:
  "Name '__resume_at_96_5' already exists in scope");
- a package loaded before ``install()`` (``torch.compile()`` with the cache on
  loads it at once): ``install()`` unloads it (its frames, the globals it set)
  and leaves it holding the same one bypassed entry.

Each refusal is logged as a warning ("Detected a package bypass: ...", Dynamo's
words for a frame left out of a package).  Under
``torch._dynamo.config.strict_precompile`` it is a ``PackageError`` instead:
``torch.compile()`` catches it as a package that failed to load ("Failed to
load entry from dynamo cache"), traces the function again, and the trace raises
the plugin's own ``PackageError``; ``DynamoCache.load_and_install_package``
raises it; ``install()`` raises it and installs nothing.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from .._patching import Patcher

log = logging.getLogger(__name__)


def _where(code: types.CodeType | None) -> str:
    if code is None:
        return "a compiled function"
    name = getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11+
    return f"{name} ({code.co_filename}:{code.co_firstlineno})"


def _refusal(where: str, frames: int, strict: bool) -> str:
    outcome = (
        "With strict_precompile on, this is an error"
        if strict
        else "They are not run; Dynamo traces the function again with every guard"
    )
    return (
        f"Detected a package bypass: dynamo-ext is installed and Dynamo's precompile package for {where} holds "
        f"{frames} saved frame(s) written without the plugin: they lack the identity, closure and dict-version "
        "guards Dynamo drops when it saves a frame and the guards the plugin adds, so they could run code that "
        f"has changed since (NOTE [precompile packages written without the plugin]). {outcome}. To use the "
        "cache, write it in a process with dynamo-ext installed (its frames are not saved; a restart hits "
        "AOTAutograd's and Inductor's caches), or remove the package (the dynamo/ folder of the Inductor cache "
        "directory)."
    )


def _refuse(packages: Any, where: str, frames: int) -> None:
    """Raise Dynamo's ``PackageError`` under ``strict_precompile``; else log the bypass as a warning."""
    strict = bool(getattr(torch._dynamo.config, "strict_precompile", False))
    if strict:
        raise packages.error(_refusal(where, frames, strict))
    log.warning("%s", _refusal(where, frames, strict))


def _loaded_without_saved_frames(original: Callable[..., Any], packages: Any) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        dynamo = bound.arguments.get("dynamo")
        codes = list(getattr(dynamo, "codes", None) or ())
        saved = [entry for entry in codes if packages.runs_saved_frames(entry)]
        if not saved:  # a fresh package, or one written with the plugin installed
            return original(*bound.args, **bound.kwargs)
        fn = bound.arguments.get("fn")
        _refuse(packages, _where(getattr(fn, "__code__", None)), sum(len(entry.guarded_codes) for entry in saved))
        bound.arguments["dynamo"] = packages.with_codes(dynamo, [packages.bypassed(codes[0])])
        return original(*bound.args, **bound.kwargs)

    return initialize


def _unload_packages_loaded_before(packages: Any) -> None:
    loaded = []  # each live package whose saved frames are loaded now, with the code objects that hold them
    for package in packages.live():
        codes = [c for c in packages.codes(package) if packages.loaded_entries(c)]
        if codes:
            loaded.append((package, codes))
    for package, codes in loaded:  # every refusal first: under strict_precompile, raise before changing any
        entries = packages.codes(package)
        _refuse(packages, _where(next(iter(entries))), sum(len(entries[c].guarded_codes) for c in codes))
    for package, _ in loaded:
        packages.unload(package)
        entries = packages.codes(package)
        function_code, entry = next(iter(entries.items()))
        entries.clear()
        entries[function_code] = packages.bypassed(entry)


def install(patches: Patcher) -> None:
    """Never run a frame loaded from a precompile package while the plugin is installed (NOTE [precompile
    packages written without the plugin]): unload those loaded already, bypass those loaded later.

    Raises:
        torch._dynamo.exc.PackageError: under ``strict_precompile``, a package's saved frames are loaded now.
    """
    packages = _compat.precompile_packages()
    if packages is None:
        if hasattr(torch._dynamo.config, "caching_precompile"):
            log.warning(
                "Dynamo's precompile packages are not as dynamo_ext.guards.precompile_load reads them: frames a "
                "package loads with caching_precompile on run without the guards the plugin keeps"
            )
        return
    if packages.used():
        _unload_packages_loaded_before(packages)
    cls = packages.package_class
    patches.setattr(cls, "initialize", _loaded_without_saved_frames(cls.initialize, packages))
