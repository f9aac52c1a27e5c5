"""Every private Inductor / symmetric-memory API the lowerings touch, probed by feature.

Supported: torch 2.11 to 2.15.  Each function here is a small probe (import
attempt or ``hasattr``), never a version comparison, so the rest of the package
names no private module directly.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from .._compat import has_functional_op, optional_attr


# ---- Inductor: config, lowering table, custom passes -----------------------------
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
    """``torch._inductor.custom_graph_pass.CustomGraphPass`` (all supported releases)."""
    return importlib.import_module("torch._inductor.custom_graph_pass").CustomGraphPass


def hash_for_files(paths: tuple[str, ...], extra: str = "") -> bytes:
    """``get_hash_for_files`` with the ``extra`` argument (a plain sha256 where it lacks one)."""
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
    """``ir._CollectiveKernel``: the IR class Inductor's comm reordering treats as a collective."""
    return ir_module()._CollectiveKernel


def virtualized() -> Any:
    """``torch._inductor.virtualized.V`` (the graph being lowered, the ops handler)."""
    return importlib.import_module("torch._inductor.virtualized").V


def ops_handler() -> Any:
    """``torch._inductor.virtualized.ops`` for writing inner functions."""
    return importlib.import_module("torch._inductor.virtualized").ops


# ---- Inductor comm buffers (symmetric memory) -------------------------------------
def comm_buffer_api() -> tuple[Callable[..., bool], Callable[..., None], Any] | None:
    """``(can_realize_as_comm_buffer, realize_as_comm_buffer, CommBufferType.SYMM_MEM)`` or None."""
    comm = importlib.import_module("torch._inductor.comm_lowering")
    ir = ir_module()
    can = getattr(comm, "can_realize_as_comm_buffer", None)
    realize = getattr(comm, "realize_as_comm_buffer", None)
    kind = getattr(getattr(ir, "CommBufferType", None), "SYMM_MEM", None)
    if can is None or realize is None or kind is None:
        return None
    return can, realize, kind


# ---- torch.distributed symmetric memory ---------------------------------------------
def symm_mem_module() -> Any:
    """``torch.distributed._symmetric_memory`` or None where this build lacks it."""
    try:
        return importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return None


def is_symm_mem_enabled_for_group(group_name: str) -> bool:
    """Stock's own test: whether symmetric memory is set up for ``group_name``."""
    mod = symm_mem_module()
    fn = getattr(mod, "is_symm_mem_enabled_for_group", None)
    return bool(fn is not None and fn(group_name))


def symm_mem_state_key() -> str:
    """A string that changes when the set of symmetric-memory groups changes (for pass uuids)."""
    mod = symm_mem_module()
    groups = sorted(getattr(mod, "_group_name_to_store", {}) or {})
    test_mode = getattr(mod, "_is_test_mode", False)
    return f"symm:{groups}:{test_mode}:{getattr(mod, '_mocked_group_names', None)}"


def symm_mem_test_mode() -> Callable[..., Any] | None:
    """``_symmetric_memory._test_mode`` (forces the enabled check; tests only) or None."""
    return getattr(symm_mem_module(), "_test_mode", None)


def symm_mem_rendezvous(tensor: torch.Tensor, group_name: str) -> Any:
    """``_symmetric_memory.rendezvous(tensor, group_name)``; raises RuntimeError when not a symm tensor."""
    return symm_mem_module().rendezvous(tensor, group_name)


# ---- functional collectives, triton, library ----------------------------------------
def has_functional_collectives() -> bool:
    """Whether ``_c10d_functional.all_reduce`` / ``wait_tensor`` exist in this build."""
    return has_functional_op("all_reduce") and has_functional_op("wait_tensor")


