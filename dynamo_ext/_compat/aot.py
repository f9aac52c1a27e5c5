"""AOTAutograd (``torch._functorch``): its backends, partitioner, cache, input fakification, checkpointing."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from .probes import optional_attr

__all__ = [
    "aot_autograd_backend_class",
    "aot_autograd_cache_off",
    "aot_backend_module",
    "aot_process_inputs",
    "aot_unwraps_async_collective_inputs",
    "checkpoint_tags_nested_ops",
    "default_partition",
    "is_opaque_fx_node",
    "partitioners_module",
    "serializable_compiler",
]


def aot_backend_module() -> Any:
    """``torch._dynamo.backends.common``: AOTAutograd backends call ``aot_module_simplified`` through its globals."""
    return importlib.import_module("torch._dynamo.backends.common")


def default_partition() -> Any:
    """AOTAutograd's default ``partition_fn`` (``torch._functorch.partitioners.default_partition``)."""
    return importlib.import_module("torch._functorch.partitioners").default_partition


def partitioners_module() -> Any:
    """``torch._functorch.partitioners`` (AOTAutograd's joint-graph partitioner; private in 2.11 to 2.15)."""
    return importlib.import_module("torch._functorch.partitioners")


def serializable_compiler(compiler: Any, compiler_fn: Any) -> Any:
    """A copy of ``compiler`` (``SerializableAOTDispatchCompiler`` and the like) calling ``compiler_fn``."""
    import copy

    new = copy.copy(compiler)
    new.compiler_fn = compiler_fn
    return new


def aot_autograd_cache_off() -> Any:
    """Context manager: ``torch._functorch.config.enable_autograd_cache`` off (Inductor's FX cache stays on)."""
    return importlib.import_module("torch._functorch.config").patch(enable_autograd_cache=False)


def is_opaque_fx_node(node: Any) -> bool:
    """Whether an FX node's value is an opaque object (a mesh, a process group, a script object).

    AOTAutograd's own test (``graph_compile.is_opaque_node``, 2.12+); before it existed nothing was opaque.
    """
    fn = optional_attr("torch._functorch._aot_autograd.graph_compile", "is_opaque_node")
    return bool(fn is not None and fn(node))


# Where AOTAutograd's callers read ``process_inputs`` from: its home module and the
# module that imports it by name (``aot_function``, ``aot_module_simplified``, export).
_PROCESS_INPUTS_HOMES = ("torch._functorch._aot_autograd.frontend_utils", "torch._functorch.aot_autograd")


def aot_process_inputs() -> tuple[Any, tuple[Any, ...]]:
    """AOTAutograd's input fakifier and the modules that hold it: ``(process_inputs, owners)``.

    ``process_inputs(flat_args, aot_config, fake_mode, shape_env, ...)`` turns the compiled
    region's inputs into fake tensors before tracing; it returns the fakes, or on releases that
    unwrap ``AsyncCollectiveTensor`` inputs first, ``(fakes, act_input_indices)``.  Probed by
    import, not by version; ``(None, ())`` where no such function exists.
    """
    original = None
    for name in _PROCESS_INPUTS_HOMES:
        original = optional_attr(name, "process_inputs")
        if callable(original):
            break
    if not callable(original):
        return None, ()
    owners = tuple(
        importlib.import_module(name)
        for name in _PROCESS_INPUTS_HOMES
        if optional_attr(name, "process_inputs") is original
    )
    return original, owners


def aot_unwraps_async_collective_inputs() -> bool:
    """Whether AOTAutograd replaces ``AsyncCollectiveTensor`` inputs by their waited local tensor before
    fakifying them: its ``ViewAndMutationMeta`` records where they were (``act_input_indices`` on 2.12 and
    2.13, ``act_input_paths`` on 2.14 and 2.15; neither on 2.11, which fakifies them as subclasses)."""
    import dataclasses

    meta = optional_attr("torch._functorch._aot_autograd.schemas", "ViewAndMutationMeta")
    if meta is None or not dataclasses.is_dataclass(meta):
        return False
    names = {f.name for f in dataclasses.fields(meta)}
    return bool(names & {"act_input_indices", "act_input_paths"})


@functools.cache
def checkpoint_tags_nested_ops() -> bool:
    """Whether a compiled ``torch.utils.checkpoint`` region marks every op in it for recompute (2.12+).

    2.12+ run plain activation checkpointing through the selective-checkpoint path with an
    always-recompute policy (``_always_prefer_recompute`` in ``torch/_higher_order_ops/wrap.py``), which
    also tags ops inside a custom ``autograd.Function`` in the region; 2.11 tags only the region's own
    graph nodes.
    """
    return optional_attr("torch._higher_order_ops.wrap", "_always_prefer_recompute") is not None


def aot_autograd_backend_class() -> Any:
    """``torch._dynamo.backends.common.AotAutograd``: the callable every AOTAutograd-based backend (``aot_eager``,
    ``aot_eager_decomp_partition``, ``aot_autograd(...)``) is; its ``__call__(gm, example_inputs)`` compiles a
    Dynamo graph."""
    return importlib.import_module("torch._dynamo.backends.common").AotAutograd
