"""The program each rank runs: ``python -m dynamo_ext.audit.worker --out DIR --target T [--no-plugin] [-- ARGS]``.

Started by torch's launcher (``torch.distributed.run``), which sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` ... as for any torchrun program.  A script
target runs as ``__main__`` with ``sys.argv = [script, *ARGS]`` and sets up its
own process group, exactly as under torchrun; a ``module:function`` target is
called with no arguments after this worker has initialized the default group
(gloo on CPU, NCCL when CUDA is there).  Events go to ``DIR/rank<R>.jsonl`` as
they happen, so a rank that dies leaves what it saw.
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
    import torch
    import torch.distributed as dist

    fn = resolve_function(target)
    created = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        created = True
    try:
        fn()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _run_script(path: str, args: list[str]) -> None:
    path = os.path.abspath(path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


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
        sink.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
