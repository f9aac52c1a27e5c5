"""The program each rank runs: ``python -m dynamo_ext.audit.collect --out DIR [--no-plugin] [--check-numerics] TARGET [-- ARGS]``.

It runs under whatever started the job: ``dynamo-ext audit`` (which starts it
with torch's launcher on the local machine), ``torchrun --nnodes ...``, or
``srun``.  The rank comes from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (torchrun,
any launcher that follows it) or, when those are absent, from
``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` (exported as ``RANK`` ... so
``init_process_group()`` finds them; ``MASTER_ADDR``/``MASTER_PORT`` must be set
by the job script, as for any srun-started torch program).  A script target runs
as ``__main__`` with ``sys.argv = [script, *ARGS]`` and sets up its own process
group, exactly as without the audit; a ``module:function`` target is called
with no arguments after the default group is initialized here (gloo on CPU,
NCCL when CUDA is there).

Each rank writes ``DIR/rank<R>.jsonl`` (NOTE [rank file]) as events happen, so a
rank that dies leaves what it saw.  A function TARGET that returns a step is
trained ``--steps`` steps by the audit (NOTE [the audit drives the step] in
:mod:`.steps`).  With ``--check-numerics``, after the audited run (and outside
the collection), those steps are run eagerly from their saved states; else the
target's ``make_step()`` is checked compiled against eager (:mod:`.numerics`);
the result is one ``numerics`` event.  A target whose run called ``check_step``
itself has those results reported instead (NOTE [the target's own check]).  ``dynamo-ext audit merge DIR`` (:mod:`..merge.rank_files`) reads
the directory back.

NOTE [rank file]
JSON Lines, one event per line, flushed each time.  The first line is the
header (``"ev": "start"``: the format version (NOTE [rank-file format] in
``schema/events.py``), rank, world size, local rank, local world size,
node rank, host, pid, launcher, torch and plugin versions, target, start
time); then ``break``/``compile``/``error``/``numerics``/``internal`` events
(:mod:`.collector`); the last is ``"ev": "end"`` with the exit status and the
end time.  A file without its ``end`` line was cut short: the rank was killed
(SIGKILL, out of memory, a node lost) before it could finish.  SIGTERM (what
launchers send the surviving ranks when one fails) still gives a complete
file: a watcher thread woken by the signal (``signal.set_wakeup_fd``, which
works while the main thread is blocked inside a collective) writes an
``error`` (type ``Terminated``) and the ``end`` line with status 143, then
ends the process at once, as SIGTERM would have.  SIGUSR1 adds a ``stack``
event (where the main thread is) and the rank goes on.  A target that
installs its own handler for either signal keeps it (the watcher then does
nothing for that signal).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from ..schema.events import FORMAT_VERSION, End, Error, EventKind, Start, to_dict
from .blocks import audit_blocks
from .collector import Collector, JsonlSink, dynamo_counters
from .identity import is_torch_file, normalize_path, user_frame_index
from .steps import DEFAULT_STEPS, OptimizerSteps
from .target import find_make_step, is_function_target, rank_identity, resolve_function, root_of_target, run_script
from .waits import compiled_waits

log = logging.getLogger(__name__)

# This module and the ``python -m dynamo_ext.audit.collect`` entry that runs it: never the user's frames.
_OWN_FILES = frozenset({__file__, os.path.join(os.path.dirname(os.path.dirname(__file__)), "collect.py")})
EXIT_TARGET_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_PLUGIN_FAILED = 3
EXIT_TERMINATED = 128 + int(signal.SIGTERM)


class _SignalWatch:
    """A thread woken by signals through ``signal.set_wakeup_fd`` (it runs while the main thread is blocked in C).

    SIGTERM: ``on_term()`` (writes the last records), then exit 143 at once
    (NOTE [rank file]).  SIGUSR1: ``on_stack(frame)`` with the main thread's
    current frame (the launcher asks a rank that has not finished where it is,
    NOTE [hung rank] in :mod:`..launch`); the rank goes on.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, on_term: Any, on_stack: Any) -> None:
        self.on_term = on_term
        self.on_stack = on_stack
        self.active = False
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            return
        if previous_fd != -1:  # someone else (asyncio) listens there: leave the signals as they are
            signal.set_wakeup_fd(previous_fd)
            return
        self._read, self._write = r, w
        self._main = threading.main_thread().ident
        self._once = threading.Lock()
        # A Python handler makes C write the signal number to the fd; it also runs in the main thread once that
        # thread runs Python again, which covers SIGTERM if someone (asyncio) takes the wakeup fd later.
        self._handler = self._on_signal
        self._previous = {sig: signal.signal(sig, self._handler) for sig in self.SIGNALS}
        self.active = True
        threading.Thread(target=self._run, name="dynamo-ext-audit-signals", daemon=True).start()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM:
            # Not here: the main thread may be inside Collector.record, holding its lock.
            threading.Thread(target=self._terminate, daemon=True).start()

    def _terminate(self) -> None:
        if not self._once.acquire(blocking=False):
            return  # the other thread is writing the last records and will exit
        try:
            self.on_term()
        finally:
            os._exit(EXIT_TERMINATED)

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:
                return
            if int(signal.SIGUSR1) in data and signal.getsignal(signal.SIGUSR1) is self._handler:
                frame = sys._current_frames().get(self._main) if self._main is not None else None
                if frame is not None:
                    self.on_stack(frame)
            if int(signal.SIGTERM) in data and signal.getsignal(signal.SIGTERM) is self._handler:
                self._terminate()

    def close(self) -> None:
        if self.active and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) is self._handler:
                    signal.signal(sig, previous)
            os.close(self._write)
            self.active = False


