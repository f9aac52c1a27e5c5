"""Polyfills of the all-to-all-style c10d collectives, written with functional collectives.

Each function here has the signature of its ``torch.distributed`` namesake and
is traced by Dynamo in its place (see ``handlers.register``).  It issues one
``_c10d_functional`` op, and its :class:`~.work.FunctionalWork` waits and
copies the result into the user's tensors, so in-place semantics are kept.
A rank outside ``group`` returns ``None`` without communicating, as eager.

Sizes follow the documented contract rather than one backend's: an
all-gather output may be the concatenation ``(world * n, ...)`` or the stack
``(world, n, ...)`` of the inputs, as NCCL allows (gloo takes only the first).
A size or dtype mismatch raises ``RuntimeError``, the type eager's backends
raise.  Lists whose tensors differ in size (uneven ``all_gather``) have no
single functional op: they are a graph break, and eager runs them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .args import group_info, not_in_group, reduce_op_name
from .breaks import unsupported
from .work import FunctionalWork, finish, plain

ReduceOp = dist.ReduceOp
_C = torch.ops._c10d_functional


def _check_numel(call: str, what: str, got: int, want: int) -> None:
    if got != want:
        raise RuntimeError(f"{call}: {what} has {got} elements, expected {want}")


def _check_dtype(call: str, tensors: list[torch.Tensor], dtype: torch.dtype) -> None:
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise RuntimeError(f"{call}: tensor {i} has dtype {t.dtype}, expected {dtype} (all tensors must match)")


def _even(call: str, tensors: list[torch.Tensor], numel: int) -> None:
    for t in tensors:
        if t.numel() != numel:
            unsupported(call, "tensors of different sizes in one list (uneven collective)")


def _leading(t: torch.Tensor, world: int) -> torch.Tensor:
    """``t`` as an input whose dim 0 the functional op may split ``world`` ways (flattened when it can't)."""
    if t.dim() > 0 and t.shape[0] % world == 0:
        return t
    return t.reshape(-1)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    if not_in_group(group):
        return None
    name, _, _ = group_info(group)
    out = _C.all_reduce(plain(tensor), reduce_op_name(op), name)
    return finish(FunctionalWork([out], [[tensor]]), async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    if not_in_group(group):
        return None
    name, world, _ = group_info(group)
    call = "dist.all_gather_into_tensor"
    _check_numel(call, "output_tensor", output_tensor.numel(), world * input_tensor.numel())
    _check_dtype(call, [output_tensor], input_tensor.dtype)
    inp = input_tensor if input_tensor.dim() > 0 else input_tensor.reshape(1)
    out = _C.all_gather_into_tensor(plain(inp), world, name)
    return finish(FunctionalWork([out], [[output_tensor]]), async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    if not_in_group(group):
        return None
    name, world, _ = group_info(group)
    call = "dist.reduce_scatter_tensor"
    _check_numel(call, "input", input.numel(), world * output.numel())
    _check_dtype(call, [output], input.dtype)
    out = _C.reduce_scatter_tensor(plain(_leading(input, world)), reduce_op_name(op), world, name)
    return finish(FunctionalWork([out], [[output]]), async_op)


def split_sizes(call: str, t: torch.Tensor, splits, world: int, what: str) -> list[int]:
    """Explicit split sizes along dim 0, or the equal split eager uses for ``None`` / ``[]``."""
    if splits is None or len(splits) == 0:
        if t.shape[0] % world != 0:
            raise RuntimeError(
                f"{call}: {what}'s dim 0 ({t.shape[0]}) does not divide equally across group size {world}"
            )
        return [t.shape[0] // world] * world
    if len(splits) != world:
        raise RuntimeError(f"{call}: Number of tensor splits not equal to group size ({len(splits)} != {world})")
    if sum(splits) != t.shape[0]:
        raise RuntimeError(f"{call}: Split sizes doesn't match total dim 0 size ({sum(splits)} != {t.shape[0]})")
    return list(splits)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    if not_in_group(group):
        return None
    name, world, _ = group_info(group)
    call = "dist.all_to_all_single"
    _check_dtype(call, [output], input.dtype)
    out_splits = split_sizes(call, output, output_split_sizes, world, "output")
    in_splits = split_sizes(call, input, input_split_sizes, world, "input")
    row = 1
    for size in input.shape[1:]:
        row *= size
    _check_numel(call, "output", output.numel(), sum(out_splits) * row)
    out = _C.all_to_all_single(plain(input), out_splits, in_splits, name)
    return finish(FunctionalWork([out], [[output]]), async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    if not_in_group(group):
        return None
    name, world, _ = group_info(group)
    call = "dist.all_gather"
    if len(tensor_list) != world:
        raise RuntimeError(f"{call}: tensor_list has {len(tensor_list)} tensors, expected one per rank ({world})")
    _check_dtype(call, tensor_list, tensor.dtype)
    _even(call, tensor_list, tensor.numel())
    out = _C.all_gather_into_tensor(plain(tensor.unsqueeze(0)), world, name)
    return finish(FunctionalWork([out], [list(tensor_list)]), async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    if not_in_group(group):
        return None
    name, world, _ = group_info(group)
    call = "dist.reduce_scatter"
    if len(input_list) != world:
        raise RuntimeError(f"{call}: input_list has {len(input_list)} tensors, expected one per rank ({world})")
    _check_dtype(call, input_list, output.dtype)
    _even(call, input_list, output.numel())
    inp = torch.stack([t.reshape(-1) for t in input_list])
    out = _C.reduce_scatter_tensor(plain(inp), reduce_op_name(op), world, name)
    return finish(FunctionalWork([out], [[output]]), async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    if not_in_group(group):
        return None
    name, world, _ = group_info(group)
    call = "dist.all_to_all"
    if len(output_tensor_list) != world or len(input_tensor_list) != world:
        raise RuntimeError(
            f"{call}: got {len(output_tensor_list)} output and {len(input_tensor_list)} input tensors, "
            f"expected one per rank ({world}) in each list"
        )
    dtype = input_tensor_list[0].dtype
    _check_dtype(call, [*input_tensor_list, *output_tensor_list], dtype)
    inp = torch.cat([t.reshape(-1) for t in input_tensor_list])
    out_splits = [t.numel() for t in output_tensor_list]
    in_splits = [t.numel() for t in input_tensor_list]
    out = _C.all_to_all_single(plain(inp), out_splits, in_splits, name)
    return finish(FunctionalWork([out], [list(output_tensor_list)]), async_op)


def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    if async_op:
        unsupported("dist.all_reduce_coalesced", "async_op=True returns a torch.futures.Future")
    if not_in_group(group):
        return None
    name, _, _ = group_info(group)
    _check_dtype("dist.all_reduce_coalesced", tensors, tensors[0].dtype)
    outs = _C.all_reduce_coalesced([plain(t) for t in tensors], reduce_op_name(op), name)
    return finish(FunctionalWork(list(outs), [[t] for t in tensors]), False)
