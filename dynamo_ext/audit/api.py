"""In-process audit: ``audit(fn, *args, **compile_kwargs) -> AuditReport``."""

from __future__ import annotations

import os
from typing import Any

from .collector import Collector, dynamo_counters
from .merge import merge
from .records import AuditReport


def audit(fn: Any, *args: Any, **compile_kwargs: Any) -> AuditReport:
    """Compile ``fn`` with ``torch.compile(fn, **compile_kwargs)``, call it once on ``args``, report.

    Runs in this process, on this rank (the report has one rank: this one's
    ``dist.get_rank()``, or 0 without a process group).  The plugin is used
    when it is installed (``dynamo_ext.install()`` / ``with dynamo_ext.enabled():``).
    Dynamo's caches and counters are reset first, so the report covers exactly
    this call.  An exception from ``fn`` propagates.
    """
    import torch
    import torch.distributed as dist

    import dynamo_ext
    from dynamo_ext import _compat

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    torch._dynamo.reset()
    _compat.dynamo_counters().clear()
    collector = Collector()
    collector.record(
        {
            "ev": "start",
            "rank": rank,
            "pid": os.getpid(),
            "plugin": {"installed": dynamo_ext.is_installed(), "version": dynamo_ext.__version__, "error": ""},
        }
    )
    collector.start()
    try:
        torch.compile(fn, **compile_kwargs)(*args)
    finally:
        collector.stop()
        collector.record({"ev": "end", "counters": dynamo_counters()})
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    report = merge(
        {0: collector.events},
        target=f"{module}:{name}" if module else name,
        world_size=1,
        backend=str(compile_kwargs.get("backend", "inductor")),
    )
    if rank:
        import dataclasses

        report = dataclasses.replace(
            report,
            ranks=tuple(dataclasses.replace(r, rank=rank) for r in report.ranks),
            graph_breaks=tuple(
                dataclasses.replace(b, ranks=(rank,), count_by_rank=tuple((rank, n) for _, n in b.count_by_rank))
                for b in report.graph_breaks
            ),
        )
    return report
