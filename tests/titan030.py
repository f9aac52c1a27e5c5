"""torchtitan 0.3.0's own Llama 3 training step on gloo ranks: eager, stock ``torch.compile`` and the plugin.

What is torchtitan's here: the model (``llama3_debugmodel()``'s Llama 3 config, cut to ``n_layers`` layers
and a short sequence for the CPU), ``Llama3Model.Config.update_from_config`` (its sharding configs),
``parallelize_llama`` (TP through ``Module.parallelize``, selective activation checkpointing, FSDP2 through
``apply_fsdp_to_decoder``), ``ParallelDims`` (dp_shard=2 x tp=2 on 4 ranks), its SPMD context
(``get_spmd_context``), input annotation (``annotate_input_spmd_types``), ``ChunkedLossWrapper`` over
``CrossEntropyLoss`` (the output projection run per chunk, eagerly, with a backward per chunk), AdamW and the
LR scheduler of ``OptimizersContainer`` / ``LRSchedulersContainer``.  The step is ``Trainer.train_step``'s
without its dataloader, metrics and checkpointer.

Three departures, for the CPU and gloo (each applied where it acts, :func:`_cpu_patches`):

- ``torchtitan.distributed.parallel_dims.device_type = "cpu"``: the CUDA wheel on a machine without a GPU
  makes torchtitan's ``device_type`` "cuda", and ``ParallelDims`` builds its meshes on it;
- FSDP2's sum reduction forced (``set_force_sum_reduction_for_comms(True)`` on every FSDP2 module): torchtitan
  sets a gradient divide factor of 1, for which FSDP2 reduce-scatters with ``PREMUL_SUM``, which gloo lacks;
- FlexAttention swapped for torchtitan's own ``ScaledDotProductAttention`` (causal, no masks): FlexAttention
  has no backward on the CPU.

Compile modes: ``"eager"``, ``"per_block"`` (torchtitan's ``compile.enable`` with components ``["model"]``:
``apply_compile`` compiles each block, ``fullgraph=True``) and ``"whole"`` (``torch.compile(model)`` after
parallelize).  The loss is never compiled (torchtitan's default components compile it separately; the chunked
loss's output projection runs eagerly as in torchtitan).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

SPMD_BACKENDS = ("spmd_types", "partial_dtensor")


@dataclasses.dataclass(frozen=True)
class Setup:
    """One configuration of the step (keyword arguments of :func:`run`)."""

    spmd_backend: str = "spmd_types"
    mode: str = "whole"  # "eager" | "per_block" | "whole"
    backend: str = "aot_eager"
    n_layers: int = 2
    seq_len: int = 16
    local_batch: int = 2
    steps: int = 3
    ac: bool = True  # torchtitan's default selective activation checkpointing
    # Micro-batches per optimizer step (torchtitan's gradient accumulation: a forward and backward each).
    accumulate: int = 1
    # Before every ``eval_every``-th step, an eval pass as torchtitan's validator runs it: the model (not
    # compiled) and the chunked loss under no_grad.
    eval_every: int = 0


def _cpu_patches() -> None:
    # torchtitan reads the device type at import time from the CUDA wheel ("cuda"); ParallelDims builds its
    # meshes with it, and gloo ranks on the CPU need "cpu".
    import torchtitan.distributed.parallel_dims as parallel_dims_module

    parallel_dims_module.device_type = "cpu"


def _force_sum_reduction(model: torch.nn.Module) -> None:
    # torchtitan's disable_fsdp_gradient_division sets a divide factor of 1, which FSDP2 turns into a
    # PREMUL_SUM reduce-scatter; gloo has no PREMUL_SUM.  A sum with no division reduces the same values.
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def _sdpa_config(trainer_config: Any) -> None:
    # FlexAttention has no backward on the CPU: torchtitan's ScaledDotProductAttention (causal) instead.
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in trainer_config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


class CountingBackend:
    """A backend (``inner`` by name) that records the compile id of every graph handed to it.

    ``graphs``: how many graphs; ``recompiles``: how many compiles of a frame already compiled once (a
    ``frame_compile_id`` above 0).
    """

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.ids: list[tuple[int, int]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        import dynamo_ext._compat as compat

        cid = compat.current_compile_id()
        self.ids.append((cid.frame_id, cid.frame_compile_id))
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)

    @property
    def graphs(self) -> int:
        return len(self.ids)

    @property
    def recompiles(self) -> int:
        return len({i for i in self.ids if i[1] > 0})


@dataclasses.dataclass
class Trainer:
    """The parts of torchtitan's ``Trainer`` one step uses."""

    model: torch.nn.Module
    step_model: Any  # the module called by the step (compiled or not)
    loss_fn: Any
    optimizers: Any
    lr_schedulers: Any
    parallel_dims: Any
    train_context: Any
    config: Any
    backend: CountingBackend


