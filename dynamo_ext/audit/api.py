"""In-process audit: ``audit(fn, *args, **compile_kwargs) -> AuditReport``."""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Callable
from typing import Any

from .merge.merger import merge
from .model.records import AuditReport
from .rank.blocks import audit_blocks, every_block_compiled
from .rank.collector import Collector, dynamo_counters
from .rank.identity import target_root
from .rank.numerics import MakeStepResult, as_step, check_step
from .schema.events import FORMAT_VERSION, End, EventKind, Start, to_dict


def _source_file(fn: Any) -> str | None:
    target = getattr(fn, "forward", fn)  # an nn.Module: where its forward is
    try:
        return inspect.getsourcefile(inspect.unwrap(target))
    except (TypeError, OSError):
        return None


def _check_audit_arguments(fn: Any, check_numerics: Any, rtol: float | None, atol: float | None) -> None:
    """Bad arguments of :func:`audit` as clear errors before anything runs."""
    if not callable(fn):
        raise TypeError(f"audit(fn, *args): fn must be a function or module to compile, got {type(fn).__name__}")
    if check_numerics is not None and not callable(check_numerics):
        raise TypeError(
            f"audit(check_numerics=...) takes a make_step callable (docs/audit.md), got {type(check_numerics).__name__}"
        )
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not value >= 0:
            raise ValueError(f"audit({name}=...) must be a number >= 0, got {value!r}")


def audit(
    fn: Callable[..., Any],
    *args: Any,
    check_numerics: Callable[[], MakeStepResult] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    **compile_kwargs: Any,
) -> AuditReport:
    """Compile ``fn`` with ``torch.compile(fn, **compile_kwargs)``, call it once on ``args``, report.

    Runs in this process, on this rank (the report has one rank: this one's
    ``dist.get_rank()``, or 0 without a process group).  The plugin is used
    when it is installed (``dynamo_ext.install()`` / ``with dynamo_ext.enabled():``).

    The report covers exactly this call, and the calling process's Dynamo state
    is left as it was: the compile uses a backend equal to no other and its own
    cache bucket (:func:`dynamo_ext._compat.fresh_compile_kwargs`), so earlier
    compiles of ``fn`` are neither reused nor disturbed (no ``torch._dynamo.reset()``); and
    ``torch._dynamo.utils.counters`` are restored to their values before the
    call (the report's ``dynamo_graph_breaks`` is this call's increment).
    Files in identities are relative to the root of ``fn``'s source
    (:func:`.identity.target_root`).  An exception from ``fn`` propagates.

    ``check_numerics``: a ``make_step`` callable (docs/audit.md, "Numerics
    check"; :mod:`.rank.numerics`); after the audited call, its step runs eagerly and
    compiled from the same state and ``report.numerics`` says which tensors
    differ (``rtol``/``atol``: as ``torch.testing.assert_close``, both or neither).
    Its compiles are not part of the audit's counts.

    Raises:
        TypeError: ``fn`` or ``check_numerics`` is not callable.
        ValueError: only one of ``rtol``/``atol`` given, or a negative one.
    """
    import torch
    import torch.distributed as dist

    import dynamo_ext
    from dynamo_ext import _compat

    if (rtol is None) != (atol is None):
        raise ValueError("give both rtol and atol, or neither (the per-dtype defaults of torch.testing.assert_close)")
    _check_audit_arguments(fn, check_numerics, rtol, atol)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    counters = _compat.dynamo_counters()
    saved = copy.deepcopy(dict(counters))
    before = dynamo_counters()
    source = _source_file(fn)
    collector = Collector(root=target_root(source) if source else None)
    plugin: dict[str, Any] = {"installed": dynamo_ext.is_installed(), "version": dynamo_ext.__version__, "error": ""}
    if plugin["installed"]:
        plugin["blocks"] = audit_blocks()
    collector.record(to_dict(Start(format_version=FORMAT_VERSION, rank=rank, pid=os.getpid(), plugin=plugin)))
    collector.start()
    finished = False
    try:
        with every_block_compiled():  # NOTE [the audit compiles each block]
            torch.compile(fn, **_compat.fresh_compile_kwargs(compile_kwargs))(*args)
        finished = True
    finally:
        collector.stop()
        after = dynamo_counters()
        delta = {k: after[k] - before.get(k, 0) for k in after}
        delta["graph_break_missed"] = collector.dynamo_missed()
        collector.record(to_dict(End(counters=delta)))
        try:
            if check_numerics is not None and finished:
                collector.record(
                    {"ev": EventKind.NUMERICS, **check_step(as_step(check_numerics()), rtol=rtol, atol=atol)}
                )
        finally:
            counters.clear()
            counters.update(saved)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    return merge(
        {rank: collector.events},
        target=f"{module}:{name}" if module else name,
        world_size=1,
        backend=str(compile_kwargs.get("backend", "inductor")),
        ranks=(rank,),
    )
