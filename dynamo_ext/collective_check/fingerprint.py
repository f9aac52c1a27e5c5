"""The collective sequence of an FX graph: what every rank of a group must issue alike.

NOTE [collective fingerprint]
A fingerprint lists a graph's collectives in graph order (the order the
compiled code issues them; Inductor keeps it, and the bucketing pass keeps it
rank-consistent, NOTE [rank-invariant first use]).  Each entry holds only what
the ranks of the group must agree on: the op, the group, the reduce op, the
input shapes and dtypes, and the op's other scalar arguments.  Everything else
in the graph (the compute around the collectives, which may depend on the rank)
is left out, so rank-dependent compute with the same collectives is no
mismatch.  Left out too, because they legitimately differ per rank:

* the split sizes of ``all_to_all_single`` and the dim 0 of its input (uneven
  splits);
* point-to-point ops (``isend``, ``irecv``, ``batch_p2p_ops``): their peers are
  rank-dependent by design;
* symbolic sizes are written as ``?`` (their values are checked by the collective itself).

The user's frame that issued the collective (file name and line, :attr:`CollectiveSignature.site`)
is compared too: the ranks' streams are compared position by position across
graph boundaries (NOTE [collective stream check]), and two all-reduces of equal
shape issued by different lines (``if rank == 0: all_reduce(x)`` on one rank, an
all-reduce every rank issues elsewhere on the others) would otherwise look
alike and pair.  Only the innermost user frame counts: graph breaks cut the
outer frames differently per rank (a resumed function has no caller in its
graph), so comparing whole stacks would fail correct programs.  The file is
compared by its base name, so installs in different directories on different
hosts agree; the same line reached through different callers is not told apart.

Groups: two ranks that are both in an entry's group must name the same group;
ranks in different groups of the same shape (tensor-parallel group 0 and group 1
of a 2-D mesh) compare the groups' rank patterns (ranks minus the group's first
rank), so ``tp`` and ``dp`` of a mesh stay apart.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from .. import _compat
from ..fx import collectives as fx_collectives
from ..rank_ranges import format_ranks

_SPLIT_ARGS = frozenset({"output_split_sizes", "input_split_sizes"})
# Arguments that name the group or the reduce op: compared through ``group``/``ranks`` and ``reduce_op``.
_GROUP_ARGS = frozenset({"group_name", "group", "process_group", "tag"})
_REDUCE_ARGS = frozenset({"reduce_op", "reduceOp", "op"})


@dataclasses.dataclass(frozen=True)
class CollectiveSignature:
    """One collective of a graph, in the form ranks exchange (JSON-able fields).

    Attributes:
        op: ``namespace.name`` of the op (``_c10d_functional.all_reduce``).
        group: the process group's name (``""`` when the graph names none).
        ranks: the group's global ranks, sorted (empty when unknown).
        reduce_op: the reduce op (``"sum"``, ...) or ``""``.
        tensors: ``"dtype[d0,d1,...]"`` per tensor input, symbolic sizes as ``?``.
        args: the op's other scalar arguments, ``name=value``.
        phase: ``"forward"`` or ``"backward"`` (which graph of the pair it sits in).
        source: the user's source line (``file:line: code``) or ``""``; compared by :attr:`site`.
    """

    op: str
    group: str
    ranks: tuple[int, ...]
    reduce_op: str
    tensors: tuple[str, ...]
    args: tuple[str, ...]
    phase: str
    source: str = ""

    @property
    def site(self) -> str:
        """``basename:line`` of :attr:`source` (what ranks compare), ``""`` without a source."""
        head = self.source.split(": ", 1)[0]
        return os.path.basename(head)

    def describe(self) -> str:
        """One line for error messages: ``all_reduce(float32[4, 4], sum) on group '0' (ranks 0–3)``.

        Ranks as every message and report writes them (:func:`dynamo_ext.rank_ranges.format_ranks`).
        """
        inner = ", ".join((*self.tensors, *([self.reduce_op] if self.reduce_op else []), *self.args))
        return (
            f"{self.phase} {self.op.split('.')[-1]}({inner}) on group {self.group!r} (ranks {format_ranks(self.ranks)})"
        )

    def to_json(self) -> list[Any]:
        return [
            self.op,
            self.group,
            list(self.ranks),
            self.reduce_op,
            list(self.tensors),
            list(self.args),
            self.phase,
            self.source,
        ]

    @classmethod
    def from_json(cls, row: Sequence[Any]) -> CollectiveSignature:
        op, group, ranks, reduce_op, tensors, args, phase, source = row
        return cls(op, group, tuple(ranks), reduce_op, tuple(tensors), tuple(args), phase, source)


def _pattern(ranks: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(r - ranks[0] for r in ranks) if ranks else ()


def same_collective(mine: CollectiveSignature, theirs: CollectiveSignature, my_rank: int, their_rank: int) -> bool:
    """Whether rank ``my_rank`` issuing ``mine`` and rank ``their_rank`` issuing ``theirs`` agree.

    Equal op, reduce op, tensors, arguments and issuing line (:attr:`CollectiveSignature.site`);
    the same group when either rank is in the other's group, else groups of the
    same rank pattern (NOTE [collective fingerprint]).
    """
    if (mine.op, mine.reduce_op, mine.tensors, mine.args, mine.phase, mine.site) != (
        theirs.op,
        theirs.reduce_op,
        theirs.tensors,
        theirs.args,
        theirs.phase,
        theirs.site,
    ):
        return False
    if their_rank in mine.ranks or my_rank in theirs.ranks or not mine.ranks or not theirs.ranks:
        return (mine.group, mine.ranks) == (theirs.group, theirs.ranks)
    return _pattern(mine.ranks) == _pattern(theirs.ranks)


def first_difference(
    mine: Sequence[CollectiveSignature], theirs: Sequence[CollectiveSignature], my_rank: int, their_rank: int
) -> int | None:
    """Index of the first collective where the sequences differ (``len`` of the shorter one when one
    is a prefix of the other), ``None`` when they agree."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if not same_collective(a, b, my_rank, their_rank):
            return i
    return None if len(mine) == len(theirs) else min(len(mine), len(theirs))


