"""FSDP2's unshard of one parameter group, traced: one all-gather per group, as eager FSDP2 issues.

NOTE [FSDP2 gathers per group]
Eager FSDP2 unshards a parameter group with one collective: ``foreach_all_gather``
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) copies every parameter's padded
local shard into one flat buffer (``all_gather_copy_in``), all-gathers it, and copies each
parameter's rows out of the ``(W, N)`` result (``split_with_sizes_copy``); the gradients go
back through one reduce-scatter of a buffer laid out the same way (``foreach_reduce``'s
``chunk_cat``: row ``r`` holds every gradient's ``r``-th chunk, in parameter order).

The traced group gathers the same way, with ordinary ops: the padded shards are flattened and
concatenated, all-gathered in one collective, and the ``(W, N)`` result is split by columns
into each parameter's ``(W * R_i, ...)`` gather (``reduce.gather_group``).  Each goes through
``reduce.GatheredParam``: the identity in forward; in backward, FSDP2's reduction of that
parameter's gradient into its local shard (NOTE [FSDP2 gradients in traced graphs]).  So the
reduce-scatters stay one per parameter with a gradient, where eager FSDP2 issues one per group
(``foreach_reduce``): one reduction of the group's buffer would reduce zeros for a parameter the
forward did not use and give it a zero gradient, where eager FSDP2 leaves ``None`` (and AdamW
would then decay it).  With ``inductor`` the bucketing pass merges them (NOTE [all-gather /
reduce-scatter buckets]).  Parameters whose reductions differ (another reduce or param dtype,
another original dtype), or that need no gradient, are gathered apart: one gather per kind, in
the order of each kind's first parameter.  A gather of one parameter is ``reduce.FSDPAllGather``
of its shard, with no copy.

One exception: the root's group when it is gathered again in backward (``reshard_after_forward``)
gathers each parameter on its own.  Its modules run on both sides of the blocks (the embedding
first, the output projection last); the block split (NOTE [values that would cross a cut],
``dynamo_ext/blocks/split.py``) moves a gather read only after the blocks to its reader, where
backward gathers it again, but a gather read on both sides stays before them and its results
would be saved for backward: all the root's unsharded parameters, from the end of forward on.

Why a group and not a parameter: the all-gathers are eager FSDP2's, one per group instead of one
per parameter (nine per Llama block, gathered again in backward), and a backend that does not
bucket them (``aot_eager``) launches each on its own.  The grouping depends only on the group's parameters and FSDP2's
settings, the same on every rank (uneven shards are padded): every rank traces the same
collectives.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ... import _compat, graph_breaks
from ..base import wrap_constant
from . import gather_stamps, reduce

log = logging.getLogger(__name__)


def gather_with_fsdp_backward(param_group: Any, root: bool, *locals_: Any) -> Any:
    """All-gather the local shards of ``param_group``'s parameters (one per ``fsdp_params`` entry, in order);
    ``root``: the group is the root state's (NOTE [FSDP2 gathers per group]).

    Returns a tuple: per parameter, its padded shard gathered along dim 0 (``[W * R, ...]``, W = shard
    world size, R = FSDP2's padded shard rows) in ``param_dtype``; backward: FSDP2's reduction.  Traced by
    :func:`_gather_handler`; never called eagerly.
    """
    raise RuntimeError("gather_with_fsdp_backward is only meaningful inside a graph traced by dynamo-ext")


def _buckets(fsdp_params: list[Any], param_group: Any, apart: bool) -> dict[tuple[Any, ...], list[int]]:
    """The group's parameters by gather: indices per key (reduction fields, original dtype, needs a gradient;
    with ``apart`` the parameter's index too: a gather each).

    Raises ``NotImplementedError`` / ``ValueError`` from ``reduce.plan`` (a reduction not mirrored).
    """
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, fsdp_param in enumerate(fsdp_params):
        reduction = reduce.plan(fsdp_param, param_group)
        log.debug("FSDP2 %s: gradient reduction %s", fsdp_param._module_info.param_name, reduction)
        fields = tuple(getattr(reduction, f.name) for f in dataclasses.fields(reduction))
        sharded = fsdp_param.sharded_param
        buckets.setdefault((fields, sharded.dtype, sharded.requires_grad, i if apart else None), []).append(i)
    return buckets


def _gather_handler(tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    param_group = getattr(args[0], "value", None)
    if param_group is None:
        graph_breaks.graph_break(graph_breaks.FSDP_UNTRACED, "FSDP2 param group not known at trace time")
    fsdp_params = list(param_group.fsdp_params)
    shards = args[2:]
    if len(shards) != len(fsdp_params):
        raise AssertionError(f"{len(shards)} local shards for {len(fsdp_params)} FSDP2 parameters")
    recompute = param_group.post_forward_mesh_info is not None
    # NOTE [FSDP2 gathers per group]: a root gathered again in backward, a gather per parameter.
    apart = recompute and bool(args[1].as_python_constant())
    try:
        buckets = _buckets(fsdp_params, param_group, apart)
    except (NotImplementedError, ValueError) as e:  # a release or reduce op we do not mirror
        graph_breaks.graph_break(graph_breaks.FSDP_UNTRACED, f"FSDP2 gradient reduction: {e}")
    # NOTE [FSDP2 memory: re-gather in backward]: with reshard_after_forward (True or an
    # int) eager FSDP2 frees the unsharded parameters after forward and all-gathers them
    # again in backward.  The gather is traced inside an activation checkpoint, so
    # AOTAutograd's partitioner marks it must-recompute: the backward graph re-gathers
    # from the sharded parameters instead of saving the unsharded ones (SimpleFSDP does
    # the same).  reshard_after_forward=False saves them, like eager.
    # torch 2.11's compiled checkpoint tags only the region's own ops for recompute, not those
    # inside the gather's autograd.Function: there a policy (selective checkpointing) tags them all.
    # The setting is read when the frame is traced and not guarded: it decides where the unsharded
    # parameters live until backward (saved, or gathered again), never a value.  torchtitan's chunked loss
    # turns it on for the [norm, lm_head] group after its first call (set_reshard_after_forward(True) where
    # fully_shard had False); the frame keeps the choice it was traced with instead of recompiling.
    recomputed = _gather_recomputed if _compat.checkpoint_tags_nested_ops() else _gather_recomputed_by_policy
    impl = recomputed if recompute else _gather_impl
    log.debug(
        "FSDP2 group of %d parameters%s: %d gather(s), reshard_after_forward=%s traced (%s)",
        len(fsdp_params),
        " (the root's, gathered again in backward: a gather per parameter)" if apart else "",
        len(buckets),
        recompute,
        "gathered again in backward" if recompute else "saved for backward",
    )
    results: list[Any] = [None] * len(fsdp_params)
    for (fields, *_), members in buckets.items():
        rows = tuple(fsdp_params[i].padded_sharded_param_size[0] for i in members)
        mine = [shards[i] for i in members]
        # NOTE [FSDP2 gathers traced once]: identical groups share one traced call.
        key = gather_stamps.signature(impl, mine, (rows, fields))
        constants = [wrap_constant(tx, rows), wrap_constant(tx, fields)]
        gathered = gather_stamps.call(tx, impl, mine, constants, key)
        for i, vt in zip(members, gathered.items, strict=True):
            results[i] = vt
    return _compat.TupleVariable(results)


def _gather_impl(rows: tuple[int, ...], fields: tuple[Any, ...], *locals_: Any) -> tuple[Any, ...]:
    import torch.nn.functional as F  # noqa: N812

    # Pad here, not before: a recomputed gather then keeps only the sharded
    # parameters themselves for backward, not padded copies.  Pad on every rank,
    # by zero rows where the shard is whole: ranks with uneven shards must still
    # trace the same graph, or a pass deciding from graph positions (collective
    # bucketing) decides differently per rank and the collectives hang.
    padded = [F.pad(t, [0, 0] * (t.dim() - 1) + [0, r - t.size(0)]) for t, r in zip(locals_, rows)]
    reduction = reduce.GradReduction(*fields)
    if len(padded) == 1:
        return (reduce.gather(padded[0], reduction),)
    return reduce.gather_group(padded, reduction)  # NOTE [FSDP2 gathers per group]


def _gather_recomputed(rows: tuple[int, ...], fields: tuple[Any, ...], *locals_: Any) -> tuple[Any, ...]:
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint(_gather_impl, rows, fields, *locals_, use_reentrant=False)


def _gather_recomputed_by_policy(rows: tuple[int, ...], fields: tuple[Any, ...], *locals_: Any) -> tuple[Any, ...]:
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint(
        _gather_impl, rows, fields, *locals_, use_reentrant=False, context_fn=_recompute_every_op
    )


def _recompute_every_op() -> Any:
    """Selective-checkpoint contexts that recompute every op, the collectives included."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_prefer_recompute)


def _prefer_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


def spmd_types_reductions(fsdp_param: Any) -> Any:
    """``_compat.fsdp_spmd_types_reductions(fsdp_param)``, a constant at trace time (:func:`_spmd_handler`)."""
    raise RuntimeError("spmd_types_reductions is only meaningful inside a graph traced by dynamo-ext")


def _spmd_handler(tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    fsdp_param = getattr(args[0], "value", None)
    if fsdp_param is None:
        graph_breaks.graph_break(graph_breaks.FSDP_UNTRACED, "FSDPParam not known at trace time")
    try:
        reductions = _compat.fsdp_spmd_types_reductions(fsdp_param)
    except ValueError as e:
        graph_breaks.graph_break(
            graph_breaks.FSDP_UNTRACED, f"FSDP2 gradient reduction of an spmd_types parameter: {e}"
        )
    return wrap_constant(tx, reductions)


def unshard_group(param_group: Any, root: bool) -> list[Any]:
    """The unsharded parameters of one FSDP2 param group, in ``fsdp_params`` order (traced, not run eagerly).

    Each is ``orig_size`` in ``param_dtype`` or its own dtype: the group's local shards (``[ceil(d0 / W), ...]``
    after padding, W = shard world size) all-gathered along dim 0 over the shard group (NOTE [FSDP2 gathers per
    group]), each cut to its first ``orig_size[0]`` rows.  Their gradients are reduced as eager FSDP2 reduces
    them (NOTE [FSDP2 gradients in traced graphs]).  ``root``: the group is the root state's.
    """
    params = param_group.fsdp_params
    gathered = gather_with_fsdp_backward(param_group, root, *[p.sharded_param.to_local() for p in params])
    return [_unsharded(p, full) for p, full in zip(params, gathered)]


def _unsharded(fsdp_param: Any, full: Any) -> Any:
    import torch

    size = fsdp_param._orig_size
    full = torch.narrow(full, 0, 0, size[0]).reshape(size)
    outside_dp = spmd_types_reductions(fsdp_param)
    if outside_dp is not None:
        # NOTE [FSDP2 over an SPMD mesh]: a parameter annotated with spmd_types is unsharded to its plain
        # local tensor (FSDPParam.init_unsharded_param keeps it plain), whose gradient eager FSDP2 sums over
        # the non-DP mesh axes where it is Partial before the reduce-scatter.
        return reduce.reduce_outside_dp(full, outside_dp)
    if fsdp_param.is_dtensor:
        # FSDP over TP: the gathered tensor is this rank's TP shard; the
        # unsharded parameter is that shard as a DTensor on the TP mesh.
        from torch.distributed.tensor import DTensor

        spec = _compat.fsdp_unsharded_spec(fsdp_param)
        meta = spec.tensor_meta
        full = DTensor.from_local(
            full, spec.mesh, spec.placements, run_check=False, shape=meta.shape, stride=meta.stride
        )
    return full
