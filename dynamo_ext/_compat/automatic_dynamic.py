"""Dynamo's automatic-dynamic bookkeeping of a frame (``torch._dynamo.pgo``): the value it last saw under each
source name, by which a value that changed between compiles is made dynamic.  Stamping a block reads and adds
to it as tracing the block would (NOTE [a stamp keeps Dynamo's automatic dynamic] in
``dynamo_ext/blocks/trace_record.py``).

``VariableBuilder`` records each int and float it wraps (``process_automatic_dynamic`` with a
``FrameStateSizeEntry.make_scalar``) in ``variables/builder.py``; the same names on 2.11 to 2.15
(:func:`automatic_dynamic_supported` probes them).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from torch._dynamo import pgo as _pgo
from torch._dynamo.variables import builder as _builder

__all__ = [
    "ScalarSeen",
    "automatic_dynamic_supported",
    "install_scalar_log",
    "note_scalar",
    "python_scalar_input",
    "recording_translator",
    "scalar_log",
]


@dataclasses.dataclass(frozen=True)
class ScalarSeen:
    """One int or float ``VariableBuilder`` recorded for automatic dynamic: its source name, whether it is an
    attribute of a user module (Dynamo logs it otherwise), whether the record made it dynamic, and the code and
    closure of the translator it was recorded under (the record is kept per code: ``CodeId``; a value wrapped
    lazily is recorded under the frame's root translator, which realizes it)."""

    name: str
    unspecialized_nn_module: bool
    dynamic: bool
    code: Any
    closure: Any


def automatic_dynamic_supported() -> bool:
    """Whether this release records scalars for automatic dynamic as :func:`install_scalar_log` expects:
    ``process_automatic_dynamic`` called through ``variables/builder.py``'s global, ``make_scalar`` and the
    ``auto_dynamic`` token."""
    return (
        callable(getattr(_builder, "process_automatic_dynamic", None))
        and callable(getattr(_pgo, "process_automatic_dynamic", None))
        and callable(getattr(getattr(_pgo, "FrameStateSizeEntry", None), "make_scalar", None))
        and hasattr(_pgo, "auto_dynamic")
    )


_LOGS: list[list[ScalarSeen]] = []


def install_scalar_log(patches: Any) -> None:
    """Log the scalars ``VariableBuilder`` records for automatic dynamic while a :func:`scalar_log` block is
    open (``variables/builder.py``'s ``process_automatic_dynamic`` wrapped, undone by ``patches``)."""
    process = _builder.process_automatic_dynamic  # pyright: ignore[reportPrivateImportUsage]  (builder's global)

    def logged(tx: Any, name: str, entry: Any, **kwargs: Any) -> Any:
        out = process(tx, name, entry, **kwargs)
        if _LOGS and _is_scalar(entry):
            unspec = bool(kwargs.get("is_unspecialized_nn_module", False))
            dynamic = out.scalar is _pgo.auto_dynamic
            _LOGS[-1].append(ScalarSeen(name, unspec, dynamic, tx.f_code, getattr(tx, "closure", None)))
        return out

    patches.setattr(_builder, "process_automatic_dynamic", logged)


def _is_scalar(entry: Any) -> bool:
    return entry.scalar is not _pgo.auto_unset and entry.size is _pgo.auto_dynamic


@contextlib.contextmanager
def scalar_log() -> Any:
    """A list of the :class:`ScalarSeen` that :func:`install_scalar_log` logs while the block runs."""
    found: list[ScalarSeen] = []
    _LOGS.append(found)
    try:
        yield found
    finally:
        _LOGS.pop()


def recording_translator(tx: Any, seen: ScalarSeen) -> Any:
    """The translator among ``tx`` and those it is inlined in whose code and closure ``seen`` was recorded
    under; None where there is none (it was recorded under a function inlined below ``tx``)."""
    t = tx
    while t is not None:
        if t.f_code is seen.code and getattr(t, "closure", None) is seen.closure:
            return t
        t = getattr(t, "parent", None)
    return None


def note_scalar(tx: Any, name: str, value: Any, *, unspecialized_nn_module: bool) -> bool:
    """Record ``value`` under ``name`` in the automatic-dynamic state of ``tx``'s code as ``VariableBuilder``
    records an int or float it wraps (compiler collectives' exchange included); whether Dynamo now makes it
    dynamic."""
    entry = _pgo.FrameStateSizeEntry.make_scalar(value)
    process = _builder.process_automatic_dynamic  # pyright: ignore[reportPrivateImportUsage]  (builder's global)
    out = process(tx, name, entry, is_unspecialized_nn_module=unspecialized_nn_module)
    return out.scalar is _pgo.auto_dynamic


def python_scalar_input(grapharg: Any) -> bool:
    """Whether a graph input's ``GraphArg`` is a Python int or float Dynamo passes as a tensor: a float it made
    dynamic (``wrap_symfloat``: a 0-d float64 tensor the graph reads back with ``item()``)."""
    return bool(getattr(grapharg, "pass_arg_as_tensor", False))