def _dim(s: Any) -> str:
    return str(s) if isinstance(s, int) else "?"


def _tensor_spec(val: Any, *, skip_dim0: bool = False) -> str | None:
    if not isinstance(val, torch.Tensor):
        return None
    dims = [_dim(s) for s in val.shape]
    if skip_dim0 and dims:
        dims[0] = "*"
    return f"{str(val.dtype).removeprefix('torch.')}[{', '.join(dims)}]"


def _source_line(coll: fx_collectives.FxCollective) -> str:
    """``file:line: code`` of the user's frame that issued ``coll`` (:attr:`FxCollective.user_frame`), or ``""``."""
    frame = coll.user_frame
    return f"{frame[0]}:{frame[1]}: {frame[3]}".rstrip(": ") if frame else ""


def collectives(gm: torch.fx.GraphModule, phase: str = "forward") -> list[CollectiveSignature]:
    """The collectives of ``gm`` in graph order (subgraphs of higher-order ops where they are called).

    Read by :func:`dynamo_ext.fx.collectives.iter_collectives` (NOTE [one collective reader]);
    point-to-point ops are left out (NOTE [collective fingerprint]).

    Args:
        gm: an FX graph whose nodes carry ``meta["val"]`` (AOTAutograd's forward,
            backward or inference graph); tensors without it count as ``"?"``.
        phase: written into each entry.
    """
    return [
        _signature(c, phase) for c in fx_collectives.iter_collectives(gm, into_subgraphs=True) if not c.point_to_point
    ]


def _signature(coll: fx_collectives.FxCollective, phase: str) -> CollectiveSignature:
    all_to_all = coll.name == "all_to_all_single"
    tensors, args = [], []
    for arg_name, value in coll.arguments.items():
        if arg_name in _GROUP_ARGS and not isinstance(value, (torch.fx.Node, list, tuple)):
            continue  # the group: ``coll.group``
        if arg_name in _REDUCE_ARGS and isinstance(value, str):
            continue  # the reduce op: ``coll.reduce_op``
        if arg_name in _SPLIT_ARGS:
            continue
        if isinstance(value, torch.fx.Node) or (
            isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.fx.Node) for v in value)
        ):
            for v in value if isinstance(value, (list, tuple)) else (value,):
                spec = _tensor_spec(v.meta.get("val"), skip_dim0=all_to_all)
                tensors.append(spec if spec is not None else "?")
        else:
            args.append(f"{arg_name}={value!r}")
    return CollectiveSignature(
        coll.op, coll.group, coll.ranks, coll.reduce_op, tuple(tensors), tuple(args), phase, _source_line(coll)
    )


def _compared(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a collective the ranks compare (not a wait, not point-to-point)."""
    coll = fx_collectives.read(node) if node.op == "call_function" else None
    return coll is not None and not coll.point_to_point


def data_flow(gm: torch.fx.GraphModule) -> str:
    """The data flow between ``gm``'s collectives, as text equal on ranks whose flow is equal.

    What a plan of collective buckets depends on besides the collectives
    themselves (NOTE [rank-invariant first use], NOTE [buckets only where ranks
    agree]): for each collective, which earlier collectives' results reach its
    input and whether its result is used; for each node with side effects (and
    each higher-order op) that reads a collective's result, which results reach
    it; and where each other communication op sits (``p``: a point-to-point op,
    whatever its peer or direction; one of the plugin's communication ops or a
    higher-order op holding communication, with what reaches it), in graph order.  A bucket closes at any communication op (NOTE [buckets keep
    the communication order] in ``inductor_lowerings/bucketing.py``), so ranks
    whose point-to-point ops sit elsewhere among their collectives would plan
    other buckets: their flows differ and none of them merges.  Compute that does
    not feed a collective or a node with side effects is left out.
    """
    reach: dict[torch.fx.Node, int] = {}
    out: list[str] = []
    index = 0
    for node in gm.graph.nodes:
        mask = 0
        for a in node.all_input_nodes:
            mask |= reach.get(a, 0)
        if _compared(node):
            used = any(u.users for u in node.users)
            out.append(f"c{mask:x}{'u' if used else ''}")
            mask |= 1 << index
            index += 1
        elif fx_collectives.is_communication(node):
            # a point-to-point op's input differs by direction (a send's payload, a receive's buffer)
            out.append("p" if fx_collectives.is_point_to_point(node) else f"p{mask:x}")
        elif mask and node.op == "call_function" and (node.is_impure() or _compat.is_higher_order_op(node.target)):
            out.append(f"i{mask:x}")
        reach[node] = mask
    return " ".join(out)
