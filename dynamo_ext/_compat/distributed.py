"""c10d and DDP: functional collective ops, process groups by name, the default store, async collective tensors,
DistributedDataParallel and Dynamo's DDPOptimizer (the split of a graph at DDP's bucket boundaries)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch._guards

from .probes import optional_attr

__all__ = [
    "allowing_non_fake_inputs",
    "async_collective_tensor_type",
    "backend_swapped",
    "ddp_first_bucket_bytes",
    "ddp_submod_compiler",
    "default_store",
    "distributed_initialized",
    "global_rank",
    "group_is_fake",
    "group_ranks",
    "group_sequence_number",
    "has_functional_collectives",
    "has_functional_op",
    "object_collective_device",
    "prefix_store",
    "reset_submod_compiler_state",
    "saved_tensors_hooks_off_during_tracing",
    "tcp_store",
]

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store


@functools.cache
def has_functional_op(name: str) -> bool:
    """Whether ``torch.ops._c10d_functional.<name>`` exists in this build."""
    try:
        getattr(torch.ops._c10d_functional, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def has_functional_collectives() -> bool:
    """Whether ``_c10d_functional.all_reduce`` / ``wait_tensor`` exist in this build."""
    return has_functional_op("all_reduce") and has_functional_op("wait_tensor")


def async_collective_tensor_type() -> type | None:
    """``torch.distributed._functional_collectives.AsyncCollectiveTensor`` (what ``DTensor.to_local()``
    returns after an ``async_op=True`` redistribute), or ``None`` where absent."""
    return optional_attr("torch.distributed._functional_collectives", "AsyncCollectiveTensor")


def distributed_initialized() -> bool:
    """Whether ``torch.distributed`` is available and its default group initialized."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def global_rank() -> int | None:
    """This process's rank in the default group, ``None`` when there is none."""
    import torch.distributed as dist

    return dist.get_rank() if distributed_initialized() else None


def _resolve_group(name: str) -> Any:
    """The live ``ProcessGroup`` named ``name`` (``distributed_c10d._resolve_process_group``), or ``None``."""
    if not name or not distributed_initialized():
        return None
    try:
        return _registered_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        return None


def _registered_process_group(name: str) -> torch.distributed.ProcessGroup:
    """The ``ProcessGroup`` registered as ``name`` (c10d's ``_resolve_process_group``).

    Raises:
        RuntimeError, ValueError or KeyError (by release): no group of that name in this process.
    """
    from torch._C._distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # pyright: ignore[reportArgumentType]  # GroupName: a NewType of str


def group_ranks(name: str) -> tuple[int, ...]:
    """Sorted global ranks of the group named ``name``; ``()`` when no live group has that name."""
    import torch.distributed as dist

    group = _resolve_group(name)
    if group is None:
        return ()
    try:
        return tuple(sorted(dist.get_process_group_ranks(group)))
    except (RuntimeError, ValueError):
        return ()


def group_sequence_number(name: str) -> int | None:
    """How many collectives the group named ``name`` has issued so far, ``None`` when that cannot be read.

    Feature probe: ``ProcessGroup._get_sequence_number_for_group()`` (gloo and
    NCCL count every collective issued on the group, eager and
    ``_c10d_functional`` alike; Flight Recorder reads the same number).
    """
    group = _resolve_group(name)
    read = getattr(group, "_get_sequence_number_for_group", None)
    if read is None:
        return None
    try:
        return int(read())
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return None


def group_is_fake(name: str) -> bool:
    """Whether the group named ``name`` runs on the single-process ``fake`` backend (no peer to meet)."""
    import torch.distributed as dist

    group = _resolve_group(name)
    if group is None:
        return False
    try:
        return dist.get_backend(group) == "fake"
    except (AttributeError, RuntimeError, ValueError):
        return False


def default_store() -> Any:
    """The default group's c10d store (``distributed_c10d._get_default_store()``), ``None`` without one."""
    if not distributed_initialized():
        return None
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def tcp_store(host: str, port: int, world_size: int, *, is_master: bool, timeout: datetime.timedelta) -> Store:
    """``torch.distributed.TCPStore(host, port, world_size, is_master, timeout=timeout)`` (public; pyright sees the
    class only in the C module, where torch.distributed imports it from)."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(host, port, world_size, is_master, timeout=timeout)


def prefix_store(prefix: str, store: Any) -> Store:
    """``torch.distributed.PrefixStore(prefix, store)`` (public; imported from the C module, as for TCPStore)."""
    from torch._C._distributed_c10d import PrefixStore

    return PrefixStore(prefix, store)


def object_collective_device(group: Any) -> str | None:
    """The device type c10d's object collectives use on ``group``, ``None`` where c10d cannot say.

    ``distributed_c10d._get_object_coll_device(group)`` (present on 2.13, checked here); eager
    ``dist.barrier`` reads it to pick its device.
    """
    fn = optional_attr("torch.distributed.distributed_c10d", "_get_object_coll_device")
    return None if fn is None else fn(group)


# --- DistributedDataParallel and DDPOptimizer ---


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
