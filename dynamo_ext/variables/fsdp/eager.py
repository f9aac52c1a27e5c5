"""Where FSDP2's eager hooks would meet compiled code: trace them, or refuse loudly.

Two patches (through ``_patching``, undone by ``uninstall()``):

- ``torch.compile(fsdp_module)``: Dynamo's ``OptimizedModule`` runs a module's
  hooks outside the compiled frame and compiles only ``forward``
  (``torch/_dynamo/eval_frame.py``, "Invoke hooks outside of dynamo"), so the
  FSDP2 hooks of the compiled module itself would run eagerly.  For an
  ``FSDPModule`` the plugin compiles the whole call instead (the same path as
  ``torch._dynamo.config.wrap_top_frame``), so its hooks are traced with the
  gradient reduction of NOTE [FSDP2 gradients in traced graphs].
- Compiled autograd meeting FSDP2's *eager* backward hooks (a module whose
  forward ran eagerly, or broke the graph at a setting the plugin does not
  trace): FSDP2 on torch 2.12-2.15 then leaves gradients unreduced and
  parameters unsharded without any error (2.11 asserts).  The hooks that start
  FSDP2's backward raise a ``RuntimeError`` instead when they run inside a
  compiled-autograd graph.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ... import _compat
from ..._patching import Patcher

log = logging.getLogger(__name__)

COMPILED_AUTOGRAD_MESSAGE = (
    "FSDP2's eager backward hook {hook} ran under compiled autograd, where FSDP2 neither reduce-scatters "
    "gradients nor reshards parameters (the gradients would be unreduced full tensors). Its forward ran "
    "eagerly: either the module was not compiled, or dynamo-ext broke the graph at an FSDP2 setting it does "
    "not trace (see the 'dynamo_ext: FSDP2 setting not traced' graph break). Compile the model's forward with "
    "dynamo_ext installed (torch.compile(model), fullgraph=True shows any break), or run this backward "
    "without compiled autograd."
)


def _refuse_under_compiled_autograd(fn: Any, hook: str) -> Any:
    import torch

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _compat.in_compiled_autograd_region():
            raise RuntimeError(COMPILED_AUTOGRAD_MESSAGE.format(hook=hook))
        return fn(*args, **kwargs)

    # Like the hook it wraps (FSDP2's _dynamo_disable): runs eagerly, never traced.
    return torch._dynamo.disable(wrapper)


def _patch_optimized_module(patches: Patcher, fsdp_module: type) -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    original = OptimizedModule.__dict__["_initialize"]

    def _initialize(self: Any) -> None:
        original(self)
        if isinstance(self._orig_mod, fsdp_module) and _compat.is_compiling_context(self.dynamo_ctx):
            log.debug("torch.compile(%s): tracing its FSDP2 hooks", type(self._orig_mod).__name__)
            self.forward = self.dynamo_ctx(_compat.wrap_inline(self._orig_mod))
            if hasattr(self._orig_mod, "_initialize_hook"):
                self._forward = self.forward
                self.forward = self._call_lazy_check

    patches.setattr(OptimizedModule, "_initialize", _initialize)


def install(patches: Patcher) -> None:
    """Apply both patches when this torch release has FSDP2."""
    state_cls = _compat.fsdp_state_class()
    group_cls = _compat.fsdp_param_group_class()
    fsdp_module = _compat.fsdp_module_class()
    if state_cls is None or group_cls is None or fsdp_module is None:
        return
    _patch_optimized_module(patches, fsdp_module)
    for owner, name in ((state_cls, "_pre_backward"), (group_cls, "post_backward"), (group_cls, "pre_backward")):
        fn = owner.__dict__.get(name)
        if fn is not None:
            patches.setattr(owner, name, _refuse_under_compiled_autograd(fn, f"{owner.__name__}.{name}"))
