"""Inductor: config, lowering table, IR, custom post-grad passes, the compile entry, the comm cost model.

Every private Inductor module is imported on first use, never when dynamo-ext
is imported.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

__all__ = [
    "collective_kernel_cls",
    "comm_buffer_api",
    "compile_fx_module",
    "custom_graph_pass_base",
    "estimate_collective_ms",
    "has_triton",
    "hash_for_files",
    "inductor_config",
    "ir_module",
    "lowering_table",
    "make_lowering",
    "ops_handler",
    "preserve_node_ordering",
    "simple_overlap_enabled",
]


def inductor_config() -> Any:
    """``torch._inductor.config`` (imported on first use, never at package import)."""
    return importlib.import_module("torch._inductor.config")


def lowering_table() -> dict[Any, Callable[..., Any]]:
    """Inductor's ``lowerings`` dict (op overload -> lowering)."""
    return importlib.import_module("torch._inductor.lowering").lowerings


def make_lowering(op: Any, fn: Callable[..., Any]) -> dict[Any, Callable[..., Any]]:
    """Wrap ``fn`` with Inductor's ``register_lowering`` into a scratch dict, not the live table.

    The caller installs the returned ``{overload: wrapped}`` entries through the
    patcher, so uninstall restores the previous entries exactly.
    """
    lowering = importlib.import_module("torch._inductor.lowering")
    scratch: dict[Any, Callable[..., Any]] = {}
    lowering.register_lowering(op, type_promotion_kind=None, lowering_dict=scratch)(fn)
    return scratch


def custom_graph_pass_base() -> type:
    """``torch._inductor.custom_graph_pass.CustomGraphPass`` (the base of post-grad passes, 2.11 to 2.15)."""
    return importlib.import_module("torch._inductor.custom_graph_pass").CustomGraphPass


def hash_for_files(paths: tuple[str, ...], extra: str = "") -> bytes:
    """``custom_graph_pass.get_hash_for_files(paths, extra)``: a hash of the files' contents and ``extra``.

    Probed by calling it: where it takes ``paths`` only (no ``extra`` argument; 2.13 has ``extra``), its
    hash and ``extra`` are hashed again with sha256.
    """
    mod = importlib.import_module("torch._inductor.custom_graph_pass")
    try:
        return mod.get_hash_for_files(paths, extra)
    except TypeError:  # older signature: paths only
        import hashlib

        return hashlib.sha256(mod.get_hash_for_files(paths) + extra.encode()).digest()


def ir_module() -> Any:
    """``torch._inductor.ir``."""
    return importlib.import_module("torch._inductor.ir")


def collective_kernel_cls() -> type:
    """``ir._CollectiveKernel``: the IR class Inductor's comm reordering treats as a collective (private)."""
    return ir_module()._CollectiveKernel


def ops_handler() -> Any:
    """``torch._inductor.virtualized.ops`` for writing inner functions."""
    return importlib.import_module("torch._inductor.virtualized").ops


def comm_buffer_api() -> tuple[Callable[..., bool], Callable[..., None], Any] | None:
    """Inductor's comm buffers: ``(can_realize_as_comm_buffer, realize_as_comm_buffer, CommBufferType.SYMM_MEM)``.

    From ``torch._inductor.comm_lowering`` and ``torch._inductor.ir`` (all three on 2.13, checked here);
    ``None`` where any of them is missing, and the lowerings then keep the unfused path.
    """
    comm = importlib.import_module("torch._inductor.comm_lowering")
    ir = ir_module()
    can = getattr(comm, "can_realize_as_comm_buffer", None)
    realize = getattr(comm, "realize_as_comm_buffer", None)
    kind = getattr(getattr(ir, "CommBufferType", None), "SYMM_MEM", None)
    if can is None or realize is None or kind is None:
        return None
    return can, realize, kind


def compile_fx_module() -> Any:
    """``torch._inductor.compile_fx``, whose ``compile_fx`` the ``inductor`` backend looks up at each compile.

    Dynamo's registered ``inductor`` backend imports ``compile_fx`` from this
    module when called (2.11 to 2.15), so a wrapper set on the module runs at the
    start of every Inductor compile through ``torch.compile``.
    """
    return importlib.import_module("torch._inductor.compile_fx")


@functools.cache
def has_triton() -> bool:
    """Whether triton imports (the kernels need it; the CPU lowerings do not)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def estimate_collective_ms(node: Any, *, intra_bw: float | None = None, inter_bw: float | None = None) -> float | None:
    """``torch._inductor.comm_analysis``'s NCCL time estimate (ms) of an FX collective node; ``None`` if it cannot.

    Its analytical model (NCCL's tuning.cc), not the NCCL simulator;
    ``intra_bw``/``inter_bw`` (GB/s) replace ``torch._inductor.config.intra_node_bw``/``inter_node_bw``.
    Where ``estimate_nccl_collective_runtime_from_fx_node`` takes ``use_nccl_estimator`` (2.13 does; probed
    by signature) it is turned off, so the analytical model runs without CUDA.
    """
    try:
        from torch._inductor import comm_analysis
        from torch._inductor import config as inductor_config

        patch = {
            k: int(v) if float(v).is_integer() else v
            for k, v in (("intra_node_bw", intra_bw), ("inter_node_bw", inter_bw))
            if v is not None
        }
        estimate = comm_analysis.estimate_nccl_collective_runtime_from_fx_node
        with inductor_config.patch(patch):
            if "use_nccl_estimator" in inspect.signature(estimate).parameters:
                return float(estimate(node, use_nccl_estimator=False))  # no CUDA: the analytical model
            return float(estimate(node))
    except Exception:
        return None


def simple_overlap_enabled() -> bool | None:
    """Whether Inductor's ``simple_overlap`` scheduler pass is on; ``None`` where this Inductor has no such switch.

    ``torch._inductor.config.aten_distributed_optimizations.enable_simple_overlap`` (on by default where it
    exists, 2.14+): it moves the collectives it recognises (``ir._CollectiveKernel``) earlier and their waits
    later, and keeps their order among themselves only (pytorch#189454).
    """
    section = getattr(inductor_config(), "aten_distributed_optimizations", None)
    value = getattr(section, "enable_simple_overlap", None)
    return None if value is None else bool(value)


def preserve_node_ordering() -> Callable[..., Any] | None:
    """``torch._inductor.fx_passes.control_dependencies.preserve_node_ordering``, or ``None`` where it is missing.

    ``preserve_node_ordering(graph, {node: deps})`` wraps each ``node`` in the ``control_deps`` higher-order op
    with ``deps`` as ordering-only inputs; its lowering records them as dependencies every scheduler pass keeps
    (what Inductor's own overlap scheduling inserts to hold its order; 2.13 and 2.15 have it, checked here).
    """
    try:
        module = importlib.import_module("torch._inductor.fx_passes.control_dependencies")
    except ImportError:
        return None
    fn = getattr(module, "preserve_node_ordering", None)
    return fn if callable(fn) else None