_PARALLEL_DIMS: dict[tuple[str, int], Any] = {}


def _parallel_dims(config: Any, world: int) -> Any:
    # One ParallelDims (its meshes) per backend and process: on torch 2.15 a DTensor made on a mesh equal to
    # an earlier build's can carry that earlier mesh object, and fully_shard then refuses the parameter
    # ("Expected param's DTensor mesh to be the same mesh passed to fully_shard").
    from torchtitan.distributed import ParallelDims

    key = (config.parallelism.spmd_backend, world)
    if key not in _PARALLEL_DIMS:
        _PARALLEL_DIMS[key] = ParallelDims.from_config(config.parallelism, world)
    return _PARALLEL_DIMS[key]


def build(world: int, setup: Setup) -> Trainer:
    """torchtitan's model, parallelized by its own ``parallelize_llama``, with its loss, optimizer and scheduler.

    Compiled as ``setup.mode`` says, through a :class:`CountingBackend` of ``setup.backend``.
    """
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.tools import utils

    _cpu_patches()
    backend = CountingBackend(setup.backend)
    config = llama3_debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[: setup.n_layers]
    _sdpa_config(config)
    config.training.seq_len = setup.seq_len
    config.training.local_batch_size = setup.local_batch
    config.training.steps = setup.steps
    config.parallelism.spmd_backend = setup.spmd_backend
    config.parallelism.data_parallel_shard_degree = 2
    config.parallelism.tensor_parallel_degree = world // 2
    if setup.mode == "per_block":
        config.compile.enable = True
        config.compile.components = ["model"]
        config.compile.backend = backend  # apply_compile passes it on to each block's compile
    if not setup.ac:
        config.activation_checkpoint = None
    parallel_dims = _parallel_dims(config, world)
    dist_utils.set_spmd_backend(setup.spmd_backend)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    torch.manual_seed(0)
    with torch.device("meta"), utils.set_default_dtype(torch.float32):
        model = model_config.build()
    model = config.model_spec.parallelize_fn(
        model,
        parallel_dims=parallel_dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=config.activation_checkpoint,
        dump_folder="/tmp",
    )
    _force_sum_reduction(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    assert isinstance(loss_fn, ChunkedLossWrapper)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model])
    lr_schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=setup.steps)
    train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    step_model = torch.compile(model, backend=backend) if setup.mode == "whole" else model
    return Trainer(model, step_model, loss_fn, optimizers, lr_schedulers, parallel_dims, train_context, config, backend)


