"""Where the collective check hooks in: AOTAutograd's graphs at compile time, the compiled callables' runs.

NOTE [collective check hook]
Every backend built on AOTAutograd (``aot_eager``, ``inductor``, and the
compiled-autograd backward's backend) calls ``aot_module_simplified`` from
``torch._dynamo.backends.common``; ``install`` replaces that name with
:func:`_checked`'s wrapper, which

* wraps ``partition_fn`` to read the forward graph right after partitioning,
  and ``inference_compiler`` to read an inference graph, and returns the
  compiled callable wrapped by :func:`.stream.checked`;
* wraps ``bw_compiler`` so that the backward (compiled lazily, at its first
  run) is wrapped the same way: its collectives come later in the stream, after
  whatever ran between the forward and the backward, so they are checked when
  the backward runs (NOTE [when the stream is checked]).

Checking at a run, not at the compile, keeps a rank that compiles a graph and
one that takes it from a cache in step: both run it.  AOTAutograd's own cache
(``AOTAutogradCache``) hands back a compiled graph without its graphs, so the
records read at a miss are kept beside its entry and read back at a hit, where
the cached backward is wrapped as the compiled one would be (NOTE [collective
records beside AOTAutograd's cache]); ``install`` wraps the cache's lookup for
that.  A graph served by the cache without records is compiled again with the
cache off, so no graph runs unchecked.  Backends not built on AOTAutograd
(``eager``) are not checked.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .. import _compat, config
from .._patching import Patcher
from . import cached
from .fingerprint import CollectiveSignature, collectives, data_flow
from .stream import checked, group_plans

log = logging.getLogger(__name__)


class _Capture:
    """One ``aot_module_simplified`` call: the forward (or inference) graph's collectives and data flow, read
    where AOTAutograd compiles it, or the records kept for its cache entry (NOTE [collective records beside
    AOTAutograd's cache])."""

    def __init__(self, gm: Any) -> None:
        self.gm = gm
        self.records: list[CollectiveSignature] | None = None
        """Set where this call compiled the forward or inference graph; ``None`` after a cache hit."""
        self.flow = ""
        self.looked_up = False
        self.key: str | None = None
        """The record file's key, once AOTAutograd computed its cache key (``None`` when it bypassed its cache)."""
        self.cached: cached.GraphRecords | None = None
        """The records read for a cache hit."""
        self.bucketed: frozenset[str] = frozenset()
        """The groups on which the compiled forward (or inference) graph has buckets."""


_active = threading.local()


@contextlib.contextmanager
def _capturing(capture: _Capture) -> Iterator[None]:
    stack = _active.__dict__.setdefault("stack", [])
    stack.append(capture)
    try:
        yield
    finally:
        stack.pop()


def _current() -> _Capture | None:
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None


def bucket_groups(compiled: Any) -> frozenset[str]:
    """The groups on which ``compiled`` (a compiler's output) issues ``dynamo_ext::bucketed_collective`` ops.

    Read from the generated code of Inductor's output (``source_code``, also on
    an FX-graph-cache hit); other backends do not run the bucketing pass.
    """
    source = getattr(compiled, "source_code", None)
    if not isinstance(source, str):
        return frozenset()
    groups = set()
    for call in _BUCKET_CALL.findall(source):
        quoted = re.findall(r"'([^']*)'", call)
        if quoted:
            groups.add(quoted[-1])  # the op's last argument: the group's name
    return frozenset(groups)


_BUCKET_CALL = re.compile(r"bucketed_collective\.default\(([^\n]*)\)")


def _may_have_collectives(gm: Any, example_inputs: Any) -> bool:
    """Whether a Dynamo graph can lower to collectives (cheap, conservative).

    A collective op or a ``torch.distributed`` function in the graph or in a
    higher-order op's body, or a tensor subclass (DTensor) among the inputs or attributes.
    """
    if any(_compat.is_traceable_subclass(x) for x in example_inputs):
        return True
    modules = getattr(gm, "modules", None)
    if modules is None:
        return True
    for module in modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.op == "call_function":
                schema = _compat.op_schema(node.target)
                name = schema.name if schema is not None else getattr(node.target, "__module__", "") or ""
                if "c10d" in name or "distributed" in name:
                    return True
            elif node.op == "get_attr" and _compat.is_traceable_subclass(getattr(module, str(node.target), None)):
                return True
    return False


def _wrap_partition(partition_fn: Callable[..., Any], capture: _Capture) -> Callable[..., Any]:
    @functools.wraps(partition_fn)
    def partition(*args: Any, **kwargs: Any) -> Any:
        fw, bw = partition_fn(*args, **kwargs)
        capture.records, capture.flow = collectives(fw, "forward"), data_flow(fw)
        return fw, bw

    return partition


def _wrap_compiler(compiler: Any, compile_fn: Callable[..., Any]) -> Any:
    """``compiler`` (a function or a ``SerializableAOTDispatchCompiler``) calling ``compile_fn(inner, gm, ...)``."""
    inner = getattr(compiler, "compiler_fn", compiler)

    @functools.wraps(inner)
    def wrapped(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return compile_fn(inner, gm, example_inputs, *args, **kwargs)

    if inner is compiler:
        return wrapped
    return _compat.serializable_compiler(compiler, wrapped)


def _capture_inference(capture: _Capture) -> Callable[..., Any]:
    def compile_inference(inner: Any, gm: Any, *args: Any, **kwargs: Any) -> Any:
        capture.records, capture.flow = collectives(gm, "forward"), data_flow(gm)
        compiled = inner(gm, *args, **kwargs)
        capture.bucketed = bucket_groups(compiled)
        if capture.key is not None:
            records = cached.GraphRecords(tuple(capture.records), capture.flow, forward_bucketed=capture.bucketed)
            cached.store(capture.key, records)
        return compiled

    return compile_inference


def _capture_forward_buckets(capture: _Capture) -> Callable[..., Any]:
    def compile_forward(inner: Any, gm: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = inner(gm, *args, **kwargs)
        capture.bucketed = bucket_groups(compiled)
        return compiled

    return compile_forward


def _checked_backward(capture: _Capture) -> Callable[..., Any]:
    def compile_backward(inner: Any, gm: Any, *args: Any, **kwargs: Any) -> Any:
        """Compile the backward (lazily, at its first run) and check it on its own runs: its collectives come
        later in the stream than the forward's, after whatever ran in between."""
        records, flow = collectives(gm, "backward"), data_flow(gm)
        compiled = inner(gm, *args, **kwargs)
        bucketed = bucket_groups(compiled)
        if capture.key is not None and capture.records is not None:
            kept = cached.GraphRecords(
                tuple(capture.records), capture.flow, tuple(records), flow, capture.bucketed, bucketed
            )
            cached.store(capture.key, kept)  # AOTAutograd saves its entry next, once the backward is compiled
        plans = group_plans(records, flow, bucketed)
        return checked(compiled, plans) if plans else compiled

    return compile_backward


def _checked_lookup(lookup: Callable[..., Any]) -> Callable[..., Any]:
    """``AOTAutogradCache._lookup`` that, inside a checked compile, keeps the record key and turns a hit
    without usable records into a miss (NOTE [collective records beside AOTAutograd's cache])."""

    @functools.wraps(lookup)
    def checked_lookup(key: str, *args: Any, **kwargs: Any) -> Any:
        result = lookup(key, *args, **kwargs)
        capture = _current()
        if capture is None or capture.looked_up:
            return result  # not a checked compile, or a lookup nested in it
        capture.looked_up = True
        capture.key = cached.records_key(key, capture.gm)
        if result is None:
            return None
        entry = result[0]
        records = cached.load(capture.key)
        if records is None or (records.backward is None) == _compat.entry_has_backward(entry):
            log.debug("collective check: AOTAutograd cache hit without collective records; compiling the graph")
            return None
        plans = group_plans(records.backward or (), records.backward_flow, records.backward_bucketed)
        if plans and not _compat.wrap_cached_backward(entry, lambda bw: checked(bw, plans)):
            log.debug("collective check: a cached backward that cannot be wrapped; compiling the graph")
            return None
        capture.cached = records
        return result

    return checked_lookup


def _compile(original: Callable[..., Any], mod: Any, args: Any, kwargs: dict[str, Any], *, cache: bool) -> Any:
    """``original(mod, args, **kwargs)`` with the graphs read; returns ``(compiled, capture)``."""
    capture = _Capture(mod)
    kwargs = dict(kwargs)
    kwargs["partition_fn"] = _wrap_partition(kwargs.get("partition_fn") or _compat.default_partition(), capture)
    backward = kwargs.get("bw_compiler") or kwargs["fw_compiler"]
    kwargs["bw_compiler"] = _wrap_compiler(backward, _checked_backward(capture))
    inference = kwargs.get("inference_compiler") or kwargs["fw_compiler"]
    kwargs["inference_compiler"] = _wrap_compiler(inference, _capture_inference(capture))
    kwargs["fw_compiler"] = _wrap_compiler(kwargs["fw_compiler"], _capture_forward_buckets(capture))
    with _capturing(capture), contextlib.nullcontext() if cache else _compat.aot_autograd_cache_off():
        return original(mod, args, **kwargs), capture


def _checked(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def aot_module_simplified(mod: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
        if rest or not config.collective_check or not _compat.distributed_initialized():
            return original(mod, args, *rest, **kwargs)
        if not _may_have_collectives(mod, args):
            log.debug("collective check: no collective or tensor subclass in the graph, not fingerprinted")
            return original(mod, args, **kwargs)
        cache = _compat.aot_cache_class() is not None
        compiled, capture = _compile(original, mod, args, kwargs, cache=cache)
        if capture.records is None and capture.cached is not None:
            records, flow = capture.cached.forward, capture.cached.forward_flow
            bucketed = capture.cached.forward_bucketed
            log.debug("collective check: graph and its collective records from AOTAutograd's cache")
        else:
            if capture.records is None:  # served by a cache whose lookup we did not see
                log.debug("collective check: a cached graph without collective records; compiling it uncached")
                compiled, capture = _compile(original, mod, args, kwargs, cache=False)
            records, flow, bucketed = capture.records or (), capture.flow, capture.bucketed
        plans = group_plans(records, flow, bucketed)
        if not plans:
            return compiled
        log.debug("collective check: %d forward collectives, checked where their context is new", len(records))
        return checked(compiled, plans)

    return aot_module_simplified


def install(patches: Patcher) -> None:
    """Route AOTAutograd backends through the check (NOTE [collective check hook])."""
    owner = _compat.aot_backend_module()
    patches.setattr(owner, "aot_module_simplified", _checked(owner.aot_module_simplified))
    cache = _compat.aot_cache_class()
    if cache is not None:  # NOTE [collective records beside AOTAutograd's cache]
        lookup = _checked_lookup(_compat.lookup_function())
        patches.setattr(cache, "_lookup", _compat.lookup_as_attribute(lookup))
