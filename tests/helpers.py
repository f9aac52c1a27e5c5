"""Test helpers: the fake process group and real gloo ranks.

Every use of the private ``torch.testing._internal`` helpers goes through this
module.  Gloo ranks are started with torch's own elastic launcher.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import socket
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.fx


# ---- single process: the fake process group ---------------------------------
@contextlib.contextmanager
def fake_world(world_size: int = 4, rank: int = 0) -> Iterator[None]:
    """A default process group of ``world_size`` fake ranks; collectives return garbage, fast."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_graph(build: Callable[[torch.fx.Graph], list[tuple[tuple[int, ...], torch.dtype]]]) -> torch.fx.GraphModule:
    """A hand-built graph with ``meta["val"]`` on every node: ``build(graph)`` adds the nodes and returns the
    placeholders' ``(shape, dtype)``; fake tensors of those are propagated through it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    g = torch.fx.Graph()
    shapes = build(g)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode()
    with mode:
        fake = [torch.empty(s, dtype=d) for s, d in shapes]
    FakeTensorProp(gm, mode).propagate(*fake)
    return gm


def normalize_gm(text: str) -> str:
    """``gm.print_readable(False)`` with run-dependent names removed (for expecttest)."""
    from torch._dynamo.testing import normalize_gm as _normalize

    text = _normalize(text)
    return re.sub(r"group_name = '[^']*'|'\d+'(?=\))", "'<group>'", text)


class CountingBackend:
    """A backend that records every graph Dynamo hands it and runs it eagerly (or with ``inner``)."""

    def __init__(self, inner: str | None = None) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.inner = inner

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs.append(gm)
        if self.inner is None:
            return gm.forward
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)

    @property
    def frame_count(self) -> int:
        return len(self.graphs)


class AotGraphs:
    """A backend keeping Dynamo's graphs and the code of AOTAutograd's forward and backward graphs, with each
    AOT node's module paths and stack trace (which block it is in and the user line it came from: the audit
    reports them).

    Partitioned as ``aot_eager`` and ``inductor`` do (min-cut, honouring the checkpoint's recompute tags), so
    what the forward saves for backward is part of the code compared.
    """

    def __init__(self) -> None:
        self.dynamo: list[torch.fx.GraphModule] = []
        self.codes: list[str] = []
        self.contexts: list[list[tuple[str, list[str], str | None]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        self.dynamo.append(gm)

        def keep(g: torch.fx.GraphModule, _inputs: Any) -> Any:
            self.codes.append(g.code)
            self.contexts.append([(n.name, module_paths(n), n.meta.get("stack_trace")) for n in g.graph.nodes])
            return g

        return aot_module_simplified(
            gm, example_inputs, fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition
        )


def compiled_llama_loss(mesh: Any, n_layers: int = 2) -> tuple[torch.nn.Module, torch.Tensor]:
    """The bundled Llama (FSDP over TP on ``mesh``), seeded, its forward compiled with ``aot_eager``: the model
    and the loss of one batch, ready for a backward (under compiled autograd, for the tests of its capture)."""
    from dynamo_ext.audit.targets import example_llama as ex

    cfg = ex.Config(n_layers=n_layers)
    torch.manual_seed(0)
    model = ex.parallelize(ex.Decoder(cfg), mesh)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1))
    logits = torch.compile(model, backend="aot_eager")(tokens[:, :-1])
    return model, torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))


def module_paths(node: torch.fx.Node) -> list[str]:
    """The module paths of a node's ``nn_module_stack``, outermost first."""
    return [path for path, _cls in (node.meta.get("nn_module_stack") or {}).values()]


def all_gathers(graphs: list[torch.fx.GraphModule]) -> int:
    """How many all-gathers running ``graphs`` issues: a higher-order op's body (activation checkpoint,
    ``autograd.Function``) counts once per call of it (``fx.collectives.iter_collectives``)."""
    from dynamo_ext.fx.collectives import iter_collectives

    return sum(c.name.startswith("all_gather") for gm in graphs for c in iter_collectives(gm, into_subgraphs=True))


# ---- several processes: gloo on loopback ---------------------------------------
def assert_sgd_steps_match_eager(
    compiled: Callable[[torch.Tensor], torch.Tensor],
    net: torch.nn.Module,
    ref: torch.nn.Module,
    inputs: list[torch.Tensor],
    *,
    lr: float = 0.1,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """One plain SGD step per input on ``net`` (called through ``compiled``) and on its eager copy ``ref``.

    Asserts the loss (mean of squares of the output) and every parameter's gradient at each step, and the
    parameters after the last, equal within ``rtol`` / ``atol``; a gradient's message names its parameter.
    """
    for x in inputs:
        loss, ref_loss = compiled(x).pow(2).mean(), ref(x).pow(2).mean()
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
        with torch.no_grad():
            for p, q in zip(net.parameters(), ref.parameters()):
                p -= lr * p.grad
                q -= lr * q.grad
                p.grad = q.grad = None
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


def env_tool(name: str) -> str | None:
    """The console script ``name`` installed beside the running interpreter (the ``[test]`` extra's ``ruff``,
    ``pyright``), else the one on ``PATH``, else None: a suite run with an unactivated venv finds its own tools."""
    import shutil
    import sys
    from pathlib import Path

    scripts = Path(sys.executable).parent
    for candidate in (name, f"{name}.exe"):
        if (scripts / candidate).is_file():
            return str(scripts / candidate)
    return shutil.which(name)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(fn: Callable[..., Any], plugin: bool, args: tuple[Any, ...]) -> Any:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        if plugin:
            import dynamo_ext

            dynamo_ext.install()
        return fn(dist.get_rank(), dist.get_world_size(), *args)
    finally:
        dist.destroy_process_group()


# NOTE [ranks forked from a forkserver]: a spawned rank imports torch afresh (3-5 s of CPU each, 4 per
# launch, on 2 cores), and the suite launches ranks about twenty times.  The ranks are instead forked from
# multiprocessing's forkserver, one process per session that imported torch and Dynamo once (torch's
# DataLoader forks its workers after the same imports).  A forked rank has the environment and working
# directory the forkserver started with, not the caller's current ones, so a launch whose environment or
# directory differs from those (a test's monkeypatch.setenv for its ranks) spawns as before.  Two variables change on their own and reach no rank
# from the caller: pytest's PYTEST_CURRENT_TEST (each test's name) and TORCHELASTIC_* (set by the launcher,
# which gives each rank its own).
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]
_forkserver_env: tuple[str, dict[str, str]] | None = None


def _rank_environment() -> tuple[str, dict[str, str]]:
    """This process's working directory and environment, less the variables that change on their own
    (NOTE [ranks forked from a forkserver])."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST" and not k.startswith("TORCHELASTIC_")}
    return os.getcwd(), env


def _start_method() -> str:
    """``"forkserver"`` when this process's environment and working directory are the ones the forkserver
    started with (the first call's), else ``"spawn"`` (NOTE [ranks forked from a forkserver])."""
    import multiprocessing

    global _forkserver_env
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    if _forkserver_env is None:
        multiprocessing.get_context("forkserver").set_forkserver_preload(_FORKSERVER_PRELOAD)
        _forkserver_env = _rank_environment()
    return "forkserver" if _rank_environment() == _forkserver_env else "spawn"


def run_on_ranks(fn: Callable[..., Any], *args: Any, nproc: int = 4, plugin: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` gloo ranks; return the results by rank.

    ``fn`` must be a module-level function (it is pickled into the rank processes, forked from a
    forkserver or spawned: NOTE [ranks forked from a forkserver]).
    Raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``
    with each failed rank's traceback when a rank raises.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"test-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.05,
        start_method=_start_method(),
    )
    out = elastic_launch(config, _rank_entry)(fn, plugin, args)
    return [out[r] for r in range(nproc)]


# ---- one launch, several tests ----------------------------------------------------------
class RankPartError:
    """A part that raised on one rank: its traceback, as text (it crosses the process boundary)."""

    def __init__(self, text: str) -> None:
        self.text = text


def _run_parts(rank: int, world_size: int, parts: dict[str, Callable[..., Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in parts.items():
        torch._dynamo.reset()
        try:
            out[name] = fn(rank, world_size)
        except Exception:
            out[name] = RankPartError(traceback.format_exc())
    return out


class RankParts:
    """What :func:`run_parts_on_ranks` returns: ``parts[name]`` is that part's results by rank.

    Raises ``AssertionError`` with each failed rank's traceback when the part raised on a rank, so only
    the tests that read that part fail.
    """

    def __init__(self, by_rank: list[dict[str, Any]]) -> None:
        self.by_rank = by_rank

    def __getitem__(self, name: str) -> list[Any]:
        results = [r[name] for r in self.by_rank]
        failed = [f"rank {rank}:\n{r.text}" for rank, r in enumerate(results) if isinstance(r, RankPartError)]
        if failed:
            raise AssertionError(f"part {name!r} raised on the ranks:\n" + "\n".join(failed))
        return results


def run_parts_on_ranks(parts: dict[str, Callable[..., Any]], *, nproc: int = 4, plugin: bool = True) -> RankParts:
    """Run each ``fn(rank, world_size)`` of ``parts``, in order, in one launch of ``nproc`` gloo ranks.

    For a module-scoped fixture that several tests read: the ranks start (spawn, import torch, rendezvous)
    once instead of once per test.  Dynamo is reset before each part, and a part that raises on a rank is
    recorded (its traceback) and the next part runs; where it raised on some ranks only, the others may wait
    in a collective until the process group's timeout (120 s) and fail later parts too.  ``fn`` must be
    module-level or a ``functools.partial`` of one (it is pickled).
    """
    return RankParts(run_on_ranks(_run_parts, parts, nproc=nproc, plugin=plugin))


@contextlib.contextmanager
def _logged(logger_name: str, level: int, contains: str) -> Iterator[list[str]]:
    """The messages of ``logger_name`` at ``level`` or above that contain ``contains``, while the block runs."""
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if contains in record.getMessage():
                records.append(record.getMessage())

    logger = logging.getLogger(logger_name)
    handler, old_level = _Keep(level), logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def split_logs() -> contextlib.AbstractContextManager[list[str]]:
    """The block split's INFO lines that say how each graph was split (NOTE [blocks compiled once]), while the
    block runs: ``"blocks compiled once: N submodules, C compiled, R running an identical block's compile"``."""
    from dynamo_ext.blocks import split as block_split

    return _logged(block_split.__name__, logging.INFO, "submodules")


def stamp_logs() -> contextlib.AbstractContextManager[list[str]]:
    """The DEBUG lines of blocks stamped from an identical block's trace (NOTE [blocks traced once]), while the
    block runs: ``"L['fn'].layers.1 stamped from L['fn'].layers.0 (N nodes, G guards carried over)"``."""
    from dynamo_ext.blocks import trace_once

    return _logged(trace_once.__name__, logging.DEBUG, " stamped from ")


def graphs_seen_by(monkeypatch: Any, module: Any, name: str) -> list[Any]:
    """Weak references to each distinct FX graph passed to ``module.name`` (a per-frame table getter, e.g.
    ``trace_once._frame_recordings``) from now on: a test compiles, resets Dynamo, collects, and checks that every
    reference is dead (the table does not keep its graph alive)."""
    import weakref

    graphs: list[Any] = []
    original = getattr(module, name)

    def spy(graph: Any) -> Any:
        if not any(r() is graph for r in graphs):
            graphs.append(weakref.ref(graph))
        return original(graph)

    monkeypatch.setattr(module, name, spy)
    return graphs
