"""Trace a whole training step (forward, loss, backward, optimizer step) into one ATen graph.

A step is ``step_fn(*args, **kwargs)`` whose arguments hold modules,
optimizers and tensors (any pytree of them).  :func:`trace_step` runs it once
under ``make_fx`` on fake tensors, with every module's parameters and buffers
and every optimizer's state swapped for graph inputs, so one FX graph holds the
forward, the backward autograd runs (``loss.backward()`` is traced op by op)
and the optimizer's update.  This is how torch 2.1's ``torch.distributed._spmd``
traced a step (``stateless._reparametrize_module`` for the module, the
optimizer's ``param_groups``/``state`` re-pointed at the traced tensors).

Graph inputs, in order: parameters, buffers, optimizer state tensors, then the
tensors of ``args``/``kwargs``.  The batch dim of each of those last tensors is
a fresh symbol (every other size is static), so the graph holds for any batch
size that satisfies the recorded :attr:`TracedStep.guards`.  In-place updates
(the optimizer's ``add_`` on a parameter, a buffer's running statistics)
stay in-place ops on the input, so running the graph on the real tensors
updates them.  Graph outputs: the tensors ``step_fn`` returns, the gradients
still set on parameters when it ends (written back to ``.grad`` after a run),
and optimizer state that the step created or replaced (written back to
``optimizer.state``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from .. import _compat
from . import step_state

log = logging.getLogger(__name__)


_TRACE_HINTS = {
    "one_hot": "F.one_hot without num_classes reads the largest label, a number of classes each rank would find "
    "in its own labels under DDP: pass num_classes. ",
}
"""What to do, for a torch function that read a tensor's value while the step was traced."""


@dataclasses.dataclass
class StepArgs:
    """What one call of the step passes, found in its arguments.

    ``inputs`` are the graph's inputs, in order: parameters, buffers, optimizer
    state tensors (``state_slots`` says whose), batch tensors (``batch_leaves``:
    their positions among the argument leaves).
    """

    leaves: list[Any]
    treedef: Any
    modules: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    state_slots: list[tuple[int, torch.Tensor, str]]
    """``(optimizer index, parameter, state key)`` per optimizer state tensor."""
    batch_leaves: list[int]

    @property
    def inputs(self) -> list[torch.Tensor]:
        states = [self.optimizers[i].state[p][k] for i, p, k in self.state_slots]
        return [*self.params, *self.buffers, *states, *(self.leaves[i] for i in self.batch_leaves)]

    @property
    def num_fixed(self) -> int:
        """Inputs before the batch tensors (parameters, buffers, optimizer state)."""
        return len(self.params) + len(self.buffers) + len(self.state_slots)


def _unique(items: Any) -> list[Any]:
    seen: dict[int, Any] = {}
    for item in items:
        seen.setdefault(id(item), item)
    return list(seen.values())


def collect(args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepArgs:
    """Find the modules, optimizers, parameters, buffers, optimizer state and batch tensors of a call.

    Raises:
        ValueError: an optimizer holds a parameter of no module passed to the step.
    """
    leaves, treedef = pytree.tree_flatten((args, kwargs))
    modules = _unique(x for x in leaves if isinstance(x, torch.nn.Module))
    optimizers = _unique(x for x in leaves if isinstance(x, torch.optim.Optimizer))
    params = _unique(p for m in modules for p in m.parameters())
    buffers = _unique(b for m in modules for b in m.buffers())
    known = {id(p) for p in params}
    slots = []
    for i, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in known:
                    raise ValueError(
                        f"optimizer {type(opt).__name__} (argument leaf of the step) holds a parameter of shape "
                        f"{tuple(p.shape)} that belongs to no module passed to the step; pass the module that owns "
                        "it to the step too"
                    )
                slots.extend((i, p, k) for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor))
    batch = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)]
    return StepArgs(leaves, treedef, modules, optimizers, params, buffers, slots, batch)


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad, t.layout)


