"""Point-to-point polyfills: ``isend``, ``irecv``, ``send``, ``recv``, ``batch_isend_irecv``.

They trace to ``_c10d_functional.isend`` / ``irecv`` / ``batch_p2p_ops`` where
this torch build has them (``handlers.register`` probes; without them each
call is a ``P2P_UNAVAILABLE`` graph break).  Stock Dynamo gates its own P2P
remaps behind ``torch._dynamo.config.enable_p2p_compilation``; these do not
need it.

Both sides keep their results alive (NOTE [keep-alive] in ``work``):
a send's result feeds nothing, and a receive the user ignores must still
happen for the sender to finish.

The functional ops take the peer as a *group* rank (stock's remap passes the
global rank, which is wrong in a subgroup), so the peer is translated at
trace time.  Every op returns a :class:`~.work.FunctionalWork`: waiting
on a receive copies the message into the user's tensor.  Graphs keep sends
and receives in program order (the ops are side-effectful in FX); compiler
passes that reorder collectives must keep matching pairs in the same order on
both ranks, as eager code must.

A receive from any source (``src=None``) has no functional op: graph break.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import args as c10d_args
from .args import global_rank, group_info, group_or_default, group_peer, not_in_group
from .breaks import untraceable
from .work import FunctionalWork, plain

_C = torch.ops._c10d_functional


def _not_self(group, peer: int, kind: str) -> None:
    _, _, me = group_info(group)
    if peer == me:
        raise ValueError(f"Invalid {kind} rank: {kind} rank should not be the same as the rank of the current process.")


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    peer = group_peer(group, dst, group_dst, "dist.isend")
    if not_in_group(group):
        return None
    name, _, _ = group_info(group)
    return FunctionalWork([_C.isend(plain(tensor), peer, tag, name)], [[]], keep=True)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    if not_in_group(group):
        return None
    if src is None and group_src is None:
        untraceable("dist.irecv", "a receive from any source (src=None) has no functional op; pass src")
    peer = group_peer(group, src, group_src, "dist.irecv")
    name, _, _ = group_info(group)
    out = _C.irecv(plain(tensor), peer, tag, name)
    return FunctionalWork([out], [[tensor]], source=global_rank(group, peer), keep=True)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    peer = group_peer(group, dst, group_dst, "dist.send")
    if not_in_group(group):
        return None
    _not_self(group, peer, "destination")
    isend(tensor, group=group, tag=tag, group_dst=peer).wait()  # pyright: ignore[reportOptionalMemberAccess]  # in group
    return None


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    if not_in_group(group):
        return -1
    if src is None and group_src is None:
        untraceable("dist.recv", "a receive from any source (src=None) has no functional op; pass src")
    peer = group_peer(group, src, group_src, "dist.recv")
    _not_self(group, peer, "source")
    work = irecv(tensor, group=group, tag=tag, group_src=peer)
    work.wait()  # pyright: ignore[reportOptionalMemberAccess]  # in the group: checked above
    return work.source_rank()  # pyright: ignore[reportOptionalMemberAccess]


class TracedP2POp(dist.P2POp):
    """A ``P2POp`` made in a compiled function (stock Dynamo gates ``P2POp`` itself)."""


def p2p_op(op, tensor, peer=None, group=None, tag=0, group_peer=None):
    """``dist.P2POp(...)``: a :class:`TracedP2POp` with the attributes eager's constructor sets."""
    if op is not dist.isend and op is not dist.irecv:
        raise ValueError(
            "Invalid ``op``. Expected ``op`` to be of type ``torch.distributed.isend`` or ``torch.distributed.irecv``."
        )
    group = group_or_default(group)
    p = object.__new__(TracedP2POp)
    p.op = op
    p.tensor = tensor
    p.group = group
    # The parameter ``group_peer`` shadows the helper of that name, hence the module prefix.
    p.group_peer = c10d_args.group_peer(group, peer, group_peer, "dist.P2POp")
    p.peer = global_rank(group, p.group_peer)
    p.tag = tag
    return p


def batch_isend_irecv(p2p_op_list):
    if not isinstance(p2p_op_list, list) or not all(isinstance(p, dist.P2POp) for p in p2p_op_list):
        raise ValueError("Invalid ``p2p_op_list``. Each op is expected to to be of type ``torch.distributed.P2POp``.")
    group = group_or_default(p2p_op_list[0].group)
    for p in p2p_op_list:
        if group_or_default(p.group) is not group:
            raise ValueError("All ops need to use the same group.")
    if not_in_group(group):
        return []
    name, _, _ = group_info(group)
    kinds = ["isend" if p.op is dist.isend else "irecv" for p in p2p_op_list]
    outs = _C.batch_p2p_ops(
        kinds,
        [p.group_peer for p in p2p_op_list],
        [p.tag for p in p2p_op_list],
        [plain(p.tensor) for p in p2p_op_list],
        name,
    )
    works = []
    for kind, p, out in zip(kinds, p2p_op_list, outs):
        if kind == "isend":
            works.append(FunctionalWork([out], [[]], keep=True))
        else:
            works.append(FunctionalWork([out], [[p.tensor]], source=p.peer, keep=True))
    return works


# (torch.distributed name, polyfill, functional ops it needs)
POLYFILLS = (
    ("isend", isend, ("isend",)),
    ("irecv", irecv, ("irecv",)),
    ("send", send, ("isend",)),
    ("recv", recv, ("irecv",)),
    ("batch_isend_irecv", batch_isend_irecv, ("batch_p2p_ops",)),
    ("P2POp", p2p_op, ("batch_p2p_ops",)),
)
