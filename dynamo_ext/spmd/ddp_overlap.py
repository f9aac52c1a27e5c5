"""Split for overlap for ``DistributedDataParallel`` under compiled autograd (DDP's python reducer).

NOTE [DDP's python reducer under compiled autograd]
With ``torch._dynamo.config.optimize_ddp = "python_reducer"`` set before
``DistributedDataParallel(model)`` is built, DDP registers a post-accumulate-grad
hook on each parameter that, under compiled autograd, is traced into the
backward graph as (``torch/nn/parallel/distributed.py``,
``_register_accum_grad_hook``)::

    gradient = param.grad / world_size
    gradient = all_reduce(gradient, "sum", group)   # functional: all_reduce + wait_tensor
    param.grad.copy_(gradient)

right where autograd accumulates the gradient, with the wait right after its
collective: nothing overlaps.  Stock Inductor then merges them by size
(``torch/_inductor/fx_passes/ddp_fusion.py``) and moves each wait to its first
reader, but inside one graph whose kernels it orders as it likes, and
``aot_eager`` keeps them serial.  DDPOptimizer, which cuts the *forward* graph
at bucket boundaries, is not used in this mode (nor would it help: the
backward is one compiled-autograd graph).

NOTE [split for overlap under DDP]
When the plugin is installed and Dynamo hands a compiled-autograd graph to the
backend (:func:`install` wraps ``OutputGraph.call_user_compiler``), this module
finds DDP's reducer blocks above (``param.grad`` read after the block by
nothing but the graph's output), moves each block's wait and ``copy_`` to the end of the
backward, and then does what ``data_parallel`` does (NOTE [gradient buckets],
NOTE [split for overlap]): :func:`.overlap.plan_buckets` with the DDP module's
caps (``bucket_bytes_cap`` and its first-bucket cap, read from the hook's
module), :func:`.overlap.merge_buckets` and :func:`.overlap.split_at_buckets`.
Each submodule is compiled with the user's backend by DDPOptimizer's
``SubmodCompiler``, as DDPOptimizer does for the forward.  The buckets depend
only on the graph (the collectives' order and sizes) and the caps, the same on
every rank; the collective check compares each submodule's collectives across
the ranks before it first runs.  A gradient a later hook reads keeps its
all-reduce, wait and copy where DDP's hook put them; anything else (a comm
hook, several DDP modules with different caps) is left as one graph, and the
reason logged.  Opt-in: ``dynamo_ext.config.ddp_split_for_overlap = True``
(or ``DYNAMO_EXT_DDP_SPLIT=1``); on the 2-core CPU gloo benchmark
(``benchmarks/bench_ddp_overlap.py``) the split was slower than one graph.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from .. import _compat, config
from .._patching import Patcher
from . import overlap
from .reductions import Reduction

log = logging.getLogger(__name__)

c10d = torch.ops._c10d_functional
_DIVS = (operator.truediv, torch.div, torch.ops.aten.div.Tensor)


def _is_copy_into(node: torch.fx.Node, dst: torch.fx.Node, src: torch.fx.Node) -> bool:
    if node.kwargs or tuple(node.args) != (dst, src):
        return False
    return (node.op == "call_method" and node.target == "copy_") or node.target is torch.ops.aten.copy_.default


def _is_op(node: Any, packet: Any) -> bool:
    """``node`` calls ``packet`` or its default overload (Dynamo graphs call the packet)."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in (packet, packet.default)


def reducer_blocks(gm: torch.fx.GraphModule) -> list[tuple[Reduction, torch.fx.Node]]:
    """DDP's python-reducer blocks in a compiled-autograd Dynamo graph (NOTE [DDP's python reducer under
    compiled autograd]), in graph order: ``(Reduction(div, all_reduce, wait), copy_)`` for each gradient whose
    accumulated ``param.grad`` nothing reads after the block but the graph's output (earlier hooks may read it).  The blocks' collectives and
    waits are set to call the ops' default overloads (what the bucket planning and merging match)."""
    blocks = []
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if not _is_op(node, c10d.all_reduce) or len(node.args) != 3 or node.kwargs:
            continue
        div = node.args[0]
        if not isinstance(div, torch.fx.Node) or div.target not in _DIVS or len(div.args) != 2 or div.kwargs:
            continue
        grad, world = div.args
        if node.args[1] != "sum" or not isinstance(world, int) or len(div.users) != 1 or len(node.users) != 1:
            continue
        wait = next(iter(node.users))
        if not _is_op(wait, c10d.wait_tensor) or len(wait.users) != 1 or wait.kwargs:
            continue
        copy = next(iter(wait.users))
        if not isinstance(grad, torch.fx.Node) or not _is_copy_into(copy, grad, wait) or copy.users:
            continue
        if any(u not in (div, copy) and u.op != "output" and pos[u] > pos[div] for u in grad.users):
            # a later hook reads .grad expecting the average: the wait and copy_ stay where DDP's hook put them
            log.info("DDP split: %s is read after DDP's all-reduce (a hook?): left in place", grad.name)
            continue
        node.target, wait.target = c10d.all_reduce.default, c10d.wait_tensor.default
        blocks.append((Reduction(div, node, wait, True), copy))
    return blocks


def _ddp_modules(hooks: Any) -> list[Any]:
    """The ``DistributedDataParallel`` modules whose accumulate-grad hooks are among ``hooks`` (by closure)."""
    from torch.nn.parallel import DistributedDataParallel

    found: list[Any] = []
    for hook in hooks if isinstance(hooks, list | tuple) else ():
        fn = hook.func if isinstance(hook, functools.partial) else hook
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, DistributedDataParallel) and all(value is not d for d in found):
                found.append(value)
    return found


