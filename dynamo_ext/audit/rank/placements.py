"""The placements a DTensor collective implies, and a placement that would avoid or shrink it (a heuristic)."""

from __future__ import annotations


def implied_placements(kind: str) -> tuple[str, str]:
    """Placements on the collective's mesh axis before and after, as the collective implies them (DTensor's short forms)."""
    return {
        "all_gather": ("S(?)", "R"),
        "reduce_scatter": ("P(sum)", "S(?)"),
        "all_reduce": ("P(sum)", "R"),
        "all_to_all": ("S(?)", "S(?)"),
        "broadcast": ("", "R"),
    }.get(kind, ("", ""))


def alternative(kind: str, phase: str, stack_trace: str) -> str:
    """A placement that avoids or shrinks a DTensor collective (a heuristic: not verified by sharding propagation)."""
    if kind == "all_reduce" and phase == "forward":
        if "_prepare_output_fn" in stack_trace:  # RowwiseParallel's output
            return (
                "RowwiseParallel(output_layouts=Shard(1)) with SequenceParallel on the next norm: a reduce_scatter "
                "of half the bytes instead of this all_reduce (the consumer must accept Shard(1))"
            )
        return "keep Partial() and let the consumer reduce (or Shard(d): reduce_scatter, half the bytes)"
    if kind == "all_reduce":
        if "_prepare_input_fn" in stack_trace:  # ColwiseParallel's input gradient
            return (
                "ColwiseParallel(input_layouts=Shard(1)) after a SequenceParallel norm: the gradient is "
                "reduce-scattered (half the bytes) instead of all-reduced"
            )
        return "a Shard(d) gradient (reduce_scatter, half the bytes) where the consumer accepts it"
    if kind == "all_gather":
        return "keep Shard(d) (use_local_output=False, or a strategy that consumes Shard(d)) to skip the gather"
    if kind == "all_to_all":
        return "shard the consumer on the dim the producer shards (no resharding)"
    return ""
