"""Where a node of a compiled FX graph came from: the user's frame in its stack trace, the group it names.

The communication report (:mod:`dynamo_ext.audit.rank.comm`) and the collective
check (:mod:`dynamo_ext.collective_check.fingerprint`) both point a user at the
line that issued a collective and name its process group; they read both here,
so a report and a mismatch error name the same line for the same collective.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

__all__ = ["group_name", "stack_frames", "user_frame"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)\n(.*)$', re.M)
# FX names the code it generates ``<eval_with_key>.N``, N counting the graph modules made so far in the process.
_GENERATED = re.compile(r"^(<eval_with_key>)\.\d+$")


def stack_frames(stack_trace: str | None) -> list[tuple[str, int, str, str]]:
    """``(file, line, function, source)`` of each frame of an FX ``meta["stack_trace"]``, outermost first.

    NOTE [generated code has no per-process number]: a frame in code FX generated (a graph module Dynamo traced:
    a compiled-autograd backward, a split graph's submodule) is filed under ``<eval_with_key>``, without the
    ``.N`` FX appends.  N counts the graph modules made so far in each process, so a rank that compiled one more
    graph (a recompile for its own batch size) would name the same line otherwise, and the collective check would
    compare ranks' lines unequal.
    """
    return [(_GENERATED.sub(r"\1", f), int(n), fn, src.strip()) for f, n, fn, src in _FRAME.findall(stack_trace or "")]


def _is_torch(path: str) -> bool:
    return path.startswith(_TORCH_DIR) or path.startswith("torch" + os.sep)


def _internal(path: str) -> bool:
    """torch's or dynamo-ext's own code; the bundled examples (``example_*.py``) are user code."""
    if _is_torch(path) or path.startswith("<"):
        return True
    return path.startswith(_PKG_DIR) and not os.path.basename(path).startswith("example_")


def user_frame(stack_trace: str | None) -> tuple[str, int, str, str] | None:
    """(file, line, function, source) of the deepest frame of an FX ``stack_trace`` outside torch and dynamo-ext.

    When every frame is internal (FSDP2's root hook): the outermost frame outside
    torch (where the plugin's code was entered), else the deepest frame; ``None``
    without a stack trace.
    """
    frames = stack_frames(stack_trace)
    if not frames:
        return None
    user = next((f for f in reversed(frames) if not _internal(f[0])), None)
    return user or next((f for f in frames if not _is_torch(f[0])), frames[-1])


def group_name(value: Any) -> str:
    """A functional collective's ``group_name`` argument as a string: the name, or a group object's name."""
    if isinstance(value, str):
        return value
    name = getattr(value, "group_name", None)
    return name if isinstance(name, str) else str(value if value is not None else "")