def stack_event(frame: Any, root: str | None) -> dict[str, Any]:
    """A ``stack`` event: where the main thread is (outermost first), the user's line, and whether it waits in
    torch.distributed (a collective, a barrier, a store)."""
    frames = [
        [normalize_path(f.filename, root=root), f.lineno or 0, f.name, (f.line or "").strip()]
        for f in traceback.extract_stack(frame)
        if f.filename not in _OWN_FILES and not f.filename.endswith(("runpy.py", "<frozen runpy>"))
    ]
    files = [f[0] for f in frames]
    from ...collective_check import stream

    # NOTE [where each rank waits]: inside a checked compiled graph, or in the check's own wait on its peers
    collectives = stream.in_flight()
    in_graph = any(f.endswith("collective_check/stream.py") for f in files) and any(c["in_graph"] for c in collectives)
    in_check = any(f.endswith("collective_check/exchange.py") for f in files)
    return {
        "ev": EventKind.STACK,
        "stack": frames,
        "user_index": user_frame_index(files) if frames else 0,
        "in_distributed": any(f.startswith("torch/distributed/") for f in files) or in_graph or in_check,
        "collectives": collectives,
        "in_compiled_collective": in_graph and not in_check,
        "waiting": compiled_waits(files),  # NOTE [the collective a rank waits in]
    }


def _error_event(exc: BaseException, root: str | None = None) -> dict[str, Any]:
    import re

    # Dynamo's errors name the traced user line under "from user code:"; the
    # Python traceback only reaches the frame Dynamo was compiling.
    text = str(exc)
    frames = [(f, int(n)) for f, n in re.findall(r'File "([^"]+)", line (\d+)', text.partition("from user code:")[2])]
    frames = frames or [(f.filename, f.lineno or 0) for f in traceback.extract_tb(exc.__traceback__)]
    where = next((f for f in reversed(frames) if not is_torch_file(f[0]) and f[0] not in _OWN_FILES), None)
    first = (text.strip().splitlines() or [""])[0]
    loc = f" (at {normalize_path(where[0], root=root)}:{where[1]})" if where else ""
    return to_dict(
        Error(
            type=type(exc).__name__,
            message=f"{type(exc).__name__}: {first}{loc}",
            traceback="".join(traceback.format_exception(exc)),
        )
    )


def _run_function(target: str, steps: int, collector: Collector, own: Any, *, keep: bool) -> Any:
    """Call the target's function; one that returns a step is trained ``steps`` steps (NOTE [the audit drives
    the step] in :mod:`.steps`): returns :class:`.steps.Trained` then (kept for the numerics check with ``keep``),
    else ``None``.  Steps the call itself takes are counted by its optimizer (``own``, :class:`.steps.OptimizerSteps`)."""
    from .numerics import as_step, is_step
    from .steps import train

    with own:
        result = resolve_function(target)()
    if not is_step(result):
        return None
    log.info("audit: %s returned a step: training it %d step(s)", target, steps)
    return train(as_step(result), steps, collector, keep=keep, first=own.finished + 1)


