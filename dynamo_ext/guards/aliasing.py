"""Object-aliasing guards (``a is b``) built as Dynamo's C++ relational guards while the plugin compiles a frame.

NOTE [object-aliasing guards in C++]
Dynamo guards that two sources it found the same object under still are
(``L['m'].layers[0]._fsdp_state._mp_policy is L['m'].layers[1]...``).  With
``torch._dynamo.config.use_lamba_guard_for_object_aliasing`` (on by default
on 2.13) it compiles all of a frame's aliasing guards into one Python
lambda run after the other guards, so that they do not keep dict guard
managers from the recursive dict-tag fast path; its docs call such guards
rare.  FSDP2 blocks have about 20 each (their modules, param groups, mesh
and policy objects reached along several paths), and building the lambda
(``build_guard_function``: parse, common-subexpression count, unparse) grows
with their number.  Off, each is a relational guard in the guard tree.

Measured on the bundled Llama (FSDP over TP, fake group, one process,
``aot_eager``, torch 2.13, 2026-11-27), three runs each at 16 layers:
building the guards took 1.18-1.23 s as relational guards against
1.81-1.88 s as the lambda; one evaluation of the frame's guards
(``GuardManager.check``, the mean of 2000) took 1.67-2.04 ms against 1.77-1.92 ms.  So while the
plugin compiles a frame (``convert_frame._compile``) with
``config.aliasing_guards_in_cpp`` on (the default), Dynamo's switch reads
False; the user's value is back when the compile returns.  The guards are the
same checks either way.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from .. import _compat, config
from .._patching import Patcher

log = logging.getLogger(__name__)

_SWITCH = "use_lamba_guard_for_object_aliasing"  # (sic) Dynamo's name


def install(patches: Patcher) -> None:
    """Wrap ``convert_frame._compile`` (NOTE [object-aliasing guards in C++]); a no-op on a release without the switch."""
    if not hasattr(torch._dynamo.config, _SWITCH):
        log.debug("torch._dynamo.config has no %s: aliasing guards are built as this release builds them", _SWITCH)
        return
    convert_frame = _compat.dynamo_convert_frame()
    original = convert_frame._compile

    @functools.wraps(original)
    def _compile(*args: Any, **kwargs: Any) -> Any:
        if not config.aliasing_guards_in_cpp or not getattr(torch._dynamo.config, _SWITCH):
            return original(*args, **kwargs)
        log.debug("object-aliasing guards of this frame built as relational guards (%s=False)", _SWITCH)
        with torch._dynamo.config.patch({_SWITCH: False}):
            return original(*args, **kwargs)

    patches.setattr(convert_frame, "_compile", _compile)
