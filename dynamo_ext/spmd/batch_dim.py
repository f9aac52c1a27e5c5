"""Batch-dimension analysis of a traced step: the data-parallel layout of every node.

torch 2.1's data-parallel compiler (``torch.distributed._spmd``, removed
since) inferred the batch dim of every node of a traced training step with a
``BatchDimAnalyzer`` of hand-written rules.  Here the rules are DTensor's own
sharding propagation: the graph runs once on DTensors over the
data-parallel mesh, with inputs sharded on their batch dim and everything
else replicated, under ``FakeTensorMode`` (no compute, no memory).  Each
node's output placement is its layout:

- ``Shard(d)``: dim ``d`` of this value is the batch dim (followed through
  views, reshapes, permutes and pointwise ops by DTensor's view and op rules);
- ``Replicate()``: no batch dim (parameters, constants, values made from them);
- ``Partial(op)``: a reduction over the batch (``sum``, ``avg``), such as a
  mean loss or a parameter gradient: the value every rank needs is the
  all-reduce of the local ones.

A node that DTensor can only compute by communicating (an all-gather of the
batch, for instance a ``cumsum`` along it or indexing one sample) has no
data-parallel layout: :func:`analyze_batch_dims` raises a ``ValueError``
naming the node.  A few ops are computed on each rank's own samples instead,
as under DDP, where DTensor's rule would communicate (a mean
``nll_loss_forward``, ``F.one_hot``'s label check: NOTE [local rules] in
:mod:`.local_rules`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from .. import _compat
from .local_rules import LocalRule, local_rule

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d"})


class _CollectiveRecorder(_compat.torch_dispatch_mode_base()):
    """Records the collectives dispatched under it (DTensor's redistributions)."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before tensor subclasses: step aside so DTensor desugars the op
            # into local ops and collectives, which then come back here (as CommDebugMode does).
            return NotImplemented
        name = getattr(func, "__name__", "").split(".")[0]
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES and name != "wait_tensor":
            self.collectives.append(name)
        return func(*args, **(kwargs or {}))


class _LayoutInterpreter(torch.fx.Interpreter):
    def __init__(
        self,
        gm: torch.fx.GraphModule,
        mesh: Any,
        allow_reductions: bool = False,
        from_gradients: frozenset = frozenset(),
    ) -> None:
        super().__init__(gm)
        self.mesh = mesh
        self.layouts: dict[str, Any] = {}
        self.allow_reductions = allow_reductions
        self.from_gradients = from_gradients
        """Names of the parameters' gradients and of the nodes computed from them: never read locally."""
        self.reduce_before: dict[str, list[str]] = {}
        self.local_reads: dict[str, list[str]] = {}

    def _try(self, n: torch.fx.Node) -> tuple[Any, list[str], RuntimeError | None]:
        with _CollectiveRecorder() as recorder:
            try:
                return super().run_node(n), recorder.collectives, None
            except RuntimeError as e:  # DTensor has no rule that keeps the batch sharding here
                return None, recorder.collectives, e

    def _cannot_infer(self, n: torch.fx.Node, collectives: list[str], error: RuntimeError | None) -> ValueError:
        if error is not None:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            return ValueError(
                f"the batch dim of node {n.name!r} ({n.format_node()}) cannot be inferred: DTensor cannot "
                f"follow the batch sharding through it ({first_line})"
            )
        return ValueError(
            f"the batch dim of node {n.name!r} ({n.format_node()}) cannot be inferred: with the inputs sharded on "
            f"their batch dims, computing it needs communication ({', '.join(collectives)}), so it "
            "mixes samples of the batch. "
            "Move this computation out of the data-parallel step, or give the input it comes from no batch dim."
        )

    def run_node(self, n: torch.fx.Node) -> Any:
        rule = local_rule(n, self.layouts)
        if (
            rule is not None
            and rule.local_reads
            and (not self.allow_reductions or self.from_gradients & {*rule.local_reads})
        ):
            rule = None  # strict mode, or a gradient's value: DDP's readers of a gradient see the average
        if rule is not None:
            out = self._run_locally(n, rule)
            self.layouts[n.name] = _layout(out, self.mesh)
            if rule.local_reads:
                self.local_reads[n.name] = rule.local_reads
            return out
        out, collectives, error = self._try(n)
        if error is not None or collectives:
            out = self._with_reduced_inputs(n, collectives, error)
        self.layouts[n.name] = _layout(out, self.mesh)
        return out

    def _run_locally(self, n: torch.fx.Node, rule: LocalRule) -> Any:
        """NOTE [local rules]: ``n`` on each rank's local tensors, its result laid out as ``rule`` says."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        local_args, local_kwargs = pytree.tree_map_only(DTensor, lambda t: t.to_local(), (args, kwargs))
        assert callable(n.target), n.format_node()  # a call_function node's target
        out = n.target(*local_args, **local_kwargs)
        if rule.outputs is None:
            return out
        placements = rule.outputs if isinstance(rule.outputs, tuple) else (rule.outputs,)
        outs = out if isinstance(out, tuple | list) else (out,)
        wrapped = [DTensor.from_local(t, self.mesh, [p], run_check=False) for t, p in zip(outs, placements)]
        return tuple(wrapped) if isinstance(out, tuple | list) else wrapped[0]

    def _with_reduced_inputs(self, n: torch.fx.Node, collectives: list[str], error: RuntimeError | None) -> Any:
        """NOTE [reduction edges]: retry ``n`` with its Partial inputs all-reduced; record them if that suffices."""
        partial = [a for a in n.all_input_nodes if isinstance(self.layouts.get(a.name), Partial)]
        if not self.allow_reductions or not partial:
            raise self._cannot_infer(n, collectives, error) from error
        sharded = [a.name for a in n.all_input_nodes if isinstance(self.layouts.get(a.name), Shard)]
        saved = {a: self.env[a] for a in partial}
        try:
            for a in partial:
                self.env[a] = saved[a].redistribute(self.mesh, [Replicate()])
            out, again, error2 = self._try(n)
        finally:
            self.env.update(saved)
        if error2 is not None or again:
            raise self._cannot_infer(n, again, error2) from error2
        (self.local_reads if sharded else self.reduce_before)[n.name] = [a.name for a in partial]
        return out


def _layout(value: Any, mesh: Any) -> Any:
    if isinstance(value, DTensor):
        return value.placements[0]
    if isinstance(value, torch.Tensor):
        return Replicate()  # computed from no batch-sharded input
    if isinstance(value, list | tuple):
        return tuple(_layout(v, mesh) for v in value)
    return None


def analyze_batch_dims(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], input_batch_dims: Sequence[int | None], mesh: DeviceMesh
) -> dict[str, Any]:
    """The data-parallel layout of every node of ``gm`` (see the module docstring).

    Args:
        gm: an FX graph of ATen ops, e.g. from ``make_fx`` or AOTAutograd (forward,
            loss, backward in one graph, or any part of them).
        example_inputs: one value per placeholder, as global (unsharded) tensors;
            only their shapes, dtypes and devices are used.
        input_batch_dims: per placeholder, the dim that is the batch, or ``None``
            for inputs without one (parameters, optimizer state).
        mesh: the 1-D data-parallel ``DeviceMesh``.

    Returns:
        Node name to layout: a placement (``Shard(d)``, ``Replicate()``,
        ``Partial(op)``) for tensor nodes, a tuple of them for nodes returning
        several tensors, ``None`` for non-tensor nodes; ``output`` maps to the
        tuple of the graph's outputs' layouts.

    Raises:
        ValueError: ``mesh`` is not 1-D; the numbers of inputs, batch dims and
            placeholders differ; a batch dim is out of range; a node has no
            data-parallel layout (the message names it).
    """
    return _interpret(gm, example_inputs, input_batch_dims, mesh, allow_reductions=False).layouts


@dataclasses.dataclass
class StepLayouts:
    """The layouts of a training step's nodes and where its reductions over the batch are consumed."""

    layouts: dict[str, Any]
    """As :func:`analyze_batch_dims` returns them."""
    reduce_before: dict[str, list[str]]
    """Node name to the names of its inputs that are Partial and must be all-reduced before it runs."""
    local_reads: dict[str, list[str]]
    """Node name to the names of its Partial inputs it reads as each rank's local value (no all-reduce)."""


def analyze_step(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    input_batch_dims: Sequence[int | None],
    mesh: DeviceMesh,
    *,
    gradients: Sequence[torch.fx.Node] = (),
) -> StepLayouts:
    """:func:`analyze_batch_dims` for a whole training step, optimizer update included.

    NOTE [reduction edges]
    A node that DTensor can only compute by all-reducing some of its inputs is
    accepted when those inputs are Partial (reductions over the batch: a
    gradient, a loss, a batch statistic); the node is computed again with those
    inputs redistributed to Replicate, and the edges are recorded:

    - if none of the node's inputs has a batch dim (the optimizer reading a
      gradient), in :attr:`StepLayouts.reduce_before`: that is where a
      data-parallel step all-reduces;
    - otherwise (the sample count a mean loss's backward divides by,
      BatchNorm's batch statistics in training), in
      :attr:`StepLayouts.local_reads`: each rank uses its local value, as each
      rank of ``DistributedDataParallel`` does; no collective.

    Args and errors as :func:`analyze_batch_dims`, and ``gradients``: the
    nodes of the parameters' gradients as autograd accumulated them.  A local
    rule (NOTE [local rules]) never reads one of them, or a value computed
    from one, as the rank's own: DDP's readers of a gradient see the average.
    """
    seen: set[torch.fx.Node] = set()
    todo = list(gradients)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.users)
    from_gradients = frozenset(n.name for n in seen)
    interpreter = _interpret(
        gm, example_inputs, input_batch_dims, mesh, allow_reductions=True, from_gradients=from_gradients
    )
    return StepLayouts(interpreter.layouts, interpreter.reduce_before, interpreter.local_reads)


