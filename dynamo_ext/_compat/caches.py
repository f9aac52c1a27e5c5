"""The compilers' caches: AOTAutograd's (``AOTAutogradCache``) as the collective check uses it, and Dynamo's
precompile packages (``torch._dynamo.package``) as the plugin refuses those written without it (NOTE
[precompile packages written without the plugin] in ``dynamo_ext/guards/precompile_load.py``).  Each function is
a feature probe (a name, a signature, an attribute), never a torch version comparison.

What the collective check relies on (NOTE [collective records beside AOTAutograd's cache]):

* ``AOTAutogradCache._lookup(key, local, remote, args, cache_info, aot_config)``,
  a staticmethod returning ``(entry, pickled_entry)`` on a hit and ``None`` on a
  miss, called once by ``AOTAutogradCache.try_load`` after it computed the key
  (torch 2.11 to 2.15 alike);
* ``AOTAutogradCache._get_tmp_dir()``: the cache's directory (``<cache_dir>/aotautograd``);
* on a hit, AOTAutograd loads the backward through ``entry.compiled_bw.post_compile(compiled, fx_config)``
  (``GenericAOTAutogradResult._load_and_post_compile``), once per load.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import inspect
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo import exc as _exc
from torch._dynamo import guards as _guards

from .dynamo import output_graph_class
from .probes import optional_attr

__all__ = [
    "PrecompilePackages",
    "aot_cache_class",
    "cache_custom_autograd_functions",
    "cache_key_pickler_class",
    "compiled_graph_attributes",
    "custom_autograd_function_switch_on",
    "entry_has_backward",
    "has_custom_autograd_function_switch",
    "is_autograd_function_apply",
    "lookup_as_attribute",
    "lookup_function",
    "precompile_cache_classes",
    "precompile_packages",
    "records_dir",
    "wrap_cached_backward",
]

_LOOKUP_PARAMS = ("key", "local", "remote", "args", "cache_info", "aot_config")


@functools.cache
def aot_cache_class() -> Any | None:
    """``AOTAutogradCache`` when it has the ``_lookup`` and ``_get_tmp_dir`` the check hooks; else ``None``."""
    try:
        module = importlib.import_module("torch._functorch._aot_autograd.autograd_cache")
    except ImportError:
        return None
    cls = getattr(module, "AOTAutogradCache", None)
    raw = getattr(cls, "__dict__", {}).get("_lookup")
    if not isinstance(raw, staticmethod) or not callable(getattr(cls, "_get_tmp_dir", None)):
        return None
    try:
        params = tuple(inspect.signature(raw.__func__).parameters)
    except (TypeError, ValueError):
        return None
    return cls if params[: len(_LOOKUP_PARAMS)] == _LOOKUP_PARAMS else None


def lookup_function() -> Callable[..., Any]:
    """``AOTAutogradCache._lookup`` as a plain function (call only when :func:`aot_cache_class` is not ``None``)."""
    return _cache_class()._lookup


def lookup_as_attribute(fn: Callable[..., Any]) -> Any:
    """``fn`` in the form ``AOTAutogradCache._lookup`` is stored in (a staticmethod)."""
    return staticmethod(fn)


def records_dir() -> str:
    """A directory beside AOTAutograd's cache (same ``TORCHINDUCTOR_CACHE_DIR``, same lifetime) for our records."""
    return os.path.join(os.path.dirname(_cache_class()._get_tmp_dir()), "dynamo_ext_collectives")


def _cache_class() -> Any:
    cls = aot_cache_class()
    assert cls is not None, "AOTAutogradCache is not what the collective check expects: probe aot_cache_class() first"
    return cls


def entry_has_backward(entry: Any) -> bool:
    """Whether an ``AOTAutogradCache`` entry holds a compiled backward (a training graph, not an inference one)."""
    return getattr(entry, "compiled_bw", None) is not None


def wrap_cached_backward(entry: Any, wrap: Callable[[Any], Any]) -> bool:
    """Make AOTAutograd's load of ``entry``'s backward return ``wrap(compiled_backward)``.

    Sets ``post_compile`` on the entry's own ``compiled_bw`` object (the entry is
    unpickled afresh for each lookup, so no other load sees it).  Returns False,
    changing nothing, when the entry has no backward in that form.
    """
    backward = getattr(entry, "compiled_bw", None)
    post_compile = getattr(backward, "post_compile", None)
    if backward is None or not callable(post_compile) or not hasattr(backward, "__dict__"):
        return False

    @functools.wraps(post_compile)
    def checked_post_compile(result: Any, fx_config: Any) -> Any:
        return wrap(post_compile(result, fx_config))

    object.__setattr__(backward, "post_compile", checked_post_compile)
    return True