def static_key(step: StepArgs, batch_dims: Sequence[int | None]) -> tuple[Any, ...]:
    """Everything a traced graph bakes in, other than the batch sizes: a change means a new trace.

    Shapes, dtypes and devices of parameters, buffers, state and batch tensors
    (batch dim left out), the non-tensor arguments, each module's training
    flags, plain attributes and hooks, each optimizer's hyperparameters and the
    structure (and non-tensor values) of its state, the parameters' hooks
    (NOTE [Python state of a traced step]).
    """
    batch_meta = []
    for i, dim in zip(step.batch_leaves, batch_dims):
        t = step.leaves[i]
        shape = tuple(s for d, s in enumerate(t.shape) if d != dim)
        batch_meta.append((shape, t.ndim, dim, t.dtype, t.device, t.requires_grad))
    others = tuple(
        ("object", id(x)) if isinstance(x, torch.nn.Module | torch.optim.Optimizer) else ("value", repr(x))
        for i, x in enumerate(step.leaves)
        if i not in set(step.batch_leaves)
    )
    opt_meta = []
    for opt in step.optimizers:
        groups = tuple(tuple(sorted((k, repr(v)) for k, v in g.items() if k != "params")) for g in opt.param_groups)
        state = tuple(
            tuple(sorted((k, _meta(v) if isinstance(v, torch.Tensor) else repr(v)) for k, v in opt.state[p].items()))
            if p in opt.state
            else ()
            for g in opt.param_groups
            for p in g["params"]
        )
        opt_meta.append((groups, state))
    return (
        str(step.treedef),
        step_state.snapshot(step.modules, step.optimizers, step.params),
        others,
        tuple(_meta(p) for p in step.params),
        tuple(_meta(b) for b in step.buffers),
        tuple(batch_meta),
        tuple(tuple(m.training for m in mod.modules()) for mod in step.modules),
        tuple(opt_meta),
    )


@dataclasses.dataclass
class TracedStep:
    """One traced step: its graph and how to map its outputs back."""

    gm: torch.fx.GraphModule
    example_inputs: list[torch.Tensor]
    """The fake inputs it was traced with (batch dims symbolic)."""
    batch_symbols: list[Any]
    """Per batch tensor, the sympy symbol of its batch dim (None for tensors without one)."""
    guards: list[Any]
    """Shape guards (sympy booleans over the batch symbols) the trace recorded: the graph holds where they do."""
    out_spec: Any
    out_constants: dict[int, Any]
    """Non-tensor leaves of ``step_fn``'s result, by leaf position."""
    num_user_outputs: int
    grad_params: list[int]
    """Parameter indices whose gradient is an output (after the user's outputs)."""
    state_outputs: list[tuple[int, int, str]]
    """``(optimizer index, parameter index, key)`` of state tensors output after the gradients."""
    state_constants: list[tuple[int, int, str, Any]]
    """Non-tensor optimizer state the step set: ``(optimizer, parameter index, key, value)``."""
    checked: dict[tuple[int | None, ...], bool] = dataclasses.field(default_factory=dict)
    """Batch sizes already checked against :attr:`guards`, and the answer."""
    gradients: dict[int, torch.fx.Node] = dataclasses.field(default_factory=dict)
    """Parameter index to the node of its gradient as autograd accumulated it (``post_accumulate_grad`` hooks),
    in the order the backward produced them."""

    def holds_for(self, batch: Sequence[torch.Tensor], batch_dims: Sequence[int | None]) -> bool:
        """Whether the graph is valid for these batch tensors: every recorded guard holds for their batch sizes."""
        sizes = tuple(None if d is None else t.shape[d % t.ndim] for t, d in zip(batch, batch_dims))
        if sizes not in self.checked:
            values = {sym: n for sym, n in zip(self.batch_symbols, sizes) if sym is not None}
            self.checked[sizes] = all(bool(g.subs(values)) for g in self.guards)
        return self.checked[sizes]


@contextlib.contextmanager
def _swap_optimizer(opt: torch.optim.Optimizer, fakes: dict[int, torch.Tensor], state: dict[Any, Any]) -> Any:
    saved_params = [g["params"] for g in opt.param_groups]
    saved_state = opt.state
    try:
        for g in opt.param_groups:
            g["params"] = [fakes[id(p)] for p in g["params"]]
        opt.state = collections.defaultdict(dict, state)
        yield
    finally:
        for g, ps in zip(opt.param_groups, saved_params):
            g["params"] = ps
        opt.state = saved_state


def _size_symbol(fake: torch.Tensor, dim: int) -> Any:
    """The sympy symbol of ``fake``'s size along ``dim`` (made dynamic by ``_compat.fake_tensor``)."""
    size = fake.shape[dim % fake.ndim]
    assert isinstance(size, torch.SymInt), f"batch dim {dim} of {tuple(fake.shape)} is not symbolic"
    return size.node.expr


