"""Recompile reasons in words for dynamo-ext guards.

Dynamo prints a failed lambda guard as its verbose code part.  Ours is a
marker (``spec.marker``); the check stored the difference in
``spec.FAILURES`` when it failed, and the wrapper below swaps one for the other
in what ``TORCH_LOGS=recompiles`` prints and what ``torch._dynamo`` records.
"""

from __future__ import annotations

import re
from typing import Any

from .. import _compat
from .._patching import Patcher
from .spec import FAILURES

_MARKER = re.compile(r"__dynamo_ext_guard_(\d+)")


def explain(reason: str) -> str:
    """Replace every guard marker in ``reason`` by the recorded difference."""
    return _MARKER.sub(lambda m: FAILURES.get(m.group(1), m.group(0)), reason)


def hook_fail_reasons(patches: Patcher) -> None:
    """Wrap Dynamo's guard-failure reason builder with :func:`explain`."""
    module, name = _compat.guard_fail_reason_owner()
    orig = getattr(module, name)

    def helper(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        return explain(out) if isinstance(out, str) else out

    patches.setattr(module, name, helper)
