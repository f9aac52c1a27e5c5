"""Symmetric memory (``torch.distributed._symmetric_memory``): whether a build has it and how a group gets it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "ensure_symm_mem_for_group",
    "forget_symm_mem_groups",
    "is_symm_mem_enabled_for_group",
    "is_symm_mem_tensor",
    "symm_mem_module",
    "symm_mem_registered",
    "symm_mem_rendezvous",
    "symm_mem_route",
    "symm_mem_state_key",
    "symm_mem_test_mode",
]


def symm_mem_module() -> Any:
    """``torch.distributed._symmetric_memory`` or None where this build lacks it."""
    try:
        return importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return None


def is_symm_mem_enabled_for_group(group_name: str) -> bool:
    """Stock's own test for ``group_name``, whose meaning changed: up to 2.13, whether the group is in the registry
    ``enable_symm_mem_for_group`` writes; on 2.15, whether this process's accelerator has a symmetric-memory
    backend and the group is a registered process group (False on a CPU-only process).  Neither is a fact every
    rank shares, so no decision reads it (NOTE [symmetric memory route])."""
    mod = symm_mem_module()
    fn = getattr(mod, "is_symm_mem_enabled_for_group", None)
    return bool(fn is not None and fn(group_name))


def symm_mem_registered(group_name: str) -> bool:
    """Whether ``group_name`` is in the registry ``enable_symm_mem_for_group`` writes (``_group_name_to_store``,
    2.11 to 2.15): what that call changed on this rank, whatever ``is_symm_mem_enabled_for_group`` means here."""
    registry = getattr(symm_mem_module(), "_group_name_to_store", None)
    return isinstance(registry, dict) and group_name in registry


def symm_mem_state_key() -> str:
    """A string that changes when the set of symmetric-memory groups changes (for pass uuids)."""
    mod = symm_mem_module()
    groups = sorted(getattr(mod, "_group_name_to_store", {}) or {})
    test_mode = getattr(mod, "_is_test_mode", False)
    return f"symm:{groups}:{test_mode}:{getattr(mod, '_mocked_group_names', None)}"


def symm_mem_test_mode() -> Callable[..., Any] | None:
    """``_symmetric_memory._test_mode`` (forces the enabled check; tests only) or None."""
    return getattr(symm_mem_module(), "_test_mode", None)


def symm_mem_rendezvous(tensor: torch.Tensor, group_name: str) -> Any:
    """``_symmetric_memory.rendezvous(tensor, group_name)``; raises RuntimeError when not a symm tensor."""
    return symm_mem_module().rendezvous(tensor, group_name)


# NOTE [symmetric memory route]
# Where ``enable_symm_mem_for_group`` exists and is not marked deprecated (2.11, 2.12),
# a group must be registered with it before Inductor's ``empty_strided_p2p`` can
# allocate for it; where it is deprecated (2.13+, "there is no need to call this
# function anymore") or gone, every group is set up on first rendezvous.  On 2.13
# ``is_symm_mem_enabled_for_group`` only reflects the deprecated registry; on 2.15 it
# asks whether this process's accelerator has a symmetric-memory backend (False on a
# CPU-only process, whatever was registered).  Either way the decision to fuse never
# reads it: it depends only on what every rank shares (the graph, the options, the
# build), and the registration is a side effect of the decision.  Whether a group is
# registered is read from the registry itself (:func:`symm_mem_registered`), so
# registering stays once per group on every release.
_ENABLED_BY_US: set[str] = set()


def symm_mem_route() -> str:
    """How a group gets symmetric memory on this build (NOTE [symmetric memory route]).

    ``"none"``: no symmetric memory here (no ``_symmetric_memory`` module or no
    ``rendezvous``); ``"enable"``: ``enable_symm_mem_for_group`` must be called once per
    group; ``"automatic"``: nothing to call.
    """
    mod = symm_mem_module()
    if mod is None or getattr(mod, "rendezvous", None) is None:
        return "none"
    enable = getattr(mod, "enable_symm_mem_for_group", None)
    if enable is None or getattr(enable, "__deprecated__", None) is not None:
        return "automatic"
    return "enable"


def ensure_symm_mem_for_group(group_name: str) -> None:
    """Set ``group_name`` up for symmetric memory by this release's route; idempotent.

    Raises RuntimeError (naming the group and the fix) where the route fails: the
    caller has already decided to fuse on every rank, so this rank must not quietly
    take another path.
    """
    route = symm_mem_route()
    if route == "none":
        raise RuntimeError(f"symmetric memory is not available in this torch build (group {group_name!r})")
    if route == "automatic" or symm_mem_registered(group_name):
        return
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem_module().enable_symm_mem_for_group(group_name)
    except (TypeError, RuntimeError, KeyError, ValueError) as e:
        raise RuntimeError(
            f"dynamo_ext: could not set up symmetric memory for process group {group_name!r} on this rank "
            f"({type(e).__name__}: {e}); the fused all-reduce kernels need it on every rank. Turn them off on "
            "every rank with dynamo_ext.inductor_lowerings.options.one_shot = False"
        ) from e
    _ENABLED_BY_US.add(group_name)


def forget_symm_mem_groups() -> None:
    """Drop the groups :func:`ensure_symm_mem_for_group` registered from the Python registry (uninstall)."""
    registry = getattr(symm_mem_module(), "_group_name_to_store", None)
    for name in _ENABLED_BY_US:
        if registry is not None:
            registry.pop(name, None)
    _ENABLED_BY_US.clear()


def is_symm_mem_tensor(tensor: torch.Tensor) -> bool | None:
    """Whether ``tensor`` was allocated from symmetric memory; None where this build cannot tell (no probe)."""
    fn = getattr(symm_mem_module(), "is_symm_mem_tensor", None)
    return None if fn is None else bool(fn(tensor))
