"""The program each rank runs: ``python -m dynamo_ext.audit.worker --out DIR --target T [--no-plugin] [--check-numerics] [-- ARGS]``.

Started by torch's launcher (``torch.distributed.run``), which sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` ... as for any torchrun program.  A script
target runs as ``__main__`` with ``sys.argv = [script, *ARGS]`` and sets up its
own process group, exactly as under torchrun; a ``module:function`` target is
called with no arguments after this worker has initialized the default group
(gloo on CPU, NCCL when CUDA is there).  Events go to ``DIR/rank<R>.jsonl`` as
they happen, so a rank that dies leaves what it saw.  With
``--check-numerics``, after the audited run (and outside the collection),
the target's ``make_step()`` is checked compiled against eager
(:mod:`.numerics`) and the result is one ``numerics`` event.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
import traceback
from typing import Any

from .collector import Collector, JsonlSink, dynamo_counters
from .identity import is_torch_file, normalize_path, target_root

EXIT_TARGET_FAILED = 1
EXIT_PLUGIN_FAILED = 3


def resolve_function(target: str) -> Any:
    """The function named by ``module:function`` (dots allowed after the colon)."""
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def is_function_target(target: str) -> bool:
    """``module:function`` rather than a script path."""
    import re

    return not os.path.exists(target) and re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", target) is not None


def root_of_target(target: str) -> str:
    """The root that identities are relative to (:func:`.identity.target_root`) for a script or ``module:function``.

    A ``module:function`` target's root is searched from its import root (the
    directory holding its top-level package), so ``pkg.sub.mod`` in a checkout
    gives the checkout.
    """
    if not is_function_target(target):
        return target_root(target)
    import importlib.util

    module = target.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = getattr(spec, "origin", None)
    if not origin or not os.path.exists(origin):
        return os.getcwd()
    base = os.path.dirname(os.path.abspath(origin))
    for _ in range(module.count(".") + (os.path.basename(origin) == "__init__.py")):
        base = os.path.dirname(base)
    return target_root(base)


def _error_event(exc: BaseException, root: str | None = None) -> dict[str, Any]:
    import re

    # Dynamo's errors name the traced user line under "from user code:"; the
    # Python traceback only reaches the frame Dynamo was compiling.
    text = str(exc)
    frames = [(f, int(n)) for f, n in re.findall(r'File "([^"]+)", line (\d+)', text.partition("from user code:")[2])]
    frames = frames or [(f.filename, f.lineno or 0) for f in traceback.extract_tb(exc.__traceback__)]
    where = next((f for f in reversed(frames) if not is_torch_file(f[0]) and f[0] != __file__), None)
    first = (text.strip().splitlines() or [""])[0]
    loc = f" (at {normalize_path(where[0], root=root)}:{where[1]})" if where else ""
    return {
        "ev": "error",
        "type": type(exc).__name__,
        "message": f"{type(exc).__name__}: {first}{loc}",
        "traceback": "".join(traceback.format_exception(exc)),
    }


def _run_function(target: str) -> None:
    _with_default_group(resolve_function(target))


def _with_default_group(fn: Any, *, store_prefix: str | None = None) -> Any:
    """``fn()`` with the default process group initialized (gloo on CPU, NCCL with CUDA) if it is not yet.

    ``store_prefix``: rendezvous through torchrun's store under this prefix.  A
    second ``init_process_group`` in a process whose first group was destroyed
    hangs on the store keys the first one left (torch 2.13, env://); a prefix
    gives it keys of its own.
    """
    import datetime

    import torch
    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if store_prefix is not None and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world,
                False,
                timeout=datetime.timedelta(seconds=300),
            )
            dist.init_process_group(backend, store=dist.PrefixStore(store_prefix, store), rank=rank, world_size=world)
        else:
            dist.init_process_group(backend)
        created = True
    try:
        return fn()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _run_script(path: str, args: list[str]) -> None:
    path = os.path.abspath(path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


def find_make_step(target: str) -> Any:
    """The target's ``make_step`` (see :mod:`.numerics`, NOTE [step protocol]).

    A ``module:function`` target's module attribute; for a script, its top-level
    ``make_step``, found by running the script under another ``__name__`` (its
    ``if __name__ == "__main__":`` block does not run again).

    Raises:
        LookupError: the target defines no ``make_step``.
    """
    if is_function_target(target):
        found = getattr(importlib.import_module(target.partition(":")[0]), "make_step", None)
    else:
        found = runpy.run_path(os.path.abspath(target), run_name="__dynamo_ext_audit_step__").get("make_step")
    if not callable(found):
        raise LookupError(
            f"--check-numerics: target {target!r} defines no make_step() returning (model, optimizer, step); "
            "see docs/audit.md, 'Numerics check'"
        )
    return found


def _check_numerics(target: str, rtol: float | None, atol: float | None) -> dict[str, Any]:
    import torch

    from .numerics import as_step, check_step

    make_step = find_make_step(target)
    # A fresh Dynamo: the audited run's cache entries belong to other module instances.
    torch._dynamo.reset()
    from .comm_merge import eager_counted_step

    eager_comm: dict[str, dict[str, int]] = {}

    def run() -> dict[str, Any]:
        # The eager step's collectives, counted by CommDebugMode, check the communication report's counts.
        spec, counts = eager_counted_step(as_step(make_step()))
        result = check_step(spec, rtol=rtol, atol=atol)
        eager_comm.update(counts)
        return result

    result = _with_default_group(run, store_prefix="dynamo_ext_audit_numerics/")
    return {"ev": "numerics", **result, "eager_comm": eager_comm}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    target_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, target_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m dynamo_ext.audit.worker")
    p.add_argument("--out", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--plugin", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--check-numerics", action="store_true")
    p.add_argument("--rtol", type=float, default=None)
    p.add_argument("--atol", type=float, default=None)
    ns = p.parse_args(argv)

    import torch

    import dynamo_ext

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = int(os.environ.get("RANK", "0"))
    sink = JsonlSink(os.path.join(ns.out, f"rank{rank}.jsonl"))
    root = root_of_target(ns.target)
    collector = Collector(sink, root=root)
    plugin: dict[str, Any] = {"installed": False, "version": dynamo_ext.__version__, "error": ""}
    install_error: BaseException | None = None
    if ns.plugin:
        try:
            dynamo_ext.install()
            plugin["installed"] = True
        except Exception as e:
            install_error = e
            plugin["error"] = f"dynamo_ext.install() failed: {type(e).__name__}: {e}"
    collector.record(
        {
            "ev": "start",
            "rank": rank,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "pid": os.getpid(),
            "torch_version": torch.__version__,
            "plugin": plugin,
            "target": ns.target,
        }
    )
    if install_error is not None:
        ev = _error_event(install_error)
        ev["message"] = plugin["error"]
        collector.record(ev)
        sink.close()
        return EXIT_PLUGIN_FAILED

    status = 0
    collector.start()
    try:
        if is_function_target(ns.target):
            _run_function(ns.target)
        else:
            _run_script(ns.target, target_args)
    except SystemExit as e:
        if e.code not in (None, 0):
            collector.record(
                {"ev": "error", "type": "SystemExit", "message": f"target exited with status {e.code}", "traceback": ""}
            )
            status = EXIT_TARGET_FAILED
    except BaseException as e:  # the report says what the target raised
        collector.record(_error_event(e, root))
        traceback.print_exc()
        status = EXIT_TARGET_FAILED
    finally:
        collector.stop()
        counters = {**dynamo_counters(), "graph_break_missed": collector.dynamo_missed()}
        collector.record({"ev": "end", "counters": counters, "status": status})
    if status == 0 and ns.check_numerics:
        try:
            collector.record(_check_numerics(ns.target, ns.rtol, ns.atol))
        except BaseException as e:  # reported; the rank fails
            ev = _error_event(e, root)
            ev["message"] = f"numerics check: {ev['message']}"
            collector.record(ev)
            traceback.print_exc()
            status = EXIT_TARGET_FAILED
    sink.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