@functools.cache
def has_triton() -> bool:
    """Whether triton imports (the kernels need it; the CPU lowerings do not)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def destroy_library(lib: torch.library.Library) -> None:
    """Remove every definition and implementation ``lib`` registered (``Library._destroy``)."""
    lib._destroy()


def detect_fake_mode(values: list[Any]) -> Any:
    """``torch._guards.detect_fake_mode`` over example values (None when none are fake)."""
    fn = optional_attr("torch._guards", "detect_fake_mode")
    return fn(values) if fn is not None else None


# ---- symmetric memory: the supported route per release -----------------------------
# NOTE [symmetric memory route]
# Where ``enable_symm_mem_for_group`` exists and is not marked deprecated (2.11, 2.12),
# a group must be registered with it before Inductor's ``empty_strided_p2p`` can
# allocate for it; where it is deprecated (2.13+, "there is no need to call this
# function anymore") or gone, every group is set up on first rendezvous and
# ``is_symm_mem_enabled_for_group`` only reflects the deprecated registry, so it must
# not gate the fusion.  Either way the decision to fuse never reads that local
# registry: it depends only on what every rank shares (the graph, the options, the
# build), and the registration is a side effect of the decision.
_ENABLED_BY_US: set[str] = set()


def symm_mem_route() -> str:
    """How a group gets symmetric memory on this build (NOTE [symmetric memory route]).

    ``"none"``: no symmetric memory here (no ``_symmetric_memory`` module or no
    ``rendezvous``); ``"enable"``: ``enable_symm_mem_for_group`` must be called once per
    group; ``"automatic"``: nothing to call.
    """
    mod = symm_mem_module()
    if mod is None or getattr(mod, "rendezvous", None) is None:
        return "none"
    enable = getattr(mod, "enable_symm_mem_for_group", None)
    if enable is None or getattr(enable, "__deprecated__", None) is not None:
        return "automatic"
    return "enable"


def ensure_symm_mem_for_group(group_name: str) -> None:
    """Set ``group_name`` up for symmetric memory by this release's route; idempotent.

    Raises RuntimeError (naming the group and the fix) where the route fails: the
    caller has already decided to fuse on every rank, so this rank must not quietly
    take another path.
    """
    route = symm_mem_route()
    if route == "none":
        raise RuntimeError(f"symmetric memory is not available in this torch build (group {group_name!r})")
    if route == "automatic" or is_symm_mem_enabled_for_group(group_name):
        return
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem_module().enable_symm_mem_for_group(group_name)
    except (TypeError, RuntimeError, KeyError, ValueError) as e:
        raise RuntimeError(
            f"dynamo_ext: could not set up symmetric memory for process group {group_name!r} on this rank "
            f"({type(e).__name__}: {e}); the fused all-reduce kernels need it on every rank. Turn them off on "
            "every rank with dynamo_ext.inductor_lowerings.options.one_shot = False"
        ) from e
    _ENABLED_BY_US.add(group_name)


def forget_symm_mem_groups() -> None:
    """Drop the groups :func:`ensure_symm_mem_for_group` registered from the Python registry (uninstall)."""
    registry = getattr(symm_mem_module(), "_group_name_to_store", None)
    for name in _ENABLED_BY_US:
        if registry is not None:
            registry.pop(name, None)
    _ENABLED_BY_US.clear()


def is_symm_mem_tensor(tensor: torch.Tensor) -> bool | None:
    """Whether ``tensor`` was allocated from symmetric memory; None where this build cannot tell (no probe)."""
    fn = getattr(symm_mem_module(), "is_symm_mem_tensor", None)
    return None if fn is None else bool(fn(tensor))


def emit_structured_artifact(name: str, payload: dict[str, Any]) -> None:
    """``torch._logging.trace_structured("artifact", ...)`` with a JSON payload (tlparse, the audit)."""
    import json

    trace_structured = importlib.import_module("torch._logging").trace_structured
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=lambda: json.dumps(payload, sort_keys=True),
    )


# ---- the compile entry our post-grad passes re-chain at -------------------------------
def compile_fx_module() -> Any:
    """``torch._inductor.compile_fx``, whose ``compile_fx`` the ``inductor`` backend looks up at each compile.

    Dynamo's registered ``inductor`` backend imports ``compile_fx`` from this
    module when called (2.11 to 2.15), so a wrapper set on the module runs at the
    start of every Inductor compile through ``torch.compile``.
    """
    return importlib.import_module("torch._inductor.compile_fx")