def batch(rank: int, setup: Setup, step: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and labels for ``step``: one batch per data-parallel rank, the same on its TP ranks."""
    g = torch.Generator().manual_seed(1000 * step + rank // tp)
    tokens = torch.randint(0, 2048, (setup.local_batch, setup.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t._local_tensor if isinstance(t, DTensor) else t).detach().clone()


def _describe(t: torch.Tensor | None) -> Any:
    """(type name, placements, local values) of a gradient or parameter."""
    from torch.distributed.tensor import DTensor

    if t is None:
        return None
    placements = tuple(str(p) for p in t.placements) if isinstance(t, DTensor) else None
    return (type(t).__name__, placements, _local(t))


def local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's local shard, by name (to start other runs from the same values)."""
    return {name: _local(p) for name, p in model.named_parameters()}


def load_local_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy local shards saved by :func:`local_state` into ``model``'s parameters."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            (p._local_tensor if isinstance(p, DTensor) else p).copy_(state[name])


def train_step(rank: int, t: Trainer, setup: Setup, step: int) -> dict[str, Any]:
    """torchtitan's ``train_step``: loss, gradients before clipping, parameters after the optimizer step."""
    import torchtitan.distributed.utils as dist_utils
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    tp = t.parallel_dims.tp
    t.optimizers.zero_grad(set_to_none=True)
    batches = [batch(rank, setup, step * setup.accumulate + i, tp) for i in range(setup.accumulate)]
    local_valid = sum((labels != -100).sum() for _, labels in batches)
    global_valid = dist_utils.dist_sum_tensor(local_valid, t.parallel_dims.get_mesh("batch"))
    start = time.perf_counter()
    total = None
    for inputs, labels in batches:
        if setup.spmd_backend == "spmd_types":
            inputs, labels, _ = annotate_input_spmd_types(t.parallel_dims, inputs, labels, {})
        with t.train_context():
            pred = t.step_model(inputs)
            loss, _ = t.loss_fn(pred, labels, global_valid)
            del pred
            loss.backward()
        loss = loss.detach()
        total = loss if total is None else total + loss
    seconds = time.perf_counter() - start
    grads = {name: _describe(p.grad) for name, p in t.model.named_parameters()}
    dist_utils.clip_grad_norm_(list(t.model.parameters()), t.config.training.max_norm, foreach=True)
    t.optimizers.step()
    t.lr_schedulers.step()
    params = {name: _local(p) for name, p in t.model.named_parameters()}
    assert total is not None
    if isinstance(total, DTensor):  # partial_dtensor's loss: the chunked loss's sum on the decoder's mesh
        total = total.full_tensor()
    return {"loss": total.clone(), "grads": grads, "params": params, "seconds": seconds}


def eval_pass(rank: int, t: Trainer, setup: Setup) -> torch.Tensor:
    """torchtitan's validator step: the model and the chunked loss under ``no_grad``."""
    inputs, labels = batch(rank, setup, 10_000, t.parallel_dims.tp)
    if setup.spmd_backend == "spmd_types":
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types

        inputs, labels, _ = annotate_input_spmd_types(t.parallel_dims, inputs, labels, {})
    with torch.no_grad(), t.train_context():
        loss, _ = t.loss_fn(t.model(inputs), labels, None)
    return loss


def run(rank: int, world: int, setup: Setup, *, plugin: bool, start: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """``setup.steps`` training steps; with ``plugin`` dynamo_ext is installed for the run and uninstalled after.

    Returns the records of :func:`train_step` per step, Dynamo's counters (graph breaks by reason, unique
    graphs, recompiles), the initial local state and the CPU time of the run.
    """
    import dynamo_ext
    import dynamo_ext._compat as compat

    torch._dynamo.reset()
    compat.dynamo_counters().clear()
    if plugin:
        dynamo_ext.install()
    cpu = time.process_time()
    try:
        t = build(world, setup)
        if start is not None:
            load_local_state(t.model, start)
        initial = local_state(t.model)
        steps = []
        for step in range(setup.steps):
            if setup.eval_every and step and step % setup.eval_every == 0:
                eval_pass(rank, t, setup)
            steps.append(train_step(rank, t, setup, step))
    finally:
        if plugin:
            dynamo_ext.uninstall()
    return {
        "steps": steps,
        "initial": initial,
        "breaks": dict(compat.dynamo_counters()["graph_break"]),
        "graphs": t.backend.graphs,
        "recompiles": t.backend.recompiles,
        "cpu": time.process_time() - cpu,
    }


def mismatches(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Structural differences between two :func:`run` results: a gradient present in one only, or of another
    type or placements, or a tensor of another shape or dtype."""
    out = []
    for i, (s, r) in enumerate(zip(a["steps"], b["steps"], strict=True)):
        for name, g in s["grads"].items():
            h = r["grads"][name]
            if (g is None) != (h is None) or (g is not None and (g[:2] != h[:2] or g[2].shape != h[2].shape)):
                out.append(f"step {i}: gradient of {name}: {g and g[:2]} vs {h and h[:2]}")
        for name, p in s["params"].items():
            q = r["params"][name]
            if p.shape != q.shape or p.dtype != q.dtype:
                out.append(f"step {i}: parameter {name}: {tuple(p.shape)} {p.dtype} vs {tuple(q.shape)} {q.dtype}")
    return out


def errors(a: dict[str, Any], b: dict[str, Any]) -> dict[tuple[Any, ...], float]:
    """How far ``a``'s numbers are from ``b``'s, per step: the loss's relative difference (``("loss", step)``),
    each gradient's largest difference over its largest value (``("grad", step, name)``) and each parameter's
    largest difference after the optimizer step (``("param", step, name)``).  Structure is :func:`mismatches`'."""
    out: dict[tuple[Any, ...], float] = {}

    def scaled(x: torch.Tensor, y: torch.Tensor) -> float:
        return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() if y.numel() else 0.0

    for i, (s, r) in enumerate(zip(a["steps"], b["steps"], strict=True)):
        out[("loss", i)] = abs((s["loss"] - r["loss"]) / r["loss"]).item()
        for name, g in s["grads"].items():
            h = r["grads"][name]
            if g is not None and h is not None and g[2].shape == h[2].shape:
                out[("grad", i, name)] = scaled(g[2], h[2])
        for name, p in s["params"].items():
            q = r["params"][name]
            if p.shape == q.shape:
                out[("param", i, name)] = (p - q).abs().max().item() if p.numel() else 0.0
    return out


# NOTE [torchtitan 0.3.0 against eager: tolerances]
# Measured on 4 gloo ranks (dp_shard=2 x tp=2, 2 layers, sequence 16, 5 AdamW steps of 2 micro-batches,
# aot_eager), stock torch.compile and the plugin alike: the first step's loss and every gradient but the
# RMSNorm weights' are eager's to the bit; the RMSNorm weights' gradients differ by up to 0.6% of their largest
# value (compiled code decomposes rms_norm's backward; eager runs the fused kernel), and AdamW turns a gradient
# near 0 of the other sign into a step of the other sign (up to 6e-4 on a parameter).  From the second step on
# every number carries that: losses within 6e-5 (relative), gradients within 1% of their largest value.
# Each bound below is about 4x the larger of stock's and the plugin's; a gradient reduced twice, not at all, or
# over the wrong ranks is off by 50% or more.
TOLERANCES = {
    "first loss": 1e-6,
    "first gradient": 1e-5,
    "first RMSNorm gradient": 2e-2,
    "first parameter": 1e-6,
    "first RMSNorm parameter": 2e-3,
    "loss": 3e-4,
    "gradient": 4e-2,
    "parameter": 3e-3,
}


def beyond_tolerance(errs: dict[tuple[Any, ...], float]) -> list[str]:
    """The entries of :func:`errors` beyond :data:`TOLERANCES` (NOTE [torchtitan 0.3.0 against eager: tolerances])."""
    names = {"loss": "loss", "grad": "gradient", "param": "parameter"}
    out = []
    for key, value in errs.items():
        kind, step, name = key[0], key[1], key[2] if len(key) > 2 else ""
        what = names[kind]
        if step == 0:
            what = ("first RMSNorm " if name.endswith("norm.weight") and kind != "loss" else "first ") + what
        if value > TOLERANCES[what]:
            out.append(f"step {step}: {what} {name}: {value:.3g} > {TOLERANCES[what]:g}")
    return out


def measure(rank: int, world: int, setup: Setup) -> dict[str, Any]:
    """Eager, stock and the plugin from the same parameters, in one process: per compiled run its graph breaks
    (by reason), graphs, recompiles, first and later step times (seconds), the CPU time of the run, structural
    mismatches with eager, its largest distance from eager per kind of number, and the entries beyond
    :data:`TOLERANCES`; for the plugin, whether it is stock's numbers to the bit."""
    eager = run(rank, world, dataclasses.replace(setup, mode="eager"), plugin=False, start=None)
    out: dict[str, Any] = {"torch": torch.__version__, "eager_seconds": [s["seconds"] for s in eager["steps"]]}
    results = {}
    for name in ("stock", "plugin"):
        r = results[name] = run(rank, world, setup, plugin=name == "plugin", start=eager["initial"])
        errs = errors(r, eager)
        worst: dict[str, float] = {}
        for key, value in errs.items():
            worst[key[0]] = max(worst.get(key[0], 0.0), value)
        out[name] = {
            "breaks": {k.split("Developer debug context:")[-1].strip()[:200]: v for k, v in r["breaks"].items()},
            "graphs": r["graphs"],
            "recompiles": r["recompiles"],
            "seconds": [s["seconds"] for s in r["steps"]],
            "cpu": r["cpu"],
            "mismatches": mismatches(r, eager),
            "largest_error": worst,
            "beyond_tolerance": beyond_tolerance(errs),
        }
    out["plugin"]["same_as_stock"] = mismatches(results["plugin"], results["stock"]) == [] and not any(
        errors(results["plugin"], results["stock"]).values()
    )
    return out


def main(argv: list[str] | None = None) -> None:
    """``python tests/titan030.py [--spmd-backend B] [--mode M] [--backend K] ...``: :func:`measure` on 4 gloo
    ranks, one JSON line per rank on stdout."""
    import argparse
    import json

    import titan030  # the rank processes import the functions they run by module name, not as __main__
    from helpers import run_on_ranks

    defaults = Setup()
    parser = argparse.ArgumentParser(description=main.__doc__)
    for field in dataclasses.fields(Setup):
        flag = "--" + field.name.replace("_", "-")
        kind = type(getattr(defaults, field.name))
        if kind is bool:
            parser.add_argument(flag, type=lambda v: v.lower() in ("1", "true", "yes"), default=field.default)
        else:
            parser.add_argument(flag, type=kind, default=field.default)
    args = parser.parse_args(argv)
    setup = Setup(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Setup)})
    for rank, result in enumerate(
        run_on_ranks(titan030.measure, titan030.Setup(**dataclasses.asdict(setup)), plugin=False)
    ):
        print(json.dumps({"rank": rank, "setup": dataclasses.asdict(setup), **result}, default=str))


if __name__ == "__main__":
    main()
