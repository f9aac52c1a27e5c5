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
