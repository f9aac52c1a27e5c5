"""Stable identities, distributed causes and fixes for graph breaks.

A break's identity is ``gb_type | file:line | function`` with ``file`` made
independent of the machine (:func:`normalize_path`), so two runs, two
checkouts or two torch releases name the same break the same way.
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Sequence

import torch

from ... import graph_breaks

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FX_FILE = re.compile(r"<eval_with_key>\.\d+")
_SITE = re.compile(r".*[/\\](?:site|dist)-packages[/\\]")
_STDLIB = sysconfig.get_paths()["stdlib"].rstrip(os.sep) + os.sep

# Our own gb_types, and stock paths and words that mean distributed code.
PLUGIN_GB_TYPES = frozenset(t.gb_type for t in graph_breaks.ALL)
_DIST_PATH = re.compile(r"torch[/\\]distributed[/\\]")
_DIST_WORDS = re.compile(
    r"ProcessGroup|DeviceMesh|DTensor|torch\.distributed|_c10d|c10d|all_gather_object|FSDP|fully_shard|Placement|funcol"
)


_ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")


def target_root(path: str) -> str:
    """The root identities are relative to: the nearest directory at or above ``path`` holding a
    ``pyproject.toml``, ``setup.py``, ``setup.cfg`` or ``.git``; else ``path``'s own directory.

    ``path`` is the target script, or the file of a ``module:function`` target's module
    (its import root is then found the same way).
    """
    ap = os.path.abspath(path)
    start = ap if os.path.isdir(ap) else os.path.dirname(ap)
    d = start
    while True:
        if any(os.path.exists(os.path.join(d, m)) for m in _ROOT_MARKERS):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return start
        d = parent


def normalize_path(path: str, *, root: str | None = None) -> str:
    """``path`` as it appears in identities: never an absolute path of this machine.

    From after ``site-packages/`` for installed packages; relative to ``root``
    (the target's root, :func:`target_root`; default: the working directory) when
    under it; ``<stdlib>/...`` for Python's own library; else ``<external>/`` and
    the file's last two path components.  FX's generated code is ``<fx-generated>``.
    """
    if not path or path.startswith("<"):
        # FX's generated code (compiled autograd graphs) is numbered per process.
        return _FX_FILE.sub("<fx-generated>", path or "")
    root = os.path.abspath(root or os.getcwd())
    ap = os.path.abspath(path)
    m = _SITE.match(ap)  # first: a virtualenv may live under the root
    if m:
        return ap[m.end() :]
    if ap.startswith(root.rstrip(os.sep) + os.sep):
        return os.path.relpath(ap, root)
    if ap.startswith(_STDLIB):
        return "<stdlib>/" + os.path.relpath(ap, _STDLIB)
    parts = ap.split(os.sep)
    return "<external>/" + "/".join(p for p in parts[-2:] if p)


def is_torch_file(path: str) -> bool:
    """Whether ``path`` (absolute or normalized) is part of torch itself."""
    return path.startswith(_TORCH_DIR) or path.startswith("torch" + os.sep)


def user_frame_index(files: Sequence[str]) -> int:
    """Index of the deepest frame outside torch (the line the user wrote), else the deepest."""
    for i in range(len(files) - 1, -1, -1):
        if not is_torch_file(files[i]) and not files[i].startswith("<"):
            return i
    return len(files) - 1


def is_distributed_cause(gb_type: str, files: Sequence[str], text: str = "") -> bool:
    """Whether a break comes from distributed code: our gb_types, torch.distributed frames, or its objects."""
    if gb_type in PLUGIN_GB_TYPES or gb_type.startswith("dynamo_ext:"):
        return True
    if any(_DIST_PATH.search(f) for f in files):
        return True
    return bool(_DIST_WORDS.search(text))


def break_id(gb_type: str, file: str, line: int, function: str) -> str:
    """The stable identity of a break."""
    return f"{gb_type} | {file}:{line} | {function}"


# ---- fixes -------------------------------------------------------------------------
# (pattern over gb_type + context + source + stack files, fix); first match wins.
_FIXES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p, re.I | re.S), fix)
    for p, fix in (
        (
            r"_object\b|object collective",
            "Object collectives (all_gather_object, broadcast_object_list, ...) pickle Python objects and "
            "exchange sizes first; move the call out of the compiled function, or send tensors with "
            "all_gather_into_tensor / broadcast.",
        ),
        (
            r"async_op\s*=\s*True|\bWork\b|\.wait\(\)",
            "async_op=True returns a c10d Work handle that stock Dynamo cannot trace: call the functional "
            "collective (torch.distributed._functional_collectives.all_reduce(...), then .wait() or use the result), "
            "or install dynamo-ext (dynamo_ext.install()), which traces async_op=True into it.",
        ),
        (
            r"\bbarrier\b",
            "A barrier orders nothing inside a graph: collectives in a compiled graph already run in program order "
            "on every rank. Remove it from the compiled function, or call it before/after the compiled call.",
        ),
        (
            r"new_group|init_device_mesh|new_subgroups|process group creation|split_group",
            "Creating process groups or meshes is a rendezvous with global side effects; create them once before "
            "compiling and pass them in or close over them.",
        ),
        (
            r"fsdp|fully_shard|FSDPParam",
            "FSDP2's hooks run eagerly around compiled regions: compile each transformer block "
            "(torch.compile(block) before fully_shard) so the hooks sit between graphs, and enable compiled "
            "autograd (torch._dynamo.config.compiled_autograd = True) so the backward hooks are traced.",
        ),
        (
            r"DTensor|redistribute|from_local|to_local|Placement|Shard\(|Replicate\(",
            "Stock Dynamo does not model this DTensor call: install dynamo-ext (dynamo_ext.install()), or do the "
            "DTensor conversion (from_local/to_local/redistribute with constant placements) outside the compiled "
            "function.",
        ),
        (
            r"ProcessGroup|DeviceMesh|get_rank|get_world_size|get_group_rank",
            "Reading this from a process group or mesh is not modelled by stock Dynamo: install dynamo-ext "
            "(dynamo_ext.install()), or read the value outside the compiled function and pass it in.",
        ),
    )
)


def fix_for(gb_type: str, text: str, hints: Sequence[str], distributed: bool) -> str:
    """A concrete fix: ours for distributed causes, else Dynamo's first hint."""
    for t in graph_breaks.ALL:
        if t.gb_type == gb_type:
            # Ours, with the extra hints the raising tracker added; not Dynamo's generic ones.
            own = [h for h in hints if "earlier graph break" not in h] or list(t.hints)
            return " ".join(own)
    if distributed:
        haystack = f"{gb_type}\n{text}"
        for pattern, fix in _FIXES:
            if pattern.search(haystack):
                return fix
        return "A distributed object or call stock Dynamo cannot trace: install dynamo-ext (dynamo_ext.install())."
    return hints[0] if hints else ""
