"""Module names for the communication report: fully qualified names found by identity, not Dynamo's paths.

NOTE [module names by identity]
Dynamo names each module of a node's ``nn_module_stack`` by the path it took from the traced frame's locals to
reach it: ``L['self'].layers.0.attention``.  A module reached through a wrapper is spelled through the wrapper:
torchtitan 0.3.0 replaces each parallelized module's ``forward`` with a closure over the original bound method,
so its submodules read ``L['self'].layers.0.attention.forward.__closure__[0].cell_contents.__self__.wo``.  The
report names modules as ``named_modules()`` and the state dict do (``layers.0.attention.wo``): when a Dynamo
graph is logged, each path of its nodes is followed from the frame's locals and globals to the module object
(:func:`resolve`), and the object is named by its place in the root module's ``named_modules()`` (the model of
the step the audit trains when it knows one, else the module the path starts from), activation checkpointing's
``_checkpoint_wrapped_module`` left out as the state dict leaves it out.  A path that cannot be followed (a
frame gone, a spelling this reader does not know) keeps its spelling, without the hops through a function's
closure (:func:`without_closures`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)

_ROOT = re.compile(r"^(?P<scope>[LG])\[(?P<quote>['\"])(?P<name>[^'\"]*)(?P=quote)\]")
_STEP = re.compile(r"\.(?P<attr>[A-Za-z_0-9]+)|\[(?P<index>-?\d+)\]|\[(?P<quote>['\"])(?P<key>[^'\"]*)(?P=quote)\]")
_CLOSURE_HOP = re.compile(r"\.[A-Za-z_]\w*\.__closure__\[\d+\]\.cell_contents(?:\.__self__)?")
CHECKPOINT_WRAPPED = "._checkpoint_wrapped_module"


def resolve(path: str, f_locals: dict[str, Any], f_globals: dict[str, Any]) -> Any:
    """The object Dynamo's source path ``path`` names, followed from ``f_locals`` (``L``) and ``f_globals`` (``G``).

    Steps: ``.name`` (an attribute, or a child module of that name: ``layers.0``), ``[i]`` and ``['key']``
    (an item; a module's child by index or name).

    Raises:
        LookupError: the path is not one this reader follows, or a step names nothing.
    """
    m = _ROOT.match(path)
    if m is None:
        raise LookupError(f"not a path from the frame's locals or globals: {path!r}")
    scope = f_locals if m.group("scope") == "L" else f_globals
    if m.group("name") not in scope:
        raise LookupError(f"{path!r}: no {m.group(0)}")
    obj = scope[m.group("name")]
    pos = m.end()
    while pos < len(path):
        step = _STEP.match(path, pos)
        if step is None:
            raise LookupError(f"{path!r}: cannot follow {path[pos:]!r}")
        obj = _step(obj, step)
        pos = step.end()
    return obj


def _step(obj: Any, step: re.Match[str]) -> Any:
    attr, index, key = step.group("attr"), step.group("index"), step.group("key")
    try:
        if attr is not None:
            children = getattr(obj, "_modules", None)
            if isinstance(obj, torch.nn.Module) and isinstance(children, dict) and attr in children:
                return children[attr]
            return getattr(obj, attr)
        if index is not None:
            return obj[int(index)]
        return obj[key]
    except (AttributeError, IndexError, KeyError, TypeError) as e:
        raise LookupError(f"{step.group(0)!r}: {type(e).__name__}: {e}") from None


def without_closures(path: str) -> str:
    """``path`` without hops through a function's closure: ``a.forward.__closure__[0].cell_contents.__self__.wo``
    -> ``a.wo`` (a bound method's ``__self__`` is the module the function belongs to)."""
    return _CLOSURE_HOP.sub("", path)


def fully_qualified_names(
    paths: Iterable[str], f_locals: dict[str, Any], f_globals: dict[str, Any], root: torch.nn.Module | None = None
) -> dict[str, str]:
    """``{path: name}`` for each of Dynamo's module ``paths`` this reader can name (NOTE [module names by identity]).

    ``name`` is the module's name in ``root.named_modules()`` (``"<root>"`` for ``root`` itself), ``root`` being
    the given one, else the module each path starts from.  Paths that do not resolve to a module inside the
    root are left out.
    """
    names_of: dict[int, dict[int, str]] = {}
    out: dict[str, str] = {}
    for path in paths:
        try:
            module = resolve(path, f_locals, f_globals)
            top = root if root is not None else resolve(_ROOT.match(path).group(0), f_locals, f_globals)  # type: ignore[union-attr]
        except LookupError as e:
            log.debug("module path %s not followed: %s", path, e)
            continue
        if not isinstance(module, torch.nn.Module) or not isinstance(top, torch.nn.Module):
            continue
        if id(top) not in names_of:
            names_of[id(top)] = {
                id(m): name.replace(CHECKPOINT_WRAPPED, "").lstrip(".") for name, m in top.named_modules()
            }
        name = names_of[id(top)].get(id(module))
        if name is not None:
            out[path] = name or "<root>"
    return out
