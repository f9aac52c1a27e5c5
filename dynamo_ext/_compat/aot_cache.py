"""AOTAutograd's cache (``AOTAutogradCache``) as the collective check uses it: the private parts, probed once.

Kept apart from :mod:`dynamo_ext._compat` only while that module is being split
into a package; it belongs there.  Each function is a feature probe (a name, a
signature, an attribute), never a torch version comparison.

What the check relies on (NOTE [collective records beside AOTAutograd's cache]):

* ``AOTAutogradCache._lookup(key, local, remote, args, cache_info, aot_config)``,
  a staticmethod returning ``(entry, pickled_entry)`` on a hit and ``None`` on a
  miss, called once by ``AOTAutogradCache.try_load`` after it computed the key
  (torch 2.11 to 2.15 alike);
* ``AOTAutogradCache._get_tmp_dir()``: the cache's directory (``<cache_dir>/aotautograd``);
* on a hit, AOTAutograd loads the backward through ``entry.compiled_bw.post_compile(compiled, fx_config)``
  (``GenericAOTAutogradResult._load_and_post_compile``), once per load.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

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
