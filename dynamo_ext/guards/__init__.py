"""Guards on distributed objects: pure extract/check pairs plus installers.

``guards/`` imports no VariableTracker; trackers call :func:`install_spec_guard`
with one of the specs in :mod:`.objects`.
"""

from __future__ import annotations

from typing import Any

from .._patching import Patcher
from .objects import DEVICE_MESH, DTENSOR_SPEC, PLACEMENT, PROCESS_GROUP
from .spec import GuardSpec, install_spec_guard

__all__ = ["DEVICE_MESH", "DTENSOR_SPEC", "PLACEMENT", "PROCESS_GROUP", "GuardSpec", "install", "install_spec_guard"]


def install(patches: Patcher) -> None:
    """Recompile reasons in words, aliasing guards in C++, every guard kept under Dynamo's precompile cache (and
    no frame loaded from it), and stock's DTensor spec guard replaced by ours."""
    from .. import _compat
    from . import aliasing, precompile_cache, precompile_load
    from .reasons import hook_fail_reasons
    from .spec import _guard_fn

    hook_fail_reasons(patches)
    aliasing.install(patches)  # NOTE [object-aliasing guards in C++]
    precompile_cache.install(patches)  # NOTE [frames kept out of the precompile cache]
    precompile_load.install(patches)  # NOTE [precompile packages written without the plugin]
    dtensor_guard = _guard_fn(DTENSOR_SPEC)

    def DTENSOR_SPEC_MATCH(self: Any, guard: Any) -> None:  # noqa: N802  (Dynamo's name)
        dtensor_guard(self, guard)

    patches.setattr(_compat.GuardBuilder, "DTENSOR_SPEC_MATCH", DTENSOR_SPEC_MATCH)