def compiled_graph_attributes(compiled: Any) -> dict[str, Any]:
    """What AOTAutograd's cache reads from a compiled forward or backward besides calling it.

    ``_fx_graph_cache_key`` (without it no entry is saved), ``_fx_graph_cache_debug_lines``,
    ``guards_expr``, ``_time_taken_ns``: the callable's ``__dict__``, as ``functools.wraps``
    (and ``torch._dynamo.disable``, which AOTAutograd's backends wrap the backward in) copy it.
    """
    return dict(getattr(compiled, "__dict__", None) or {})


@functools.cache
def cache_key_pickler_class() -> Any | None:
    """Inductor's ``FxGraphCachePickler`` when it has a ``reducer_override`` of its own; else ``None``.

    The pickler both Inductor's FX graph cache and AOTAutograd's cache (``AOTAutogradCachePickler``, a
    subclass whose ``reducer_override`` falls back to this one's) hash their keys with.  ``pickle`` calls
    ``reducer_override`` for every object it meets before its dispatch table (torch 2.11 to 2.15).
    """
    try:
        module = importlib.import_module("torch._inductor.codecache")
    except ImportError:
        return None
    cls = getattr(module, "FxGraphCachePickler", None)
    own = getattr(cls, "__dict__", {}).get("reducer_override")
    return cls if inspect.isfunction(own) else None


def _functorch_config() -> Any:
    return importlib.import_module("torch._functorch.config")


def has_custom_autograd_function_switch() -> bool:
    """Whether ``torch._functorch.config.autograd_cache_allow_custom_autograd_functions`` exists."""
    return hasattr(_functorch_config(), "autograd_cache_allow_custom_autograd_functions")


def custom_autograd_function_switch_on() -> bool:
    """Whether the user already lets AOTAutograd's cache serve graphs with custom ``autograd.Function`` calls."""
    return bool(getattr(_functorch_config(), "autograd_cache_allow_custom_autograd_functions", False))


def cache_custom_autograd_functions() -> Any:
    """Context manager: AOTAutograd's cache serves graphs with custom ``autograd.Function`` calls."""
    return _functorch_config().patch(autograd_cache_allow_custom_autograd_functions=True)


def is_autograd_function_apply(target: Any) -> bool:
    """Whether an FX node target is Dynamo's ``autograd_function_apply`` higher-order op (a custom Function)."""
    cls = getattr(importlib.import_module("torch._functorch.autograd_function"), "AutogradFunctionApply", None)
    return cls is not None and isinstance(target, cls)


def precompile_cache_classes() -> tuple[type, type] | None:
    """``(OutputGraph, CheckFunctionManager)`` where Dynamo has its precompile cache; else None.

    Probes ``torch._dynamo.config.caching_precompile`` (``TORCH_CACHING_PRECOMPILE=1``: a frame's guards and
    graphs saved by ``torch.compiler.save_cache_artifacts()`` and loaded by a restarted job) and
    ``OutputGraph.bypass_package`` (leave the frame being compiled out of the package), and
    ``CheckFunctionManager``'s ``output_graph`` and ``save_guards`` parameters.  All are on 2.13.
    """
    if not hasattr(torch._dynamo.config, "caching_precompile"):
        return None
    output_graph = output_graph_class()
    if not callable(getattr(output_graph, "bypass_package", None)):
        return None
    manager = _guards.CheckFunctionManager
    if not {"output_graph", "save_guards"} <= set(inspect.signature(manager.__init__).parameters):
        return None
    return output_graph, manager


