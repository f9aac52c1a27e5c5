"""Which arguments of a block call alias: part of the key a block is stamped by (NOTE [blocks traced once] in
``trace_once.py``).

NOTE [a stamp keeps its arguments' aliasing]
A stamp copies the recorded nodes with the recorded call's argument nodes
replaced by the new call's, node by node.  That is the new call's trace only
where the two calls' arguments alias alike:

- two arguments that were one tensor in the recorded call (``layer(h, h)``,
  ``layer(h, r=h)``, ``layer((h, h))``) were one node there, and every
  recorded node read that one node: copied for a call with two tensors,
  both arguments would read the later one.  Two tensors in the recording
  and one in the call would give the nodes of a trace where ``x is r`` was
  False (Dynamo folds ``is`` between tensors to a constant);
- two arguments that share storage (views of one base) in one call and not
  in the other: a trace can tell them apart (``x._base is r._base``);
- an argument the block can also reach without it: a graph input (the frame
  reads it by its source, a global or an attribute, again inside the block)
  or a tensor an object outside the block holds through a pending mutation
  (``self.state.first = h`` before ``layer(h)``).  The recorded nodes read
  it for both; copied for a call whose argument is another tensor, the other
  path would read the argument too.

So the aliasing is part of the call key (:func:`pattern`): for each tensor
among the arguments' leaves, the first leaf that is the same tensor (one
fake value: Dynamo's notion of one tensor), the first that shares its
storage, and the node itself where the block can reach it otherwise.  A call
whose arguments alias otherwise than a recording's gets a recording of its
own, so both patterns are stamped.  :func:`check_mapping` refuses a stamp
whose argument mapping would merge or split nodes all the same.  Whether a
lone argument is a view is not in the key (an embedding's output feeds the
first block); a block that reads a tensor's ``_base`` is not recorded
(``trace_record.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .. import _compat
from .trace_guards import StampError


def pattern(output: Any, leaves: list[Any]) -> tuple[Any, ...]:
    """How the tensors among a call's argument leaves alias (NOTE [a stamp keeps its arguments' aliasing]).

    One entry per leaf: None for a constant; for a tensor ``(same, shares, node)``: the index of the first leaf
    that is the same tensor, of the first that shares its storage, and its node where the block can reach it
    without the argument (a graph input, or a value a pending mutation holds), else None.
    """
    held: set[torch.fx.Node] | None = None
    seen: list[tuple[torch.Tensor | None, Any]] = []  # the tensors before this leaf, with their storages
    out: list[Any] = []
    for vt in leaves:
        node = _node_of(vt) if _compat.variable_kind(vt) == "tensor" else None
        value = None if node is None else node.meta.get("example_value")
        if node is None or not isinstance(value, torch.Tensor):
            out.append(None)
            seen.append((None, None))
            continue
        storage = _compat.storage_of(value)
        same = next((i for i, (v, _) in enumerate(seen) if v is value), len(seen))
        shares = next((i for i, (_, s) in enumerate(seen) if s is not None and s == storage), len(seen))
        reachable = None
        if node.op in ("placeholder", "get_attr"):
            reachable = node
        else:
            held = held_nodes(output) if held is None else held
            reachable = node if node in held else None
        out.append((same, shares, reachable))
        seen.append((value, storage))
    return tuple(out)


def held_nodes(output: Any) -> set[torch.fx.Node]:
    """The nodes of the tensors that objects existing before the frame hold through its pending mutations
    (attributes set, list and dict contents, globals and cells), reached through any value they hold; raises
    :class:`StampError` where a held value cannot be walked."""
    effects = output.side_effects
    work = [vt for vt in _compat.mutation_log(output) if not _compat.is_new_object(vt)]
    cache: dict[int, Any] = {}  # every tracker walked, by id (kept alive so an id is not reused)
    found: set[torch.fx.Node] = set()

    def collect(vt: Any) -> None:
        proxy = vt.__dict__.get("proxy")
        if isinstance(proxy, torch.fx.Proxy):
            found.add(proxy.node)
        work.extend(_compat.pending_attrs(effects, vt).values())

    while work:
        vt = work.pop()
        # Dynamo's walk over a tracker and the trackers it holds (tuple and list items, dict values, closures),
        # each met once; the attributes set on each are queued by ``collect``.
        visit = getattr(type(vt), "visit", None)
        if visit is None:
            raise StampError(f"what a pending mutation of a {type(vt).__name__} holds cannot be walked")
        visit(collect, vt, cache)
    return found


def check_mapping(old: tuple[torch.fx.Node | None, ...], new: list[torch.fx.Node | None]) -> None:
    """Refuse a stamp that would copy the recorded nodes with two argument nodes merged into one, or one split
    into two (NOTE [a stamp keeps its arguments' aliasing]); raises :class:`StampError`."""
    forward: dict[torch.fx.Node, torch.fx.Node] = {}
    backward: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, (a, b) in enumerate(zip(old, new)):
        if a is None or b is None:
            continue
        if forward.setdefault(a, b) is not b or backward.setdefault(b, a) is not a:
            raise StampError(
                f"argument {i} aliases another argument otherwise than in the recorded call (one tensor there, "
                "two here, or the reverse)"
            )


def describe(aliasing: tuple[Any, ...]) -> str:
    """``pattern``'s entries in words, for the log: ``"arguments 0 and 1 are one tensor"``, ``"argument 2 (x) is a
    graph input or held outside the block"``; ``"no aliasing"`` where no tensor aliases another or is reachable.
    Arguments are numbered as their leaves: positional ones first, tuple and list items one by one, then keyword
    arguments by name."""
    words = []
    for i, entry in enumerate(aliasing):
        if entry is None:
            continue
        same, shares, reachable = entry
        if same != i:
            words.append(f"arguments {same} and {i} are one tensor")
        elif shares != i:
            words.append(f"arguments {shares} and {i} share storage")
        if reachable is not None:
            words.append(f"argument {i} ({reachable.name}) is a graph input or held outside the block")
    return "; ".join(words) or "no aliasing"


def _node_of(vt: Any) -> torch.fx.Node | None:
    try:
        return vt.as_proxy().node
    except (AttributeError, NotImplementedError):
        return None
