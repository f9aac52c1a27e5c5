"""Floats Dynamo made dynamic, in a graph the block split cuts: each submodule makes its own and pins none of the others.

NOTE [dynamic floats in the block split]
When a float the graph reads changes (a module-level scale, a schedule value, a block's attribute, a float
argument), Dynamo recompiles with it dynamic (automatic dynamic; ``specialize_float=False``): a 0-d tensor
input and an ``item()`` giving a SymFloat ``zf0``.  AOTAutograd's tensorify pass then turns the ops reading
``zf0`` into tensor ops on that input, specializes a SymFloat it cannot (one the graph returns, one passed to an
op it has no tensor form for), and also every float symbol of the frame's shape environment that the graph it
runs on did not turn into a tensor; a specialized float restarts Dynamo, which guards on its value
(``G['GAIN'] == 2.0``).  Whole, the graph holds every float.  Cut at its blocks, each submodule holds only its
own, and the ``item()`` sits in the first block that reads it, its SymFloat an output of that block and an input
of the next: the split pinned every float, one recompile per new value until Dynamo's recompile limit sent the
frame to eager.  So:

- a SymFloat that a later submodule reads is made again there (:func:`floats_into_readers`: the ``item()`` and
  the scalar arithmetic on it, copied; the 0-d tensor crosses the cut instead), so no SymFloat leaves a
  submodule;
- while a submodule is compiled, the pass leaves the floats of the graph's other submodules alone
  (:func:`compile_keeping_floats`, ``_compat.tensorify_leaving_alone``).  A float the graph holds nowhere is
  still specialized, as stock does;
- a compile that pinned a float of its own (a guard on it added while compiling) is not shared with an
  identical block (NOTE [blocks compiled once]), whose float may have another value;
- where the pass lists a float of its submodule to pin (it then restarts Dynamo, as 2.15 does for a float it
  has no tensor op for), it lists the same float of every submodule with the same nodes with it
  (:func:`twin_floats`), which the pass pins in the whole graph at the same time: one restart, as stock.

The split then adds no guard Dynamo's trace of the whole graph would not have, and a float stays dynamic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx

from .. import _compat
from .split_key import ops_key

log = logging.getLogger(__name__)

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _value(n: torch.fx.Node) -> Any:
    return n.meta.get("example_value", n.meta.get("val"))


def _floats_of(value: Any) -> set[Any]:
    if not isinstance(value, _SYMBOLIC):
        return set()
    return {s for s in value.node.expr.free_symbols if _compat.is_float_symbol(s)}


def float_symbols(nodes: Iterable[torch.fx.Node]) -> set[Any]:
    """The float symbols (``zf0``) of the symbolic scalars ``nodes`` hold."""
    out: set[Any] = set()
    for n in nodes:
        out |= _floats_of(_value(n))
    return out


def _remade(n: torch.fx.Node, memo: dict[torch.fx.Node, bool]) -> bool:
    """Whether ``n`` is a scalar over floats alone that a submodule can make again from the graph's inputs: no side
    effect, every argument an input of the graph or such a scalar."""
    if n in memo:
        return memo[n]
    value = _value(n)
    memo[n] = (
        n.op in ("call_function", "call_method")
        and isinstance(value, _SYMBOLIC)
        and bool(_floats_of(value))
        and _floats_of(value) == set(value.node.expr.free_symbols)
        and not n.is_impure()
        and all(a.op == "placeholder" or _remade(a, memo) for a in n.all_input_nodes)
    )
    return memo[n]


def _crossing(gm: torch.fx.GraphModule, partition: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    memo: dict[torch.fx.Node, bool] = {}
    return [
        n
        for n in gm.graph.nodes
        if any(u.op != "output" and partition[u] != partition[n] for u in n.users) and _remade(n, memo)
    ]


def floats_cross_cuts(gm: torch.fx.GraphModule, partition: dict[torch.fx.Node, int]) -> bool:
    """Whether a submodule would read a SymFloat another one made (:func:`floats_into_readers` remakes it)."""
    return bool(_crossing(gm, partition))


def floats_into_readers(gm: torch.fx.GraphModule, partition: dict[torch.fx.Node, int]) -> int:
    """Make each SymFloat a later submodule reads again in that submodule (NOTE [dynamic floats in the block
    split]): its nodes copied, before the submodule's first node, reading the graph's inputs, and the nodes that
    made it moved before the first node of their own submodule, so that the block that first read it has the
    same nodes as the blocks after it; ``gm`` (a copy of Dynamo's graph) and ``partition`` are changed in place.
    Returns how many nodes were copied."""
    first: dict[int, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "get_attr", "output"):
            first.setdefault(partition[n], n)
    copies: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}

    def copy_into(n: torch.fx.Node, part: int) -> torch.fx.Node:
        if n.op == "placeholder" or partition[n] == part:
            return n
        if (n, part) not in copies:
            args = {a: copy_into(a, part) for a in n.all_input_nodes}
            with gm.graph.inserting_before(first[part]):
                new = gm.graph.node_copy(n, lambda a: args[a])
            new.meta = dict(n.meta)
            partition[new] = part
            copies[(n, part)] = new
        return copies[(n, part)]

    moved: set[torch.fx.Node] = set()

    def to_front(n: torch.fx.Node) -> None:  # the first block makes its float where the others make their copy
        if n.op == "placeholder" or n in moved or partition[n] != part:
            return
        for a in n.all_input_nodes:
            to_front(a)
        if n is not first[part]:
            first[part].prepend(n)
        moved.add(n)

    for n in _crossing(gm, partition):
        for user in [u for u in n.users if u.op != "output" and partition[u] != partition[n]]:
            user.replace_input_with(n, copy_into(n, partition[user]))
        part = partition[n]
        to_front(n)
    originals = {n for n, _ in copies}
    for n in reversed(list(gm.graph.nodes)):  # what only later submodules read, no longer made where it was
        if n in originals and not n.users:
            gm.graph.erase_node(n)
            del partition[n]
    gm.recompile()
    return len(copies)


def _made_at(gm: torch.fx.GraphModule) -> list[str | None]:
    """For each node of ``gm``, the name of the float symbol it makes (its value is the symbol itself: the
    ``item()`` of a float's input), or None."""
    out: list[str | None] = []
    for n in gm.graph.nodes:
        value = _value(n)
        made = isinstance(value, torch.SymFloat) and value.node.expr.is_Symbol and bool(_floats_of(value))
        out.append(str(value.node.expr) if made else None)
    return out


def twin_floats(subs: list[torch.fx.GraphModule]) -> Callable[[set[str]], set[str]]:
    """For float symbols (by name) one of ``subs`` makes, the floats made by the same nodes of every one of ``subs``
    with the same nodes (:func:`.split_key.ops_key`) (NOTE [dynamic floats in the block split])."""

    def twins(names: set[str]) -> set[str]:
        made = [(ops_key(sub), _made_at(sub)) for sub in subs]
        out: set[str] = set()
        for key, at in made:
            where = [i for i, name in enumerate(at) if name in names]
            for other_key, other_at in made:
                if where and other_key == key:
                    out |= {name for i in where if (name := other_at[i]) is not None}
        return out - names

    return twins


def compile_keeping_floats(
    compile_one: Callable[[torch.fx.GraphModule, list[Any]], Any],
    sub: torch.fx.GraphModule,
    args: list[Any],
    graph_floats: set[Any],
    twins: Callable[[set[str]], set[str]] | None = None,
) -> tuple[Any, bool]:
    """``compile_one(sub, args)`` with the tensorify pass leaving the floats of ``graph_floats`` that ``sub`` does
    not hold alone, and pinning with one it pins those ``twins`` names (:func:`twin_floats`); and whether the
    compile pinned one of ``sub``'s own (added a guard on it), so that it is not shared with another block
    (NOTE [dynamic floats in the block split])."""
    own = float_symbols(sub.graph.nodes)
    value = next((v for n in sub.graph.nodes if _floats_of(v := _value(n))), None)
    facts = None if value is None else _compat.shape_env_facts(value)
    seen = 0 if facts is None else sum(1 for _ in facts[1])
    with _compat.tensorify_leaving_alone({str(s) for s in graph_floats - own}, also=twins):
        compiled = compile_one(sub, args)
    if facts is None:
        return compiled, False
    after = _compat.shape_env_facts(value)
    assert after is not None  # the same value's shape environment as before
    added = list(after[1])[seen:]
    pinned = sorted({str(s) for g in added for s in g.free_symbols & own})
    if pinned:
        log.info("blocks compiled once: compiling a block pinned the float(s) %s; not shared", ", ".join(pinned))
    return compiled, bool(pinned)
