"""DistributedDataParallel and Dynamo's DDPOptimizer (the split of a graph at DDP's bucket boundaries)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch._guards


@contextlib.contextmanager
def backend_swapped(output_graph: Any, compiler_fn: Any) -> Iterator[Any]:
    """For one ``call_user_compiler``: ``output_graph.compiler_fn`` (the backend) replaced by ``compiler_fn``,
    restored on exit.  Yields the original backend (DDPOptimizer swaps the backend for one frame too, through
    ``_clone_with_backend``)."""
    original = output_graph.compiler_fn
    output_graph.compiler_fn = compiler_fn
    try:
        yield original
    finally:
        output_graph.compiler_fn = original


def reset_submod_compiler_state() -> None:
    """Undo what DDPOptimizer's ``SubmodCompiler`` leaves on the ``TracingContext`` (``ddp_optimizer_ctx``,
    ``fakify_first_call``), so the same Dynamo graph can be compiled whole after a failed split compile."""
    ctx = torch._guards.TracingContext.try_get()
    if ctx is None:
        return
    if hasattr(ctx, "ddp_optimizer_ctx"):
        ctx.ddp_optimizer_ctx = None
    if hasattr(ctx, "fakify_first_call"):
        ctx.fakify_first_call = False


def ddp_submod_compiler() -> tuple[Any, Any, Any]:
    """DDPOptimizer's ``(SubmodCompiler, propagate_dynamo_source, propagate_metadata)``
    (``torch._dynamo.backends.distributed``): compile each submodule of a split Dynamo graph with a backend."""
    mod = importlib.import_module("torch._dynamo.backends.distributed")
    return mod.SubmodCompiler, mod.propagate_dynamo_source, mod.propagate_metadata


def saved_tensors_hooks_off_during_tracing() -> Any:
    """``torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing()`` (DDPOptimizer wraps its submodule compiles in it)."""
    return importlib.import_module("torch._dynamo.utils")._disable_saved_tensors_hooks_during_tracing()


def ddp_first_bucket_bytes(ddp: Any) -> int:
    """A ``DistributedDataParallel``'s first-bucket cap in bytes (``_bucket_config.first_bucket_bytes_cap``;
    before that config object existed, ``dist._DEFAULT_FIRST_BUCKET_BYTES`` capped at ``bucket_bytes_cap``)."""
    config = getattr(ddp, "_bucket_config", None)
    if config is not None and hasattr(config, "first_bucket_bytes_cap"):
        return int(config.first_bucket_bytes_cap)
    import torch.distributed as dist

    return min(int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2**20)), int(ddp.bucket_bytes_cap))


@contextlib.contextmanager
def allowing_non_fake_inputs(fake_mode: Any) -> Iterator[None]:
    """``fake_mode`` entered with ``allow_non_fake_inputs`` on, as ``SubmodCompiler`` runs a submodule under it."""
    saved = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        with fake_mode:
            yield
    finally:
        fake_mode.allow_non_fake_inputs = saved