@contextlib.contextmanager
def _default_group(*, store_prefix: str | None = None) -> Any:
    """The default process group initialized (gloo on CPU, NCCL with CUDA) within the block, if it is not yet.

    ``store_prefix``: rendezvous through torchrun's store under this prefix.  A
    second ``init_process_group`` in a process whose first group was destroyed
    hangs on the store keys the first one left (torch 2.13, env://); a prefix
    gives it keys of its own.
    """
    import datetime

    import torch
    import torch.distributed as dist

    from ... import _compat

    created = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if store_prefix is not None and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = _compat.tcp_store(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world,
                is_master=False,
                timeout=datetime.timedelta(seconds=300),
            )
            dist.init_process_group(
                backend, store=_compat.prefix_store(store_prefix, store), rank=rank, world_size=world
            )
        else:
            dist.init_process_group(backend)
        created = True
    try:
        yield
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _check_numerics(
    target: str, rtol: float | None, atol: float | None, observed: list[dict], trained: Any
) -> dict[str, Any]:
    """The ``numerics`` event: the steps the audit trained (``trained``, :func:`.steps.check`), else the target's
    own checks when it ran any (``observed``), else ``make_step()``'s (built again: the target's run is over)."""
    import torch

    from .numerics import as_step, check_step, combine

    if trained is not None:  # NOTE [the audit drives the step]: the same build, from the state saved before step 1
        from .steps import check

        return {"ev": EventKind.NUMERICS, **check(trained, rtol, atol)}
    if observed:  # NOTE [the target's own check]
        log.info("numerics: %d check_step call(s) of the audited run reported; make_step() not run", len(observed))
        return {"ev": EventKind.NUMERICS, **combine(observed)}
    make_step = find_make_step(target)
    # A fresh Dynamo: the audited run's cache entries belong to other module instances.
    torch._dynamo.reset()
    from .eager_comm import eager_counted_step

    eager_comm: dict[str, Any] = {}

    def run() -> dict[str, Any]:
        try:
            built = make_step()
        except Exception as e:  # a trainer that cannot be built twice in one process (torchtitan's fully_shard)
            raise RuntimeError(
                f"building make_step() again after the target's run failed: {type(e).__name__}: {e}; to build it "
                f"once, audit {target.partition(':')[0]}:make_step (the audit then trains the step itself)"
            ) from e
        # The eager step's collectives, counted by CommDebugMode, check the communication report's counts.
        spec, counts = eager_counted_step(as_step(built))
        result = check_step(spec, rtol=rtol, atol=atol)
        eager_comm.update(counts)
        return result

    with _default_group(store_prefix="dynamo_ext_audit_numerics/"):
        result = run()
    return {"ev": EventKind.NUMERICS, **result, "eager_comm": eager_comm}


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    target_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, target_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m dynamo_ext.audit.collect",
        description="Run TARGET as this rank of a job (under torchrun, srun, or dynamo-ext audit) and write what "
        "torch.compile did to DIR/rank<R>.jsonl; then: dynamo-ext audit merge DIR.",
        epilog="TARGET is a script path, module:function or script.py:function (a function returning a step is "
        "trained --steps steps); arguments after -- go to the target.",
    )
    p.add_argument("target", metavar="TARGET")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the rank files (shared by all nodes)")
    p.add_argument("--plugin", action=argparse.BooleanOptionalAction, default=True, help="install dynamo-ext")
    p.add_argument("--check-numerics", action="store_true", help="also check the target's make_step() (docs/audit.md)")
    p.add_argument("--rtol", type=float, default=None)
    p.add_argument("--atol", type=float, default=None)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps of a target's make_step()")
    return p.parse_args(argv), target_args


