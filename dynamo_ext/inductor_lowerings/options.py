"""Switches and thresholds for the collective-fusion passes and lowerings: a torch config module.

Set them as attributes (``options.one_shot = True``) or for a block with
``options.patch(one_shot=True)`` (also a decorator), as for ``torch._inductor.config``.
They are part of every pass's ``uuid()`` (``options.get_hash()``), so Inductor's cache
never serves a graph compiled under other settings.  A value is checked when it is
set, not deep inside a compile: an unknown name, a switch that is not a bool, a size
that is not an int >= 0, or a device list that is not a tuple of str is refused with
the error :func:`_check` raises.
"""

import difflib
import sys
from typing import TYPE_CHECKING

from .. import _compat

if TYPE_CHECKING:
    # patch(), get_hash(), load_config() ...: what install_config_module adds at run time, typed the way torch's
    # own config modules type them (a stub-only module, never imported at run time)
    from torch.utils._config_typing import *  # noqa: F403  # pyright: ignore[reportMissingModuleSource, reportWildcardImportFromLibrary]

residual_rms_norm: bool = True
"""Fuse ``all_reduce -> wait -> add residual -> RMSNorm`` into one op (the residual RMSNorm fusion)."""

bucket_all_reduces: bool = True
"""Merge independent small all-reduces of one group, dtype and reduce op into one bucket."""

bucket_all_gathers_reduce_scatters: bool = True
"""Merge independent small (FSDP-style, dim-0) all-gathers of one group and dtype, and
reduce-scatters of one group, dtype and reduce op."""

bucket_small_bytes: int = 1 << 20
"""Only collectives of at most this many bytes join a bucket (all-gather, reduce-scatter:
the unsharded side, world size x shard)."""

bucket_cap_bytes: int = 32 << 20
"""A bucket closes before it would exceed this many bytes (counted as for ``bucket_small_bytes``)."""

keep_communication_order: bool = True
"""Add ordering dependencies so Inductor's scheduling passes keep the program's communication order in graphs
holding point-to-point ops or our own communication ops (NOTE [communication order under Inductor's passes])."""

row_fused_max_hidden: int = 1 << 16
"""Row-fused epilogue (sum recomputed per row) only when a row has at most this many elements."""

one_shot: bool = False
"""On CUDA with symmetric memory for the group, fuse the all-reduce itself (the one-shot Triton kernel, and the
two-shot kernel above ``one_shot_max_bytes``).  Off by default until measured on a GPU: the kernels are tested
under Triton's interpreter on the CPU and compiled to sm_90 PTX, but have not run on GPU hardware, so their
cross-rank barriers are opt-in (NOTE [fused all-reduce kernels opt-in] in rms_norm_fusion.py)."""

one_shot_device_types: tuple[str, ...] = ("cuda",)
"""Devices whose symmetric memory the one-shot kernel runs on (tests add "cpu" to check codegen)."""

one_shot_max_bytes: int = 1 << 20
"""Largest all-reduce input (bytes) the one-shot kernel takes; each rank reads every peer's copy."""

two_shot_max_bytes: int = 16 << 20
"""Largest all-reduce input (bytes) fused on CUDA: above ``one_shot_max_bytes`` the two-shot kernel
runs (each rank reduces 1/world of the rows, then gathers the others' finished rows); larger
inputs stay stock all-reduces.  At most ``one_shot_max_bytes`` turns the two-shot kernel off."""

one_shot_max_hidden: int = 16384
"""Longest row (elements) the fused all-reduce kernels take.  Rows above 4096 elements
(``kernels.fused_all_reduce_launch.MAX_BLOCK_N``) are walked in chunks, two passes,
so registers hold one 4096-element chunk at a time, never the row."""


def _check(name: str, value: object) -> None:
    """Refuse a bad setting of ``options.<name>`` before it is stored.

    Raises:
        AttributeError: ``name`` is not an option (with the closest option names).
        TypeError: a switch that is not a bool, a size that is not an int, a
            device list that is not a tuple of str.
        ValueError: a negative size.
    """
    defaults = _compat.config_defaults(sys.modules[__name__])
    if name not in defaults:
        close = difflib.get_close_matches(name, defaults, n=2)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; the options are {', '.join(defaults)}"
        raise AttributeError(f"dynamo_ext.inductor_lowerings.options has no option {name!r}{hint}")
    kind = type(defaults[name])
    if kind is bool and not isinstance(value, bool):
        raise TypeError(f"options.{name} is a switch: set True or False, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"options.{name} is a size (an int), got {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"options.{name} must be 0 or more, got {value}")
    if kind is tuple and not (isinstance(value, tuple) and all(isinstance(v, str) for v in value)):
        raise TypeError(f"options.{name} is a tuple of device types such as ('cuda',), got {value!r}")


_compat.install_checked_config_module(sys.modules[__name__], _check)
