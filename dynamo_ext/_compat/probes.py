"""The generic probe (an attribute of a torch module that some releases lack), and torch's config modules
(``torch.utils._config_module``, as ``torch._dynamo.config`` is made).

Every release difference dynamo-ext handles is a feature probe (an import
attempt, ``hasattr``, a signature check), never a comparison of version
strings, so a point release that back-ports a feature is handled too.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from typing import Any

__all__ = [
    "config_defaults",
    "config_module",
    "install_checked_config_module",
    "optional_attr",
]


def optional_attr(module: str, name: str) -> Any:
    """``module.name`` or ``None`` when this torch release lacks it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def config_module() -> tuple[Any, Any]:
    """``(install_config_module, Config)`` from ``torch.utils._config_module`` (what torch's own configs use)."""
    mod = importlib.import_module("torch.utils._config_module")
    return mod.install_config_module, mod.Config


def install_checked_config_module(module: Any, check: Callable[[str, object], None]) -> None:
    """Make ``module`` a torch config module whose every write (attribute, ``patch``, ``load_config``) is checked.

    ``check(name, value)`` runs before a value is stored and raises to refuse it; the
    config module's own bookkeeping attributes are written unchecked.  Reading an unknown
    public name calls ``check(name, None)`` too, which must raise ``AttributeError`` for it.
    """
    install, _ = config_module()
    install(module)
    base = type(module)
    bypass = frozenset(getattr(base, "_bypass_keys", ()))

    class CheckedConfigModule(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: object) -> None:
            if name not in bypass:
                check(name, value)
            super().__setattr__(name, value)

        def __getattr__(self, name: str) -> Any:
            if not name.startswith("_") and name not in self._config:
                check(name, None)  # an unknown option (read, or patched: patch reads first): check's error
            return super().__getattr__(name)

    types.ModuleType.__setattr__(module, "__class__", CheckedConfigModule)  # the config module refuses it


def config_defaults(module: Any) -> dict[str, Any]:
    """``{name: default}`` of a torch config module's settings, in definition order."""
    return {name: entry.default for name, entry in module._config.items()}