class PrecompilePackages:
    """Dynamo's precompile packages (``torch._dynamo.package``): the frames a loaded package brings in.

    A package is what ``torch.compiler.save_cache_artifacts()`` writes with ``caching_precompile`` on, one per
    compiled function: per code object (the function's own first, then its resume functions and user functions
    Dynamo compiled on their own) a ``_DynamoCodeCacheEntry`` with the saved guards and bytecode
    (``guarded_codes``), the backends they call and a ``bypassed`` flag that makes ``CompilePackage.install``
    leave the code to be traced again.  ``CompilePackage.initialize(fn, dynamo)`` turns a loaded
    ``_DynamoCacheEntry`` into the package's frames (``torch.compile()`` with ``caching_precompile``,
    ``DynamoCache.load_and_install_package``, ``DynamoStore.load_package``); ``install`` then loads them onto
    the code objects as precompile entries, which the C frame evaluator runs before it asks Dynamo.
    """

    def __init__(self, package_class: type) -> None:
        self.package_class = package_class
        """``CompilePackage``."""

    @staticmethod
    def error(message: str) -> Exception:
        """Dynamo's ``PackageError`` (what ``strict_precompile`` raises for a frame left out of a package)."""
        return _exc.PackageError(message)

    @staticmethod
    def codes(package: Any) -> dict[types.CodeType, Any]:
        """A package's code objects and their entries (its ``_codes``, the dict itself); empty before
        ``initialize``."""
        return package._codes

    @staticmethod
    def runs_saved_frames(entry: Any) -> bool:
        """Whether ``CompilePackage.install`` loads ``entry``'s saved guards and bytecode onto its code object."""
        return bool(entry.guarded_codes) and not entry.bypassed

    @staticmethod
    def bypassed(entry: Any) -> Any:
        """A copy of ``entry`` that ``install`` leaves to be traced again: bypassed, without its saved frames
        and their backends (as 2.15's ``initialize`` loads a bypassed entry), its other lists and dicts copied
        so the caller's entry (a store may hand out its own) is not changed by later compiles."""
        changes: dict[str, Any] = {"bypassed": True, "guarded_codes": [], "backend_ids": []}
        for f in dataclasses.fields(entry):
            value = getattr(entry, f.name)
            if f.name not in changes and isinstance(value, list | dict):
                changes[f.name] = type(value)(value)
        return dataclasses.replace(entry, **changes)

    @staticmethod
    def with_codes(dynamo: Any, codes: list[Any]) -> Any:
        """A copy of a loaded ``_DynamoCacheEntry`` with ``codes`` in place of its code entries."""
        return dataclasses.replace(dynamo, codes=codes)

    @staticmethod
    def loaded_entries(code: types.CodeType) -> int:
        """How many precompile entries (saved frames ``install`` loaded) ``code`` holds now."""
        from torch._C._dynamo.eval_frame import _debug_get_precompile_entries

        return len(_debug_get_precompile_entries(code))

    def unload(self, package: Any) -> None:
        """Unload what ``package.install`` loaded: its globals (backends, resume functions), the precompile
        entries of every code object it holds (``uninstall`` resets only the function's own), and the
        builtins-dict global each saved frame's guards read, which ``install`` sets in the module itself (left
        there, it is the name a process that never compiled takes first: on 2.13 a trace of the function then
        fails, "Name '__builtins_dict___0' already exists in scope")."""
        from torch._C._dynamo.eval_frame import _reset_precompile_entries
        from torch._dynamo.output_graph import get_builtins_dict
        from torch._dynamo.package import load_guards_state

        package.uninstall()
        for code, entry in self.codes(package).items():
            _reset_precompile_entries(code)
            module = sys.modules.get(entry.python_module)
            if module is None or entry.bypassed:
                continue
            scope = module.__dict__
            for guarded in entry.guarded_codes:
                name = load_guards_state(guarded.guards_state).output_graph.name_of_builtins_dict_key_in_fglobals
                if name and scope.get(name) is get_builtins_dict(scope):
                    del scope[name]

    def live(self) -> list[Any]:
        """The packages alive in this process (each compiled function's, held by its ``torch.compile``
        wrapper).  A heap type's instances refer to their class, so this scans the objects that refer to it
        (about 50 ms in a process that imported torch), not every object."""
        return [o for o in gc.get_referrers(self.package_class) if issubclass(type(o), self.package_class)]

    @staticmethod
    def used() -> bool:
        """Whether this process may hold packages: ``caching_precompile`` is on, or a backend artifact was
        recorded (each package compiled or loaded records its backends in ``PrecompileContext``)."""
        if getattr(torch._dynamo.config, "caching_precompile", False):
            return True
        context = optional_attr("torch._dynamo.precompile_context", "PrecompileContext")
        return bool(getattr(context, "_backend_artifacts_by_key", None))


def precompile_packages() -> PrecompilePackages | None:
    """:class:`PrecompilePackages` where a loaded package's frames can be read and dropped; else None.

    Probes ``CompilePackage.initialize(fn, dynamo, ...)`` and ``uninstall``, the entry's ``guarded_codes``,
    ``backend_ids`` and ``bypassed`` dataclass fields, ``load_guards_state`` and ``get_builtins_dict`` (a saved
    frame's guards and the builtins dict they read), and the frame evaluator's ``_debug_get_precompile_entries``
    and ``_reset_precompile_entries``.  All are on 2.13 and 2.15.
    """
    package = optional_attr("torch._dynamo.package", "CompilePackage")
    entry = optional_attr("torch._dynamo.package", "_DynamoCodeCacheEntry")
    if package is None or entry is None or not dataclasses.is_dataclass(entry):
        return None
    if not {"guarded_codes", "backend_ids", "bypassed"} <= {f.name for f in dataclasses.fields(entry)}:
        return None
    initialize = getattr(package, "initialize", None)
    if not callable(initialize) or "dynamo" not in inspect.signature(initialize).parameters:
        return None
    needed = [
        ("torch._dynamo.package", "load_guards_state"),
        ("torch._dynamo.output_graph", "get_builtins_dict"),
        ("torch._C._dynamo.eval_frame", "_debug_get_precompile_entries"),
        ("torch._C._dynamo.eval_frame", "_reset_precompile_entries"),
    ]
    if not callable(getattr(package, "uninstall", None)) or any(optional_attr(m, n) is None for m, n in needed):
        return None
    return PrecompilePackages(package)
