"""``data_parallel``: make a single-device training step data parallel from its graph.

    step = data_parallel(train_step, mesh)     # train_step(model, optim, x, y): forward, loss, backward, optim.step()
    loss = step(model, optim, x_local, y_local)

The path of a call (torch 2.1's ``torch.distributed._spmd`` did the same with
DTensor expansion; this keeps the single-device graph and adds collectives):

1. :func:`.step_trace.trace_step` traces the whole step (forward, backward,
   optimizer update) into one ATen graph with ``make_fx``, the batch dim of
   every tensor argument symbolic;
2. :func:`.batch_dim.analyze_step` runs it on DTensors over ``mesh`` (tensor
   arguments ``Shard(batch_dim)``, parameters, buffers and optimizer state
   ``Replicate()``) and finds the Partial values the step reads whole
   (NOTE [reduction edges]);
3. :func:`.reductions.insert_reductions` all-reduces those values the way DDP
   averages gradients (NOTE [DDP's averaging]);
4. :mod:`.overlap` buckets the gradient all-reduces with DDP's caps, merges
   each bucket with ``inductor_lowerings``' bucketing and splits the graph so
   each bucket's all-reduce is issued as soon as its gradients are ready
   (NOTE [gradient buckets], NOTE [split for overlap]);
5. each submodule is compiled with ``backend`` (batch dims dynamic; its code
   named the same on every rank, NOTE [rank-invariant names for the step's
   code]) and the step runs on the real tensors: parameters, buffers and optimizer state are
   updated in place, gradients left by the step are written to ``.grad``.

Every rank traces the same program on same-shaped arguments, so every rank
compiles the same collectives; that is checked across the ranks before a new
graph first runs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from .. import _compat
from ..collective_check import check_collectives, collectives
from . import overlap, step_state
from .batch_agreement import agree_batch_sizes
from .batch_dim import analyze_step
from .compiled_graph import CompiledGraph
from .reductions import Reduction, insert_reductions
from .step_trace import StepArgs, TracedStep, collect, static_key, trace_step

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

c10d = torch.ops._c10d_functional


@dataclasses.dataclass
class CompiledStep:
    """One traced and compiled step (what :attr:`DataParallelStep.compiled` lists, for inspection)."""

    traced: TracedStep
    graph: torch.fx.GraphModule
    """The step with its all-reduces, before splitting."""
    reductions: list[Reduction]
    buckets: list[overlap.GradientBucket]
    split: torch.fx.GraphModule | None
    """The graph cut at bucket boundaries (None with ``split=False``)."""
    runner: Callable[..., Any]


class DataParallelStep:
    """The data-parallel version of a training step; see :func:`data_parallel`."""

    def __init__(
        self,
        step_fn: Callable[..., Any],
        mesh: DeviceMesh,
        *,
        batch_dim: int | Sequence[int | None],
        backend: str | Callable[..., Any],
        bucket_cap_mb: float,
        first_bucket_mb: float,
        split: bool,
    ) -> None:
        if getattr(mesh, "ndim", None) != 1:
            raise ValueError(
                f"data_parallel needs a 1-D data-parallel DeviceMesh, got {mesh!r}; pass mesh[axis_name] "
                "for the data-parallel axis of a larger mesh"
            )
        self.step_fn = step_fn
        self.mesh = mesh
        self.batch_dim = batch_dim
        self.backend = backend
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_mb = first_bucket_mb
        self.split = split
        self._cache: dict[Any, list[CompiledStep]] = {}
        self.compiled: list[CompiledStep] = []
        """Every step traced so far, in order (one per new argument structure or failed batch-size guard)."""

    def _batch_dims(self, step: StepArgs) -> list[int | None]:
        n = len(step.batch_leaves)
        if isinstance(self.batch_dim, int):
            return [self.batch_dim] * n
        dims = list(self.batch_dim)
        if len(dims) != n:
            raise ValueError(
                f"batch_dim has {len(dims)} entries but the step got {n} tensor arguments; give one dim (or "
                "None) per tensor argument, in the order they appear in the flattened arguments, or one int for all"
            )
        return dims

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        step = collect(args, kwargs)
        dims = self._batch_dims(step)
        for p in step.params:
            if p.grad is not None:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} already has a .grad when the data-parallel step "
                    "starts; the traced step starts from no gradient (it would not accumulate into it as eager "
                    "does). Call optimizer.zero_grad() (set_to_none=True, the default) before the step."
                )
        key = static_key(step, dims)
        batch = [step.leaves[i] for i in step.batch_leaves]
        if key not in self._cache:
            self._log_retrace(key)
            # Every rank has this miss at the same call: agree on batch sizes before any rank traces.
            agree_batch_sizes(self.mesh.get_group().group_name, [tuple(t.shape) for t in batch], dims)
        entries = self._cache.setdefault(key, [])
        entry = next((e for e in entries if e.traced.holds_for(batch, dims)), None)
        if entry is None:
            entry = self._compile(step, dims)
            entries.append(entry)
        with torch.no_grad():
            outs = entry.runner(*step.inputs)
        return self._write_back(entry.traced, step, list(outs))

    def _log_retrace(self, key: tuple[Any, ...]) -> None:
        if not self._cache:
            return
        previous = list(self._cache)[-1]
        what = step_state.changes(previous[1], key[1])  # the Python state part of the key
        log.info(
            "data_parallel: tracing the step again (trace %d): %s",
            len(self.compiled) + 1,
            "; ".join(what[:4]) if what else "new argument structure, shapes or optimizer state",
        )

    def _compile(self, step: StepArgs, dims: list[int | None]) -> CompiledStep:
        traced = trace_step(self.step_fn, step, dims)
        gm = traced.gm
        world = self.mesh.size()
        examples: list[torch.Tensor] = list(step.inputs[: step.num_fixed])
        for leaf, dim in zip(step.batch_leaves, dims):
            t = step.leaves[leaf]
            shape = list(t.shape)
            if dim is not None:
                shape[dim] *= world
            examples.append(torch.empty(shape, dtype=t.dtype, device=t.device))
        layouts = analyze_step(
            gm, examples, [None] * step.num_fixed + list(dims), self.mesh, gradients=list(traced.gradients.values())
        )
        group = self.mesh.get_group()
        reductions = insert_reductions(
            gm,
            layouts.layouts,
            layouts.reduce_before,
            layouts.local_reads,
            gradients=list(traced.gradients.values()),
            group_name=group.group_name,
            world_size=world,
        )
        buckets = overlap.plan_buckets(
            gm.graph, reductions, bucket_cap_mb=self.bucket_cap_mb, first_bucket_mb=self.first_bucket_mb
        )
        overlap.merge_buckets(gm, buckets)
        # Every rank must issue these all-reduces: agreed with the others before the step first runs
        # (the plugin's collective check, NOTE [collective stream check]; bounded, never a hang).
        check_collectives(collectives(gm))
        split = overlap.split_at_buckets(gm, buckets) if self.split else None
        runner = self._compile_graph(split if split is not None else gm)
        entry = CompiledStep(traced, gm, reductions, buckets, split, runner)
        self.compiled.append(entry)
        log.info(
            "data_parallel: traced step %d: %d all-reduces in %d gradient buckets, %d submodules",
            len(self.compiled),
            sum(len(b.collectives) for b in buckets),
            len(buckets),
            len(overlap.submodule_calls(split)) if split is not None else 1,
        )
        return entry

    def _compile_graph(self, gm: torch.fx.GraphModule) -> Callable[..., Any]:
        if self.backend is None:
            return gm
        calls = overlap.submodule_calls(gm)
        compiled: Callable[..., Any]
        if not calls:
            compiled = CompiledGraph(gm, self.backend, label="step")
        else:
            for name, sub in calls:
                setattr(gm, name, CompiledGraph(sub, self.backend, label=name))
            compiled = gm

        def run(*args: Any) -> Any:
            with _compat.no_duck_shapes():  # a batch size equal to a static size must stay its own symbol
                return compiled(*args)

        return run

    @staticmethod
    def _write_back(traced: TracedStep, step: StepArgs, outs: list[Any]) -> Any:
        n_user, n_grad = traced.num_user_outputs, len(traced.grad_params)
        user, grads, states = outs[:n_user], outs[n_user : n_user + n_grad], outs[n_user + n_grad :]
        for j, g in zip(traced.grad_params, grads):
            step.params[j].grad = g
        for (i, j, k), v in zip(traced.state_outputs, states):
            step.optimizers[i].state[step.params[j]][k] = v
        for i, j, k, v in traced.state_constants:
            step.optimizers[i].state[step.params[j]][k] = v
        tensors = iter(user)
        leaves = [
            traced.out_constants[i] if i in traced.out_constants else next(tensors)
            for i in range(traced.out_spec.num_leaves)
        ]
        return pytree.tree_unflatten(leaves, traced.out_spec)


def data_parallel(
    step_fn: Callable[..., Any],
    mesh: DeviceMesh,
    *,
    batch_dim: int | Sequence[int | None] = 0,
    backend: str | Callable[..., Any] = "inductor",
    bucket_cap_mb: float = 25,
    first_bucket_mb: float = 1,
    split: bool = True,
) -> DataParallelStep:
    """Compile a single-device training step and make it data parallel from its graph.

    ``step_fn(*args, **kwargs)`` is a whole training step as you would write it
    for one device: it calls the model (``nn.Module`` arguments), computes a
    loss, calls ``loss.backward()`` and ``optimizer.step()`` (``Optimizer``
    arguments), and returns what you want back (tensors, any pytree).  Each
    rank calls the returned step with its own part of the batch, as with
    ``DistributedDataParallel``; parameters must start equal on all ranks.

    The step is traced into one graph, a batch-dimension analysis of every node
    decides the layouts (tensor arguments sharded on their batch dim;
    parameters, buffers and optimizer state replicated), and gradients are
    averaged across ranks (DDP's semantics, NOTE [DDP's averaging]) in buckets
    whose all-reduces overlap the rest of the backward (NOTE [gradient
    buckets], NOTE [split for overlap]).  The batch dim is symbolic, so another
    batch size reuses the compiled graph.

    After a call: parameters, buffers and optimizer state are updated in place;
    gradients the step leaves on parameters (no ``zero_grad()`` inside it) are
    the averaged ones, in ``.grad``; returned reductions over the batch are
    their full-batch value on every rank (a mean loss: the mean of the ranks'
    means; a sum or an integer count: the sum, dtype kept; a max/min: the
    max/min), returned tensors with a batch dim are this rank's part.

    The step's Python code runs once, when it is traced: module attributes,
    optimizer hyperparameters and hooks it depends on are guarded (a change
    traces again), Python state it changes is refused (NOTE [Python state of
    a traced step]); ``register_hook`` hooks on parameters run on the local
    gradient, as under DDP.

    Args:
        step_fn: the training step.
        mesh: a 1-D ``DeviceMesh`` over the data-parallel ranks (e.g.
            ``init_device_mesh("cpu", (world,))`` or ``mesh["dp"]``).
        batch_dim: the dim of the tensor arguments that holds the samples: one
            int for all, or one int or None (no batch dim) per tensor argument
            in flattened-argument order.
        backend: a ``torch.compile`` backend for each submodule (``"inductor"``,
            ``"aot_eager"``, a callable), or None to run the FX graph as is.
        bucket_cap_mb, first_bucket_mb: DDP's gradient bucket caps (MiB).
        split: cut the graph at bucket boundaries for overlap (True) or keep one graph.

    Returns:
        A :class:`DataParallelStep`; call it like ``step_fn``.

    Raises:
        ValueError: (on the first call with new argument shapes) the mesh is not
            1-D; a tensor's batch dim is out of range or, on any rank, holds
            fewer than 2 samples (the same error on every rank); a node's batch
            dim cannot be inferred (the message names the node, e.g. a
            ``cumsum`` over the batch); the step cannot be traced or reads a
            tensor into Python (``.item()``, Adam's CPU step count); tracing
            changed Python state (an LR scheduler stepped inside the step); a
            gradient depends on a reduction over the batch read whole (a loss
            that is not a sum or mean over samples); a returned reduction has no
            full-batch value (a norm over the batch); a parameter has a
            ``register_post_accumulate_grad_hook`` hook or already has a ``.grad``.
        dynamo_ext.CollectiveMismatchError: the ranks compiled different collectives, or a
            rank did not start tracing the step with the others (a RuntimeError).
    """
    return DataParallelStep(
        step_fn,
        mesh,
        batch_dim=batch_dim,
        backend=backend,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_mb=first_bucket_mb,
        split=split,
    )