def _interpret(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    input_batch_dims: Sequence[int | None],
    mesh: Any,
    *,
    allow_reductions: bool,
    from_gradients: frozenset = frozenset(),
) -> _LayoutInterpreter:
    if mesh.ndim != 1:
        raise ValueError(f"analyze_batch_dims needs a 1-D data-parallel mesh, got a {mesh.ndim}-D mesh {mesh}")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not len(example_inputs) == len(input_batch_dims) == len(placeholders):
        raise ValueError(
            f"got {len(example_inputs)} example inputs and {len(input_batch_dims)} batch dims for a graph of "
            f"{len(placeholders)} placeholders; give one of each per placeholder"
        )
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = []
    with mode:
        for node, value, dim in zip(placeholders, example_inputs, input_batch_dims):
            if not isinstance(value, torch.Tensor):
                args.append(value)
                continue
            fake = mode.from_tensor(value)
            if dim is not None and not -value.ndim <= dim < value.ndim:
                raise ValueError(
                    f"batch dim {dim} of input {node.name!r} is out of range for its shape {tuple(value.shape)}"
                )
            placement = Replicate() if dim is None else Shard(dim % value.ndim)
            args.append(distribute_tensor(fake, mesh, [placement], src_data_rank=None))
        interpreter = _LayoutInterpreter(gm, mesh, allow_reductions, from_gradients)
        # Constants of the graph are plain tensors: no batch dim.  The graph already holds its
        # backward, and an optimizer's in-place update of a parameter is legal only without grad mode.
        with implicit_replication(), torch.no_grad():
            interpreter.run(*args)
    log.debug("batch dims of %d nodes: %s", len(interpreter.layouts), interpreter.layouts)
    return interpreter
