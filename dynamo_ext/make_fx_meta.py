"""What ``make_fx`` records for each traced value, made cheaper where it grows with depth.

Two parts, each its own patch of ``torch.fx.experimental.proxy_tensor``: a fake DTensor's snapshot
(NOTE [fake DTensor snapshots]) and the tensor metadata of compiled autograd's capture (NOTE
[compiled autograd's capture keeps no memory format]).

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
``tests/test_make_fx_meta.py`` compares the two on Shard, Replicate and
Partial DTensors with static and symbolic sizes: spec, requires_grad, local
shape, stride, dtype, storage offset and fake mode.

NOTE [compiled autograd's capture keeps no memory format]
``proxy_tensor.set_meta`` also stores each traced tensor's ``tensor_meta``
(``_extract_tensor_metadata``), whose memory format is found by asking, for
three formats in turn, whether the tensor is contiguous in it: with symbolic
sizes each question is evaluated symbolically (1.4 ms a tensor under cProfile
on the bundled Llama's capture).  Compiled autograd traces its capture with such a tracer and
deletes every node's ``tensor_meta``, ``val`` and ``example_value`` at the end of
the capture (``AutogradCompilerInstance.end_capture``: "we traced using dummy
tensors"), before anything reads them.  So for nodes of a compiled-autograd
capture's own tracer (``AutogradCompilerInstance.fx_tracer``, remembered when an
instance is made), ``tensor_meta`` is extracted without the contiguity
questions (``include_contiguity=False``); every other ``make_fx`` trace is
unchanged.  Measured (one process, fake group, ``aot_eager``, 32 layers,
torch 2.13): the compiled-autograd backward 1.4 s shorter (27.4 s against 28.8
s with this left out).  ``tests/test_make_fx_meta.py`` compares the graph
compiled autograd hands Dynamo, and Dynamo's graph of it, node by node with and
without, and checks a ``make_fx`` trace outside a capture keeps its memory
formats.

NOTE [make_fx wrappers run untraced]
These wrappers replace torch functions that run while compiled autograd
captures a backward, and that backward may run under a frame Dynamo compiled
(``loss.backward()`` inside a compiled training step, after its graph break).
Dynamo leaves torch's own files alone, but not this package's: it would compile
the wrappers as frames of their own, and break the capture (at
``ContextVar.set``).  So their frames, and the frames they call, run as plain
Python, as the torch functions they replace did (``_compat.skip_frames_of``
with ``recursive``).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import weakref
from typing import Any

from . import _compat
from ._patching import Patcher

log = logging.getLogger(__name__)


def install(patches: Patcher) -> None:
    """Both parts; each a no-op on a release without what it wraps."""
    module = _compat.proxy_tensor_module()
    _install_dtensor_snapshot(patches, module)
    _install_capture_tensor_meta(patches, module)


def _install_dtensor_snapshot(patches: Patcher, module: Any) -> None:
    """Wrap ``proxy_tensor.snapshot_fake`` (NOTE [fake DTensor snapshots])."""
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
    _run_untraced(patches, snapshot_fake)


_capture_tracers: weakref.WeakSet[Any] = weakref.WeakSet()  # compiled autograd's capture tracers
_in_capture_set_meta = contextvars.ContextVar("dynamo_ext_in_capture_set_meta", default=False)


def _install_capture_tensor_meta(patches: Patcher, module: Any) -> None:
    """Wrap ``AutogradCompilerInstance.__init__``, ``proxy_tensor.set_meta`` and its ``_extract_tensor_metadata``
    (NOTE [compiled autograd's capture keeps no memory format])."""
    compiled_autograd = _compat.compiled_autograd_module()
    instance_class = getattr(compiled_autograd, "AutogradCompilerInstance", None)
    set_meta = getattr(module, "set_meta", None)
    extract = getattr(module, "_extract_tensor_metadata", None)
    if instance_class is None or set_meta is None or extract is None:
        log.debug("no compiled-autograd instance or make_fx set_meta here: capture tensor_meta left as it is")
        return
    try:
        takes_contiguity = "include_contiguity" in inspect.signature(extract).parameters
    except (TypeError, ValueError):
        takes_contiguity = False
    if not takes_contiguity:
        log.debug("_extract_tensor_metadata has no include_contiguity here: capture tensor_meta left as it is")
        return
    init = instance_class.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807  (the method it wraps)
        init(self, *args, **kwargs)
        tracer = getattr(self, "fx_tracer", None)
        if tracer is not None:
            _capture_tracers.add(tracer)

    @functools.wraps(set_meta)
    def capture_aware_set_meta(proxy: Any, val: Any) -> Any:
        if getattr(proxy, "tracer", None) not in _capture_tracers:
            return set_meta(proxy, val)
        token = _in_capture_set_meta.set(True)
        try:
            return set_meta(proxy, val)
        finally:
            _in_capture_set_meta.reset(token)

    @functools.wraps(extract)
    def extract_tensor_metadata(result: Any, include_contiguity: bool = True) -> Any:
        return extract(result, include_contiguity=include_contiguity and not _in_capture_set_meta.get())

    patches.setattr(instance_class, "__init__", __init__)
    patches.setattr(module, "set_meta", capture_aware_set_meta)
    patches.setattr(module, "_extract_tensor_metadata", extract_tensor_metadata)
    _run_untraced(patches, __init__, capture_aware_set_meta, extract_tensor_metadata)


def _run_untraced(patches: Patcher, *wrappers: Any) -> None:
    """The wrappers' frames, and the frames they call, run without Dynamo (NOTE [make_fx wrappers run untraced])."""
    for wrapper in wrappers:
        patches.on_undo(_compat.skip_frames_of(wrapper.__code__, recursive=True))
