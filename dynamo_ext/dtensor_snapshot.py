"""``make_fx`` records a fake DTensor's metadata without dispatching ``detach`` through DTensor.

NOTE [fake DTensor snapshots]
Each value ``make_fx`` traces is copied into its node's ``meta["val"]`` by
``proxy_tensor.snapshot_fake``: a ``FakeTensor`` through ``fast_detach``, any
other tensor by ``.detach()``.  For a DTensor ``.detach()`` goes through
DTensor's dispatcher, and with symbolic sizes its sharding-propagation cache
misses, so each call runs the op on fake arguments to work out the output's
metadata (``_propagate_tensor_meta_non_cached``).  Compiled autograd traces
the backward with symbolic sizes and binds every FSDP2 gradient it accumulates
(a DTensor) this way: on the bundled Llama (FSDP over TP, fake group, one
process, torch 2.13) that took 3.9 s of a 32 s compiled-autograd backward at
32 layers, 4.5 ms a call, growing with the depth.

The detach of a DTensor is its local tensor detached, under the same spec
(DTensor's rule for ``aten.detach`` keeps the input's placements, and the
shape and stride do not change), not requiring grad.  So for a DTensor whose
local tensor is fake, we snapshot the local tensor as ``snapshot_fake`` does
(``fast_detach``) and wrap it in a DTensor with the input's spec
(``_compat.dtensor_around``).  Every other value goes to the original.
``tests/test_dtensor_snapshot.py`` compares the two on Shard, Replicate and
Partial DTensors with static and symbolic sizes: spec, requires_grad, local
shape, stride, dtype, storage offset and fake mode.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from . import _compat
from ._patching import Patcher

log = logging.getLogger(__name__)


def install(patches: Patcher) -> None:
    """Wrap ``proxy_tensor.snapshot_fake`` (NOTE [fake DTensor snapshots]); a no-op on a release without it."""
    module = _compat.proxy_tensor_module()
    original = getattr(module, "snapshot_fake", None)
    is_fake = getattr(module, "is_fake", None)
    if original is None or is_fake is None:
        log.debug("make_fx has no snapshot_fake/is_fake on this release; DTensor snapshots dispatch detach")
        return

    @functools.wraps(original)
    def snapshot_fake(val: Any, include_real: bool = False) -> Any:
        local = getattr(val, "_local_tensor", None)
        if local is not None and is_fake(local) and not _compat.is_traceable_subclass(local):
            snapshot = _compat.dtensor_around(val, original(local, include_real=include_real))
            if snapshot is not None:
                return snapshot
        return original(val, include_real=include_real)

    patches.setattr(module, "snapshot_fake", snapshot_fake)