def trace_step(
    step_fn: Callable[..., Any],
    step: StepArgs,
    batch_dims: Sequence[int | None],
    *,
    tracing_mode: Literal["fake", "symbolic"] = "symbolic",
) -> TracedStep:
    """Trace ``step_fn`` on fakes of ``step``'s tensors (see the module docstring).

    Args:
        step_fn: the single-device training step.
        step: the call's arguments, from :func:`collect`.
        batch_dims: per batch tensor (``step.batch_leaves``), its batch dim or None.

    Raises:
        ValueError: a batch dim is out of range or has size < 2 (a size-1 dim
            cannot be symbolic); the step fails to trace (the message says
            which op) or reads a tensor's value into Python (``.item()``, an
            optimizer's CPU step count); a parameter has a post-accumulate-grad
            hook; tracing changed Python state (an LR scheduler stepped inside
            the step): NOTE [Python state of a traced step].
    """
    step_state.refuse_post_accumulate_hooks(step.params)
    schedulers = step_state.schedulers(step.optimizers)
    python_state = step_state.snapshot(step.modules, step.optimizers, step.params)
    python_state += step_state.scheduler_snapshot(schedulers)
    mode = _compat.symbolic_fake_mode()
    fakes: list[torch.Tensor] = []
    fixed = [*step.params, *step.buffers, *(step.optimizers[i].state[p][k] for i, p, k in step.state_slots)]
    for t in fixed:
        fakes.append(_compat.fake_tensor(mode, t, dynamic_dim=None, name=""))
    for n, (leaf, dim) in enumerate(zip(step.batch_leaves, batch_dims)):
        t = step.leaves[leaf]
        if dim is not None:
            if not -t.ndim <= dim < t.ndim:
                raise ValueError(
                    f"batch_dim {dim} is out of range for tensor argument {n} of shape {tuple(t.shape)}; give the "
                    "dim of each tensor argument that holds the samples (or None for one without a batch dim)"
                )
            dim %= t.ndim
            if t.shape[dim] < 2:
                raise ValueError(
                    f"tensor argument {n} has {t.shape[dim]} sample(s) on its batch dim {dim} (shape "
                    f"{tuple(t.shape)}); data_parallel needs at least 2 samples per rank so the batch size "
                    "can stay symbolic"
                )
        fakes.append(_compat.fake_tensor(mode, t, dynamic_dim=dim, name=f"batch{n}"))
    # The symbols as created (tracing may replace one by another, e.g. two batch sizes found equal).
    symbols = [None if d is None else _size_symbol(f, d) for f, d in zip(fakes[step.num_fixed :], batch_dims)]
    record: dict[str, Any] = {}
    n_params, n_buffers = len(step.params), len(step.buffers)

    def fn(*flat: torch.Tensor) -> tuple[Any, ...]:
        fake_params = flat[:n_params]
        by_id = {id(p): f for p, f in zip(step.params, fake_params)}
        by_id.update({id(b): f for b, f in zip(step.buffers, flat[n_params : n_params + n_buffers])})
        states: list[dict[Any, Any]] = [{} for _ in step.optimizers]
        for (i, p, k), f in zip(step.state_slots, flat[n_params + n_buffers : step.num_fixed]):
            states[i].setdefault(by_id[id(p)], dict(step.optimizers[i].state[p]))[k] = f
        for i, opt in enumerate(step.optimizers):  # non-tensor state (a Python step count) as is
            for p, st in opt.state.items():
                states[i].setdefault(by_id[id(p)], dict(st))
        leaves = list(step.leaves)
        for leaf, f in zip(step.batch_leaves, flat[step.num_fixed :]):
            leaves[leaf] = f
        args, kwargs = pytree.tree_unflatten(leaves, step.treedef)
        before = [{id(fp): dict(st) for fp, st in s.items()} for s in states]
        accumulated: dict[int, torch.Tensor] = {}  # parameter index -> its gradient as autograd accumulated it
        with contextlib.ExitStack() as stack:
            for j, fp in enumerate(fake_params):
                if fp.requires_grad:
                    for user_hook in step_state.pre_hooks(step.params[j]):  # on the local gradient, as under DDP
                        stack.callback(fp.register_hook(user_hook).remove)
                    # A detach made now reads the gradient's node as accumulated, before any later in-place
                    # update (gradient clipping) moves the tensor's node on.
                    hook = fp.register_post_accumulate_grad_hook(
                        lambda p, j=j: accumulated.__setitem__(j, p.grad.detach())
                    )
                    stack.callback(hook.remove)
            for m in step.modules:
                names: dict[str, torch.Tensor] = dict(m.named_parameters(remove_duplicate=False))
                names.update(dict(m.named_buffers(remove_duplicate=False)))
                stack.enter_context(_compat.reparametrize_module(m, {k: by_id[id(v)] for k, v in names.items()}))
            for i, opt in enumerate(step.optimizers):
                stack.enter_context(_swap_optimizer(opt, by_id, states[i]))
            out = step_fn(*args, **kwargs)
            state_after = [dict(opt.state) for opt in step.optimizers]
        out_leaves, record["spec"] = pytree.tree_flatten(out)
        record["constants"] = {i: x for i, x in enumerate(out_leaves) if not isinstance(x, torch.Tensor)}
        user = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        record["grad_params"] = [j for j, fp in enumerate(fake_params) if fp.grad is not None]
        grads = [fake_params[j].grad for j in record["grad_params"]]
        index = {id(fp): j for j, fp in enumerate(fake_params)}
        new_state, constants = [], []
        for i, after in enumerate(state_after):
            for fp, st in after.items():
                old = before[i].get(id(fp), {})
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        if old.get(k) is not v:
                            new_state.append(((i, index[id(fp)], k), v))
                    elif k not in old or old[k] != v:
                        constants.append((i, index[id(fp)], k, v))
        record["state_outputs"] = [slot for slot, _ in new_state]
        record["state_constants"] = constants
        record["num_user"] = len(user)
        record["accumulated"] = list(accumulated)
        return (*user, *grads, *(v for _, v in new_state), *accumulated.values())

    try:
        gm = make_fx(fn, tracing_mode=tracing_mode, record_module_stack=False)(*fakes)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # A data-dependent guard names the torch function that read a value ("Caused by: (file:line in fn)").
        caller = re.search(r"Caused by: \(\S+ in (\w+)\)", str(e))
        where = f" in torch's {caller.group(1)}" if caller else ""
        hint = _TRACE_HINTS.get(caller.group(1), "") if caller else ""
        raise ValueError(
            f"data_parallel could not trace the step into one graph ({type(e).__name__}{where}: {first}). {hint}"
            "The step must be traceable by make_fx: no .item()/.tolist() or Python control flow on tensor values "
            "(an optimizer keeping a CPU step count, e.g. Adam without capturable=True, reads it with .item())"
        ) from e
    after = step_state.snapshot(step.modules, step.optimizers, step.params)
    step_state.refuse_changes(python_state, after + step_state.scheduler_snapshot(schedulers))
    step_state.refuse_local_scalars(gm, step)
    # The accumulated gradients were extra outputs only so their nodes can be found: take them out.
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = list(output.args[0])
    n_acc = len(record["accumulated"])
    gradients = dict(zip(record["accumulated"], (d.args[0] for d in outs[len(outs) - n_acc :])))
    output.args = (tuple(outs[: len(outs) - n_acc]),)
    for n in reversed(list(gm.graph.nodes)):  # record_function markers (Optimizer.step): not compilable, no effect
        if getattr(n.target, "namespace", None) == "profiler":
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    alive = set(gm.graph.nodes)
    gradients = {j: n for j, n in gradients.items() if n in alive}
    constants = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    if constants:
        # A tensor the step or a hook closes over (not a parameter or buffer) is held by the graph as is:
        # in-place updates of it are seen, binding the name to another tensor is not.
        log.info(
            "data_parallel: the traced step holds %d tensor(s) it closes over as graph constants (shapes %s); "
            "update them in place, a reassigned tensor is not seen",
            len(constants),
            [tuple(c.shape) for c in constants if isinstance(c, torch.Tensor)],
        )
    # Every size but the batch dims is static, so each guard the trace recorded is about batch sizes.
    guards = [g.expr for g in mode.shape_env.guards]
    log.debug("traced step: %d nodes, batch symbols %s, guards %s", len(gm.graph.nodes), symbols, guards)
    return TracedStep(
        gm=gm,
        example_inputs=fakes,
        batch_symbols=symbols,
        guards=guards,
        out_spec=record["spec"],
        out_constants=record["constants"],
        num_user_outputs=record["num_user"],
        grad_params=record["grad_params"],
        state_outputs=record["state_outputs"],
        state_constants=record["state_constants"],
        gradients=gradients,
    )