def bucket_caps(hooks: Any) -> tuple[float, float] | None:
    """``(bucket_cap_mb, first_bucket_mb)`` of the one DDP module behind ``hooks``; None when there is not exactly one
    set of caps (no DDP module found, or several with different caps)."""
    caps = {(d.bucket_bytes_cap, _compat.ddp_first_bucket_bytes(d)) for d in _ddp_modules(hooks)}
    if len(caps) != 1:
        return None
    cap, first = caps.pop()
    return cap / 2**20, first / 2**20


def split_for_overlap(
    gm: torch.fx.GraphModule, *, bucket_cap_mb: float, first_bucket_mb: float
) -> tuple[torch.fx.GraphModule, list[overlap.GradientBucket]] | None:
    """Cut a compiled-autograd graph holding DDP's reducer blocks at gradient-bucket boundaries (NOTE [split for
    overlap under DDP]); ``gm`` is changed in place (waits and ``copy_`` moved to the end, buckets merged).
    Returns ``(split, buckets)``, or None when ``gm`` holds no reducer block or fewer than two buckets (nothing
    to overlap; the waits may have moved, which changes no value)."""
    blocks = reducer_blocks(gm)
    if not blocks:
        return None
    for n in gm.graph.nodes:  # plan/merge read meta["val"]; Dynamo keeps its fake values in meta["example_value"]
        if "example_value" in n.meta:
            n.meta["val"] = n.meta["example_value"]
    reductions = [r for r, _ in blocks]
    # Each wait, and the copy_ into .grad, goes to the end of the backward (DDP's gradients are ready when
    # backward() returns): then every member may be issued at its bucket's ready point.
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for r, copy in blocks:
        output.prepend(r.wait)
        output.prepend(copy)
    buckets = overlap.plan_buckets(gm.graph, reductions, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
    if len(buckets) < 2:
        log.info("DDP split: %d gradient bucket(s) (%s bytes): one graph", len(buckets), [b.nbytes for b in buckets])
        return None
    with _compat.no_tracing_context():  # the merge's fake values are made in the mode of Dynamo's own
        overlap.merge_buckets(gm, buckets)
    for n in gm.graph.nodes:
        if "example_value" not in n.meta and "val" in n.meta:
            n.meta["example_value"] = n.meta["val"]
    split = overlap.split_at_buckets(gm, buckets)
    log.info(
        "DDP split for overlap: %d gradient buckets (%s bytes; caps %.3g MiB, first %.3g MiB), %d submodules",
        len(buckets),
        [b.nbytes for b in buckets],
        bucket_cap_mb,
        first_bucket_mb,
        len(overlap.submodule_calls(split)),
    )
    return split, buckets


def _compile_split(
    gm: torch.fx.GraphModule, split: torch.fx.GraphModule, example_inputs: list[Any], compiler_fn: Callable[..., Any]
) -> torch.fx.GraphModule:
    """Compile each submodule of ``split`` with ``compiler_fn`` as DDPOptimizer does (its ``SubmodCompiler``)."""
    submod_compiler, propagate_dynamo_source, propagate_metadata = _compat.ddp_submod_compiler()
    propagate_dynamo_source(gm, split)
    propagate_metadata(gm, split)
    fake_mode = _compat.fake_mode_of(example_inputs)
    # Compiled autograd's graph takes its inputs as one list of real tensors (the backend flattens it); the
    # submodule compiler only fakes tensor arguments, and needs fakes to pass each submodule's outputs on.
    fake_inputs = [_compat.to_fake(fake_mode, x) for x in example_inputs]
    with _compat.saved_tensors_hooks_off_during_tracing():
        submod_compiler(split, compiler_fn, fake_mode).run(*fake_inputs)
    split.recompile()
    return split


def _wrapped_call_user_compiler(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call_user_compiler(self: Any, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        if not _compat.compiling_compiled_autograd_graph() or not any(
            _is_op(n, c10d.all_reduce) for n in gm.graph.nodes
        ):
            return original(self, gm, example_inputs)
        if not config.ddp_split_for_overlap:
            log.debug("DDP split: off (dynamo_ext.config.ddp_split_for_overlap); the backward stays one graph")
            return original(self, gm, example_inputs)
        caps = bucket_caps(_compat.compiled_autograd_hooks(self))
        if caps is None:
            log.info("DDP split: no single DistributedDataParallel module behind the backward's hooks: one graph")
            return original(self, gm, example_inputs)
        found = split_for_overlap(gm, bucket_cap_mb=caps[0], first_bucket_mb=caps[1])
        if found is None:
            return original(self, gm, example_inputs)
        split, _ = found
        backend: list[Any] = []  # the user's backend, set below before Dynamo calls compile_split

        def compile_split(g: torch.fx.GraphModule, inputs: list[Any]) -> Any:
            try:
                return _compile_split(g, split, inputs, backend[0])
            except Exception:  # noqa: BLE001  (the merged graph computes the same values: compile it whole)
                log.warning("DDP split: compiling the submodules failed; compiling the backward whole", exc_info=True)
            _compat.reset_submod_compiler_state()
            return backend[0](g, inputs)

        with _compat.backend_swapped(self, compile_split) as inner:
            backend.append(inner)
            return original(self, gm, example_inputs)

    return call_user_compiler


def install(patches: Patcher) -> None:
    """Route compiled-autograd graphs through the DDP split (NOTE [split for overlap under DDP])."""
    owner = _compat.output_graph_class()
    patches.setattr(owner, "call_user_compiler", _wrapped_call_user_compiler(owner.call_user_compiler))
