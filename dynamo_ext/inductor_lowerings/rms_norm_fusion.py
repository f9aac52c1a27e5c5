"""The residual RMSNorm fusion: all-reduce + residual add + RMSNorm.

NOTE [residual rms norm chain]
After AOTAutograd and Inductor's decompositions, ``h = all_reduce(x); r = h + residual;
rms_norm(r) * weight`` reaches the post-grad passes as::

    all_reduce -> wait_tensor -> add(residual) -> [convert f32] -> pow 2 -> mean(-1, keepdim)
      -> add eps -> rsqrt -> mul -> [convert] -> [mul weight] -> [convert]

or, where Inductor keeps it, ``aten._fused_rms_norm(r, [hidden], weight, eps)``.
:func:`match_residual_rms_norm` finds that chain; the three optional casts are
recorded (``upcast``, ``mid_dtype``, ``out_dtype``) so the replacement computes the
same aten ops in the same dtypes.

Stock Inductor realizes the residual sum (it has several users), so on the CPU the
epilogue walks the tensor three times: the add over the whole tensor, then per row
the sum of squares and the normalization, both re-reading the stored sum.  We replace
the chain by ``dynamo_ext::residual_rms_norm`` whose lowering recomputes the sum
inside the reduction and inside the normalization, so the scheduler emits one loop
nest per row that reads the collective's output row once from memory and writes the
residual sum and the normalized row in the same pass.  The collective stays a
``_c10d_functional.all_reduce`` (CPU, gloo, or no symmetric memory).

On CUDA, when the group has symmetric memory, the all-reduce itself is folded in:
``dynamo_ext::one_shot_all_reduce_residual_rms_norm`` followed by ``wait_tensor`` on
each output, lowered to a ``_CollectiveKernel`` whose input is realized as a
symmetric-memory comm buffer (NOTE [lowering-time collective optimization] in
torch/_inductor/comm_lowering.py), so the producer writes straight into it and
Inductor's comm reordering still sees a collective.  It issues the all-reduce where
the add was, so it is refused where communication lies between them (NOTE [buckets
keep the communication order] in bucketing.py).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, TypeGuard

import torch
import torch.fx

from .. import _compat
from ..fx import collectives as fx_collectives
from ..fx.nodes import example_value, is_call, sole_user, static_shape, tensor_bytes
from . import decisions, ops, options
from .graph_edit import call, getitems
from .registry import package_sources

log = logging.getLogger(__name__)
FUSION = "residual_rms_norm"

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional


# ---- matching ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ResidualRMSNormMatch:
    """One matched chain; ``erase`` lists the nodes the rewrite removes (outputs first)."""

    all_reduce: torch.fx.Node
    wait: torch.fx.Node
    add: torch.fx.Node
    residual: torch.fx.Node
    weight: torch.fx.Node | None
    eps: float
    upcast: torch.dtype | None
    mid_dtype: torch.dtype | None
    out_dtype: torch.dtype | None
    output: torch.fx.Node
    rstd: torch.fx.Node | None
    erase: tuple[torch.fx.Node, ...]

    @property
    def group_name(self) -> str:
        return str(self.all_reduce.args[2])

    @property
    def reduce_op(self) -> str:
        return str(self.all_reduce.args[1])


def _other(node: torch.fx.Node, this: torch.fx.Node) -> Any:
    a, b = node.args[0], node.args[1]
    if a is this and b is not this:
        return b
    if b is this and a is not this:
        return a
    return None


def _is_convert(node: Any) -> TypeGuard[torch.fx.Node]:
    return is_call(node, prims.convert_element_type.default) and isinstance(node.args[1], torch.dtype)


def _convert_dtype(node: torch.fx.Node) -> torch.dtype:
    """The dtype a node that passed :func:`_is_convert` converts to."""
    dtype = node.args[1]
    assert isinstance(dtype, torch.dtype)
    return dtype


def _is_square(node: torch.fx.Node, h: torch.fx.Node) -> bool:
    if is_call(node, aten.pow.Tensor_Scalar) and node.args[0] is h:
        return isinstance(node.args[1], (int, float)) and node.args[1] == 2
    return is_call(node, aten.mul.Tensor) and node.args[0] is h and node.args[1] is h


def _is_last_dim_mean(node: Any, x: torch.fx.Node, ndim: int) -> TypeGuard[torch.fx.Node]:
    if not (is_call(node, aten.mean.dim) and node.args[0] is x):
        return False
    dims = node.args[1]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return (
        keepdim is True
        and isinstance(dims, (list, tuple))
        and list(dims) in ([-1], [ndim - 1])
        and node.kwargs.get("dtype") is None
    )


def _scalar_add_operand(node: Any, x: torch.fx.Node) -> float | None:
    if not (is_call(node, aten.add.Scalar, aten.add.Tensor) and node.args[0] is x) or node.kwargs.get("alpha", 1) != 1:
        return None
    eps = node.args[1]
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


def _is_weight_for(node: Any, hidden: int, ndim: int) -> bool:
    """A per-feature weight: ``hidden`` elements along the last dim, broadcasting adds no dims."""
    val = example_value(node)
    return (
        isinstance(val, torch.Tensor)
        and val.dtype.is_floating_point
        and 1 <= val.ndim <= ndim
        and val.shape[-1] == hidden
        and val.numel() == hidden
    )


def _match_tail(
    norm: torch.fx.Node, hidden: int, ndim: int
) -> tuple[torch.fx.Node, torch.fx.Node | None, torch.dtype | None, torch.dtype | None, list[torch.fx.Node]]:
    """Walk ``[convert] -> [mul weight] -> [convert]`` from the normalized node while single-user."""
    out, weight, mid, last_cast, nodes = norm, None, None, None, []
    user = sole_user(out)
    if _is_convert(user):
        mid, out = _convert_dtype(user), user
        nodes.append(user)
        user = sole_user(out)
    if is_call(user, aten.mul.Tensor) and _is_weight_for(_other(user, out), hidden, ndim):
        weight, out = _other(user, out), user
        nodes.append(user)
        user = sole_user(out)
        if _is_convert(user):
            last_cast, out = _convert_dtype(user), user
            nodes.append(user)
    return out, weight, mid, last_cast, nodes


def _match_decomposed(base: dict[str, Any], add: torch.fx.Node, hidden: int, ndim: int) -> ResidualRMSNormMatch | None:
    dtype = example_value(add).dtype
    upcasts = [u for u in add.users if _is_convert(u) and u.args[1] != dtype]
    # the square and the normalization may each read their own upcast of the sum
    for h, upcast in [(add, None), *((u, u.args[1]) for u in upcasts)]:
        same = [add] if upcast is None else [u for u in upcasts if u.args[1] == upcast]
        for square in h.users:
            if not _is_square(square, h):
                continue
            mean = sole_user(square)
            if not _is_last_dim_mean(mean, square, ndim):
                continue
            eps_node = sole_user(mean)
            eps = _scalar_add_operand(eps_node, mean)
            if eps_node is None or eps is None:
                continue
            rsqrt = sole_user(eps_node)
            if not is_call(rsqrt, aten.rsqrt.default):
                continue
            for norm in rsqrt.users:
                if not (is_call(norm, aten.mul.Tensor) and _other(norm, rsqrt) in same):
                    continue
                output, weight, mid, last_cast, tail = _match_tail(norm, hidden, ndim)
                chain = [*(u for u in same if u is not add), square, mean, eps_node, rsqrt, norm, *tail]
                return ResidualRMSNormMatch(
                    **base,
                    weight=weight,
                    eps=eps,
                    upcast=upcast,
                    mid_dtype=mid,
                    out_dtype=last_cast,
                    output=output,
                    rstd=rsqrt,
                    erase=tuple(reversed(chain)),
                )
    return None


def _match_fused_op(base: dict[str, Any], add: torch.fx.Node, hidden: int, ndim: int) -> ResidualRMSNormMatch | None:
    fused_op = _compat.aten_op("_fused_rms_norm")
    if fused_op is None:
        return None
    for node in add.users:
        if not is_call(node, fused_op.default) or node.args[0] is not add or node.args[1] not in ([hidden], (hidden,)):
            continue
        weight = node.args[2] if len(node.args) > 2 else None
        if weight is not None and not (isinstance(weight, torch.fx.Node) and _is_weight_for(weight, hidden, ndim)):
            continue
        getitems = {u.args[1]: u for u in node.users if is_call(u, operator.getitem)}
        if 0 not in getitems or len(getitems) != len(node.users):
            continue
        dtype = example_value(add).dtype
        compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        eps = node.args[3] if len(node.args) > 3 else None
        if eps is None:
            eps = torch.finfo(torch.float32 if compute == torch.float32 else torch.float64).eps
        if not isinstance(eps, (int, float)):
            continue
        return ResidualRMSNormMatch(
            **base,
            weight=weight,
            eps=float(eps),
            upcast=compute if compute != dtype else None,
            mid_dtype=None,
            out_dtype=dtype,
            output=getitems[0],
            rstd=getitems.get(1),
            erase=(*getitems.values(), node),
        )
    return None


def match_residual_rms_norm(all_reduce: torch.fx.Node) -> ResidualRMSNormMatch | None:
    """The chain that starts at ``all_reduce`` (a ``_c10d_functional.all_reduce`` node), or None."""
    return match_or_reason(all_reduce)[0]


def match_or_reason(all_reduce: torch.fx.Node) -> tuple[ResidualRMSNormMatch | None, str]:
    """``(match, "")``, or ``(None, the first step of the chain that is missing)``."""
    wait = sole_user(all_reduce)
    if not is_call(wait, c10d.wait_tensor.default):
        return None, "the all-reduce's only reader is not a wait_tensor"
    reduced_val = example_value(wait)
    if not static_shape(reduced_val) or reduced_val.ndim < 1 or not reduced_val.dtype.is_floating_point:
        return None, "the reduced tensor is not a floating-point tensor of static shape"
    hidden, ndim = reduced_val.shape[-1], reduced_val.ndim
    reason = "no residual add of the same shape and dtype reads the reduced tensor"
    for add in wait.users:
        if not is_call(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1:
            continue
        residual = _other(add, wait)
        rval = example_value(residual)
        if not isinstance(rval, torch.Tensor) or rval.shape != reduced_val.shape or rval.dtype != reduced_val.dtype:
            continue
        base = {"all_reduce": all_reduce, "wait": wait, "add": add, "residual": residual}
        found = _match_decomposed(base, add, hidden, ndim) or _match_fused_op(base, add, hidden, ndim)
        if found is not None:
            return found, ""
        reason = "no RMSNorm over the last dim (square, mean, + eps, rsqrt, mul) reads the residual sum"
    return None, reason


# ---- predicates (FX level) --------------------------------------------------------------
def _position(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def should_fuse_residual_rms_norm(match: ResidualRMSNormMatch, pos: dict[torch.fx.Node, int]) -> bool:
    """The epilogue can be replaced in place: its weight exists before the add."""
    return match.weight is None or pos[match.weight] < pos[match.add]


def _one_shot_dtypes_supported(match: ResidualRMSNormMatch) -> bool:
    from .kernels.fused_all_reduce_launch import output_dtypes

    weight = example_value(match.weight)
    try:
        output_dtypes(
            example_value(match.wait).dtype,
            None if weight is None else weight.dtype,
            upcast=match.upcast,
            mid_dtype=match.mid_dtype,
            out_dtype=match.out_dtype,
        )
    except ValueError:
        return False
    return True


ONE_SHOT_OFF = "options.one_shot is off (off by default until measured on a GPU)"

# NOTE [fused all-reduce kernels opt-in]
# The one-shot and two-shot kernels fold the all-reduce into the add + RMSNorm with
# cross-rank barriers and peer loads over symmetric memory.  They pass under Triton's
# interpreter (real processes and concurrent in-process ranks) and compile to sm_90
# PTX, but have never executed on GPU hardware, where a barrier's memory ordering or a
# peer load can hang or read stale rows in ways the interpreter cannot show.  So they
# stay off until a GPU run measures them correct and faster; ``options.one_shot = True``
# opts in.  The add + RMSNorm epilogue fusion (the collective stays stock) is on.
_told_off_by_default: list[bool] = []


def _log_off_by_default(val: Any) -> None:
    """Say once per process, at INFO, that an all-reduce on a kernel device could use the fused kernel if opted in."""
    device_type = getattr(getattr(val, "device", None), "type", None)
    if _told_off_by_default or options.one_shot or device_type not in options.one_shot_device_types:
        return
    _told_off_by_default.append(True)
    log.info(
        "fused all-reduce + RMSNorm Triton kernels are off by default until measured on a GPU; "
        "dynamo_ext.inductor_lowerings.options.one_shot = True opts in"
    )


def one_shot_refusal(match: ResidualRMSNormMatch) -> str | None:
    """None when the fused all-reduce kernel applies, else the first condition that failed.

    Conditions: on, a device of ``options.one_shot_device_types``, a sum, the reduced
    tensor read only by the add, fp32/bf16/fp16, at most ``options.two_shot_max_bytes``
    (the op picks the one-shot or the two-shot kernel by size when it runs,
    :func:`ops.fused_all_reduce_algorithm`), rows of at most ``options.one_shot_max_hidden``,
    triton, Inductor comm buffers and symmetric memory in this build, the chain's dtypes,
    no communication op between the all-reduce and the add.  Every input is the same on every rank (the graph, the options, the build): no
    local state such as the deprecated symmetric-memory registry (NOTE [symmetric
    memory route] in _compat/symm_mem.py), so every rank decides alike.
    """
    val = example_value(match.all_reduce.args[0])
    between = fx_collectives.communication_between(match.all_reduce, match.add, skip=match.wait)
    checks = (
        (lambda: options.one_shot, ONE_SHOT_OFF),
        (lambda: isinstance(val, torch.Tensor), "the all-reduce input has no example value"),
        (
            lambda: val.device.type in options.one_shot_device_types,
            f"device {getattr(val, 'device', None)} is not in options.one_shot_device_types "
            f"{options.one_shot_device_types}",
        ),
        (lambda: match.reduce_op == "sum", f"reduce op {match.reduce_op!r} is not 'sum'"),
        (lambda: len(match.wait.users) == 1, "the reduced tensor has readers besides the residual add"),
        (
            lambda: val.dtype in (torch.float32, torch.bfloat16, torch.float16),
            f"dtype {getattr(val, 'dtype', None)} is not float32, bfloat16 or float16",
        ),
        (
            lambda: ops.fused_all_reduce_algorithm(val.numel() * val.element_size()) is not None,
            f"{tensor_bytes(val)} bytes > options.two_shot_max_bytes ({options.two_shot_max_bytes})",
        ),
        (
            lambda: val.shape[-1] <= options.one_shot_max_hidden,
            f"rows of {val.shape[-1] if isinstance(val, torch.Tensor) else '?'} elements > "
            f"options.one_shot_max_hidden ({options.one_shot_max_hidden})",
        ),
        (_compat.has_triton, "triton is not installed"),
        (lambda: _compat.comm_buffer_api() is not None, "this Inductor has no symmetric-memory comm buffers"),
        (lambda: _compat.symm_mem_route() != "none", "this torch build has no symmetric memory"),
        (lambda: _one_shot_dtypes_supported(match), "the chain's casts are not supported by the kernel"),
        (
            lambda: between is None,
            f"{between} communicates between the all-reduce and the add (the kernel would move it)",
        ),
    )
    for ok, reason in checks:
        if not ok():
            return reason
    return None


# ---- rewriting -----------------------------------------------------------------------------
def rewrite(graph: torch.fx.Graph, match: ResidualRMSNormMatch, *, one_shot: bool) -> None:
    """Replace the matched chain (and with ``one_shot`` the collective) by our op."""
    args = (match.residual, match.weight, match.eps, match.upcast, match.mid_dtype, match.out_dtype)
    with graph.inserting_before(match.add):
        if one_shot:
            fused = call(graph, ops.one_shot_op(), (match.all_reduce.args[0], *args, match.group_name), match.add)
            items = [call(graph, c10d.wait_tensor.default, (g,), match.add) for g in getitems(graph, fused, 3)]
        else:
            fused = call(graph, ops.residual_rms_norm_op(), (match.wait, *args), match.add)
            items = getitems(graph, fused, 3)
    summed, normed, rstd = items
    match.output.replace_all_uses_with(normed)
    if match.rstd is not None:
        match.rstd.replace_all_uses_with(rstd)
    match.add.replace_all_uses_with(summed)
    for node in match.erase:
        if not node.users:  # an upcast the rest of the graph still reads stays, reading our sum
            graph.erase_node(node)
    graph.erase_node(match.add)
    if one_shot:
        graph.erase_node(match.wait)
        graph.erase_node(match.all_reduce)
    for item in items:  # outputs nobody reads (rstd outside training): no getitem, no wait
        if not item.users:
            getitem = item.args[0] if one_shot else None
            graph.erase_node(item)
            if isinstance(getitem, torch.fx.Node) and not getitem.users:
                graph.erase_node(getitem)


def fuse_residual_rms_norm(graph: torch.fx.Graph) -> int:
    """Rewrite every matching chain in ``graph``; return how many were fused.

    Logs each all-reduce's outcome on this module's logger (``dynamo_ext.inductor_lowerings``
    tree) and records each applied fusion (:mod:`.decisions`).
    """
    if not options.residual_rms_norm:
        log.debug("residual_rms_norm off (options.residual_rms_norm = False)")
        return 0
    pos = _position(graph)
    count = 0
    for node in list(graph.nodes):
        if not is_call(node, c10d.all_reduce.default):
            continue
        name = node.name
        match, reason = match_or_reason(node)
        if match is None:
            decisions.not_applied(log, fusion=FUSION, node=name, reason=reason)
            continue
        if not should_fuse_residual_rms_norm(match, pos):
            decisions.not_applied(log, fusion=FUSION, node=name, reason="the norm weight is computed after the add")
            continue
        refusal = one_shot_refusal(match)
        nbytes = tensor_bytes(example_value(match.all_reduce.args[0]))
        group_name = match.group_name
        if refusal is None:
            _compat.ensure_symm_mem_for_group(group_name)  # NOTE [symmetric memory route]
        rewrite(graph, match, one_shot=refusal is None)
        count += 1
        kernel = "epilogue" if refusal is not None else ops.fused_all_reduce_algorithm(nbytes)
        decisions.applied(log, fusion=FUSION, kernel=str(kernel), group_name=group_name, nbytes=nbytes, node=name)
        if refusal is not None:
            decisions.not_applied(log, fusion="fused all-reduce kernel", node=name, reason=refusal)
            if refusal == ONE_SHOT_OFF:
                _log_off_by_default(example_value(match.all_reduce.args[0]))
    if count:
        graph.lint()
    return count


class ResidualRMSNormPass(_compat.custom_graph_pass_base()):  # type: ignore[misc]
    """Post-grad pass fusing all-reduce, residual add and RMSNorm (see NOTE [residual rms norm chain])."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_residual_rms_norm(graph)

    def uuid(self) -> Any:
        return _compat.hash_for_files(  # NOTE [pass identity covers the lowerings]
            package_sources(), extra=options.get_hash().hex() + _compat.symm_mem_state_key()
        )
