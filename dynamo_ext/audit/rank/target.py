"""The target a rank runs (a script or ``module:function``) and the rank's place in the job."""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import MutableMapping
from typing import Any

from .identity import target_root


def rank_identity(environ: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """This process's place in the job, from the launcher's environment variables.

    torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK``
    (the node rank) first; when ``RANK`` is absent, SLURM's
    ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``/``SLURM_NODEID``
    (``SLURM_NTASKS_PER_NODE`` for the local world size), which are then exported
    into ``environ`` as ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``
    and ``GROUP_RANK`` so the target's ``init_process_group()`` finds them.  Neither:
    one process, rank 0 of 1.

    Returns:
        ``{"rank", "world_size", "local_rank", "local_world_size", "node_rank", "host", "launcher"}``;
        ``local_world_size``/``node_rank`` are ``None`` when the launcher does not say.

    Raises:
        ValueError: a variable is not an integer, or the rank is outside ``[0, world size)``.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    elif "SLURM_PROCID" in env:
        launcher = "slurm"
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID")
    else:
        launcher = "none"
        names = ()

    def num(name: str | None, default: int | None) -> int | None:
        if name is None or env.get(name) in (None, ""):
            return default
        value = env[name]
        if name == "SLURM_NTASKS_PER_NODE":  # "4" or "4(x2)" or "4,2": only a single count is one size
            value = value.split("(")[0] if "," not in value else ""
            if not value:
                return None
        try:
            return int(value)
        except ValueError:
            raise ValueError(
                f"environment variable {name}={env[name]!r} is not an integer; the launcher sets it to this "
                "process's place in the job (unset it, or start the job with torchrun or srun)"
            ) from None

    rank = num(names[0] if names else None, 0) or 0
    world = num(names[1] if names else None, 1) or 1
    local = num(names[2] if names else None, rank if launcher == "none" else 0)
    identity = {
        "rank": rank,
        "world_size": world,
        "local_rank": local,
        "local_world_size": num(names[3] if names else None, None),
        "node_rank": num(names[4] if names else None, None),
        "host": socket.gethostname(),
        "launcher": launcher,
    }
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the world of {world} ranks ({', '.join(names[:2])})")
    if launcher == "slurm":
        for key, field in (
            ("RANK", "rank"),
            ("WORLD_SIZE", "world_size"),
            ("LOCAL_RANK", "local_rank"),
            ("LOCAL_WORLD_SIZE", "local_world_size"),
            ("GROUP_RANK", "node_rank"),
        ):
            if identity[field] is not None:
                env.setdefault(key, str(identity[field]))
    return identity


def resolve_function(target: str) -> Any:
    """The function named by ``module:function`` or ``script.py:function`` (dots allowed after the colon).

    A script's functions are read by running it under another ``__name__`` than ``"__main__"`` (its
    ``if __name__ == "__main__":`` block does not run), with its directory first on ``sys.path``, as when
    it runs as a script.
    """
    script = script_function(target)
    obj: Any
    if script is not None:
        first, _, rest = script[1].partition(".")
        if first not in (names := script_globals(script[0])):
            raise AttributeError(f"script {script[0]!r} defines no {first!r}")
        obj = names[first]
        parts = rest.split(".") if rest else []
    else:
        module_name, _, attr = target.partition(":")
        obj = importlib.import_module(module_name)
        parts = attr.split(".")
    for part in parts:
        obj = getattr(obj, part)
    return obj


SCRIPT_MODULE_NAME = "__dynamo_ext_audit_step__"  # the ``__name__`` a script runs under when its functions are read


def script_globals(path: str) -> dict[str, Any]:
    """The globals of the script ``path`` run under :data:`SCRIPT_MODULE_NAME` (its ``__main__`` block does not run),
    its directory first on ``sys.path`` as when it runs as a script."""
    import runpy
    import sys

    path = os.path.abspath(path)
    if os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))
    return runpy.run_path(path, run_name=SCRIPT_MODULE_NAME)


def script_function(target: str) -> tuple[str, str] | None:
    """``(script path, function)`` of a ``script.py:function`` target (the script exists); else ``None``."""
    import re

    path, sep, attr = target.rpartition(":")
    if not sep or not path.endswith(".py") or not os.path.isfile(path):
        return None
    return (path, attr) if re.fullmatch(r"[A-Za-z_][\w.]*", attr) else None


def script_defines(path: str, name: str) -> str | None:
    """Why ``path`` defines no top-level ``name`` (the script is read, not run), or ``None``."""
    import ast

    try:
        tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    except (OSError, SyntaxError) as e:
        return f"cannot read the script {path!r} of target {path}:{name}: {type(e).__name__}: {e}"
    first = name.split(".")[0]
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    if first not in defined:
        return f"script {path!r} defines no {first!r} at its top level (target {path}:{name})"
    return None


def is_function_target(target: str) -> bool:
    """``module:function`` or ``script.py:function`` rather than a script path."""
    import re

    if script_function(target) is not None:
        return True
    return not os.path.exists(target) and re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", target) is not None


def root_of_target(target: str) -> str:
    """The root that identities are relative to (:func:`.identity.target_root`) for a script or ``module:function``.

    A ``module:function`` target's root is searched from its import root (the
    directory holding its top-level package), so ``pkg.sub.mod`` in a checkout
    gives the checkout.
    """
    if not is_function_target(target):
        return target_root(target)
    script = script_function(target)
    if script is not None:
        return target_root(script[0])
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


def run_script(path: str, args: list[str]) -> None:
    """Run the script ``path`` as ``__main__`` with ``sys.argv = [path, *args]``, its directory first on ``sys.path``."""
    import runpy
    import sys

    path = os.path.abspath(path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


def find_make_step(target: str) -> Any:
    """The target's ``make_step`` (see :mod:`.numerics`, NOTE [step protocol]).

    A ``module:function`` target's module attribute; for a script (or ``script.py:function``), its top-level
    ``make_step``, found by running the script under another ``__name__`` (its ``if __name__ == "__main__":``
    block does not run again).

    Raises:
        LookupError: the target defines no ``make_step``.
    """
    script = script_function(target)
    if script is not None or not is_function_target(target):
        found = script_globals(script[0] if script else target).get("make_step")
    else:
        found = getattr(importlib.import_module(target.partition(":")[0]), "make_step", None)
    if not callable(found):
        raise LookupError(
            f"--check-numerics: target {target!r} defines no make_step() returning (model, optimizer, step); "
            "see docs/audit.md, 'Numerics check'"
        )
    return found
