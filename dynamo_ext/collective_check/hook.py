"""Where the collective check hooks in: AOTAutograd's graphs at compile time, the compiled callable's first run.

NOTE [collective check hook]
Every backend built on AOTAutograd (``aot_eager``, ``inductor``, and the
compiled-autograd backward's backend) calls ``aot_module_simplified`` from
``torch._dynamo.backends.common``; ``install`` replaces that name with
:func:`_checked_aot_module_simplified`, which

* wraps ``partition_fn`` to read the forward *and* backward graphs right after
  partitioning (the backward is compiled lazily on first backward, but its
  graph exists here), and ``inference_compiler`` to read an inference graph;
* returns the compiled callable wrapped so that its first run agrees the
  fingerprint with the other ranks (:func:`.exchange.check_collectives`) before
  any collective of the graph is issued, backward included.  Later runs cost
  one flag test.

Hooking the first run, not the compile, keeps a rank that compiles a graph and
one that takes it from a cache in step: both run it.  AOTAutograd's own cache
(``AOTAutogradCache``) would hand back a compiled graph without its graphs, so
the graphs that may hold collectives (a collective op, a tensor subclass such
as DTensor among the inputs) are compiled with that cache off; Inductor's FX
graph cache still serves their kernels.  Backends not built on AOTAutograd
(``eager``) are not checked.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from .. import _compat, config
from .._patching import Patcher
from .exchange import CollectiveMismatchError, check_collectives
from .fingerprint import Collective, collectives

log = logging.getLogger(__name__)


class _Capture:
    """The fingerprint of the graph(s) one ``aot_module_simplified`` call compiles."""

    def __init__(self) -> None:
        self.records: list[Collective] | None = None


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
        capture.records = collectives(fw, "forward") + collectives(bw, "backward")
        return fw, bw

    return partition


def _wrap_compiler(compiler: Any, capture: _Capture) -> Any:
    inner = getattr(compiler, "compiler_fn", compiler)

    @functools.wraps(inner)
    def compile_inference(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        capture.records = collectives(gm, "forward")
        return inner(gm, example_inputs, *args, **kwargs)

    if inner is compiler:
        return compile_inference
    return _compat.serializable_compiler(compiler, compile_inference)


def _first_run_checked(compiled: Callable[..., Any], records: list[Collective]) -> Callable[..., Any]:
    """``compiled`` whose first call agrees ``records`` across ranks; later calls test one flag."""
    pending: list[list[Collective]] = [records]
    failed: list[BaseException] = []

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        if pending:
            if failed:
                raise failed[0]
            try:
                check_collectives(pending[0])
            except CollectiveMismatchError as e:
                failed.append(e)
                raise
            pending.clear()
        return compiled(*args, **kwargs)

    return run


def _checked(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def aot_module_simplified(mod: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
        if rest or not config.collective_check or not _compat.distributed_initialized():
            return original(mod, args, *rest, **kwargs)
        if not _may_have_collectives(mod, args):
            log.debug("collective check: no collective or tensor subclass in the graph, not fingerprinted")
            return original(mod, args, **kwargs)
        capture = _Capture()
        kwargs["partition_fn"] = _wrap_partition(kwargs.get("partition_fn") or _compat.default_partition(), capture)
        inference = kwargs.get("inference_compiler") or kwargs["fw_compiler"]
        kwargs["inference_compiler"] = _wrap_compiler(inference, capture)
        with _compat.aot_autograd_cache_off():
            compiled = original(mod, args, **kwargs)
        if not capture.records:
            return compiled
        log.debug(
            "collective check: %d collectives in the compiled graph(s), agreed on first run", len(capture.records)
        )
        return _first_run_checked(compiled, capture.records)

    return aot_module_simplified


def install(patches: Patcher) -> None:
    """Route AOTAutograd backends through the check (NOTE [collective check hook])."""
    owner = _compat.aot_backend_module()
    patches.setattr(owner, "aot_module_simplified", _checked(owner.aot_module_simplified))