def main(argv: list[str] | None = None) -> int:
    """Run one rank; the exit status is the target's outcome (NOTE [rank file] has what is written)."""
    ns, target_args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        identity = rank_identity()
    except ValueError as e:
        print(f"dynamo_ext.audit.collect: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    import torch

    import dynamo_ext
    from dynamo_ext import config as dynamo_ext_config

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = identity["rank"]
    os.makedirs(ns.out, exist_ok=True)
    path = os.path.join(ns.out, f"rank{rank}.jsonl")
    if os.path.exists(path):
        os.remove(path)  # a rerun into the same directory replaces this rank's file
    sink = JsonlSink(path)
    root = root_of_target(ns.target)
    collector = Collector(sink, root=root)
    plugin: dict[str, Any] = {"installed": False, "version": dynamo_ext.__version__, "error": ""}
    install_error: BaseException | None = None
    if ns.plugin:
        try:
            dynamo_ext.install()
            plugin["installed"] = True
            plugin["blocks"] = audit_blocks()
            dynamo_ext_config.reuse_block_compiles = False  # NOTE [the audit compiles each block]
            log.info("audit: dynamo_ext.config.reuse_block_compiles off, every block compiled")
        except Exception as e:
            install_error = e
            plugin["error"] = f"dynamo_ext.install() failed: {type(e).__name__}: {e}"
    collector.record(
        to_dict(
            Start(
                format_version=FORMAT_VERSION,
                **identity,
                pid=os.getpid(),
                torch_version=torch.__version__,
                plugin=plugin,
                target=ns.target,
                time=time.time(),
            )
        )
    )
    if install_error is not None:
        ev = _error_event(install_error)
        ev["message"] = plugin["error"]
        collector.record(ev)
        collector.record(to_dict(End(counters={}, status=EXIT_PLUGIN_FAILED)))
        sink.close()
        return EXIT_PLUGIN_FAILED

    status = 0

    def on_term() -> None:
        collector.record(
            to_dict(Error(type="Terminated", message="terminated by SIGTERM (the launcher stopped the job)"))
        )
        collector.record(to_dict(End(counters={}, status=EXIT_TERMINATED)))

    watch = _SignalWatch(on_term, lambda frame: collector.record(stack_event(frame, root)))
    observed: list[dict[str, Any]] = []
    observing = contextlib.ExitStack()
    if ns.check_numerics and ns.rtol is None:  # explicit tolerances: make_step() is checked with them
        from .numerics import observe_checks

        observing.enter_context(observe_checks(observed.append))
    collector.start()
    from ...collective_check import stream

    stream.track_positions(True)  # NOTE [where each rank waits]
    trained = None
    own = OptimizerSteps(collector)  # the target's own training steps, by its optimizer
    group = contextlib.ExitStack()  # a function target's default group, kept until the numerics check is done
    try:
        if is_function_target(ns.target):
            group.enter_context(_default_group())
            trained = _run_function(ns.target, ns.steps, collector, own, keep=ns.check_numerics)
        else:
            with own:
                run_script(ns.target, target_args)
    except SystemExit as e:
        if e.code not in (None, 0):
            collector.record(to_dict(Error(type="SystemExit", message=f"target exited with status {e.code}")))
            status = EXIT_TARGET_FAILED
    except BaseException as e:  # the report says what the target raised
        collector.record(_error_event(e, root))
        traceback.print_exc()
        status = EXIT_TARGET_FAILED
    finally:
        observing.close()
        collector.stop()
        counters = {**dynamo_counters(), "graph_break_missed": collector.dynamo_missed()}
        steps = collector.step if trained is not None else own.finished
        if status or not ns.check_numerics:
            collector.record(to_dict(End(counters=counters, status=status, steps=steps)))
    if status == 0 and ns.check_numerics:
        try:
            collector.record(_check_numerics(ns.target, ns.rtol, ns.atol, observed, trained))
        except BaseException as e:  # reported; the rank fails
            ev = _error_event(e, root)
            ev["message"] = f"numerics check: {ev['message']}"
            collector.record(ev)
            traceback.print_exc()
            status = EXIT_TARGET_FAILED
        collector.record(to_dict(End(counters=counters, status=status, steps=steps)))
    try:
        group.close()
    except Exception:  # the group's teardown after the run: logged, the run's outcome stands
        log.warning("destroying the default process group failed", exc_info=True)
    watch.close()
    sink.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
