"""Guards on empty module backward hook dicts, so a hook registered after compiling recompiles.

Stock Dynamo guards an empty ``_backward_hooks`` / ``_backward_pre_hooks``
dict with ``EMPTY_NN_MODULE_HOOKS_DICT``, which does nothing while
``torch._dynamo.config.skip_nnmodule_hook_guards`` is True (the default): a
backward hook registered after the first compile was silently ignored
(pytorch#117265).  For those two dicts we install Dynamo's C++ dict-length
guard, whose failure text (the recompile reason) says what changed in words;
the other hook dicts keep stock's rule.
Non-empty dicts are already guarded by Dynamo's dict guards.  The global
dicts (``register_module_full_backward_hook`` / ``_pre_hook``) get only a
type guard from stock Dynamo; with the first module hook dict guard of a frame
we add one guard on the keys of both global dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import _compat
from .._patching import Patcher
from .spec import FAILURES, _keys, marker

BACKWARD_HOOK_DICTS = ("_backward_hooks", "_backward_pre_hooks")


def describe_late_hook(label: str) -> str:
    """The recompile reason for a backward hook dict that was empty at compile time and is not now."""
    return f"{label}: module backward hooks changed: compiled with none, now some are registered"


def global_hook_keys() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The handle ids of the global full backward hooks and backward pre-hooks."""
    from torch.nn.modules import module

    return tuple(module._global_backward_hooks), tuple(module._global_backward_pre_hooks)


def make_global_check(key: str) -> Callable[[Any], bool]:
    """A guard check: True while the global backward hook dicts hold the same hooks as now."""
    expected = global_hook_keys()

    def check(_: Any) -> bool:
        actual = global_hook_keys()
        if actual == expected:
            return True
        FAILURES[key] = (
            "global module backward hooks changed: "
            f"{len(expected[0])} -> {len(actual[0])} full backward hooks, "
            f"{len(expected[1])} -> {len(actual[1])} backward pre-hooks "
            "(register_module_full_backward_hook / _pre_hook after compiling)"
        )
        return False

    return check


def install(patches: Patcher) -> None:
    """Make ``GuardBuilder.EMPTY_NN_MODULE_HOOKS_DICT`` guard the backward hook dicts always."""
    builder_cls = _compat.GuardBuilder
    orig = builder_cls.EMPTY_NN_MODULE_HOOKS_DICT

    def EMPTY_NN_MODULE_HOOKS_DICT(self: Any, guard: Any) -> None:  # noqa: N802  (Dynamo's name)
        if not guard.name.endswith(BACKWARD_HOOK_DICTS):
            return orig(self, guard)
        _compat.empty_dict_guard(self, guard, describe_late_hook(guard.name))
        if not getattr(self, "_dynamo_ext_global_hooks_guarded", False):
            self._dynamo_ext_global_hooks_guarded = True
            key = str(next(_keys))
            _compat.root_lambda_guard(self, guard, make_global_check(key), marker(key))
        return None

    patches.setattr(builder_cls, "EMPTY_NN_MODULE_HOOKS_DICT", EMPTY_NN_MODULE_HOOKS_DICT)
