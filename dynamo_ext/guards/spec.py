"""A guard is a pair of pure functions plus an installer.

``extract(value) -> meta`` reads, once at compile time, what the compiled code
depends on; ``describe(old_meta, new_meta) -> str | None`` compares two such
records and says the difference in words (``None`` when they match).  Both are
plain functions, unit-tested without Dynamo.  :func:`install_spec_guard`
attaches the pair to a Dynamo source as a lambda guard.

Shape of the check (see NOTE [guard fast path]): ``value is expected`` passes at
once; otherwise the value's record is extracted and compared.  So a call with
the very same object costs one identity test, a call with an equal object does
not recompile, and a call with a different one fails with a reason in words.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any

from .. import _compat

# NOTE [guard fast path]
# Guards run on every call of a compiled function.  Identity first keeps the
# common case (a module's own mesh, the same placement constant) to one `is`.
# The reason a guard failed is stored here by the check itself, so the
# recompile message (guards/reasons.py) can say what changed.
# NOTE [guards hold objects weakly]
# A check keeps only a weak reference to the object it was traced with (for
# the identity fast path) and the extracted record, which holds no distributed
# object: a compiled function must not keep a destroyed process group or mesh
# alive.  FAILURES keeps the newest MAX_FAILURES reasons (a reason is read right
# after its guard failed), so a long-running program that recompiles often does
# not grow it without bound.
MAX_FAILURES = 1024


class _BoundedFailures(collections.OrderedDict):
    """A dict that keeps its newest ``MAX_FAILURES`` entries (assignment refreshes an entry)."""

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > MAX_FAILURES:
            self.popitem(last=False)


FAILURES: dict[str, str] = _BoundedFailures()
_keys = itertools.count()


@dataclasses.dataclass(frozen=True)
class GuardSpec:
    """What one kind of distributed object is guarded on.

    Attributes:
        kind: a word for messages ("mesh", "placement", ...).
        extract: ``value -> meta``; must not raise for any Python object
            (return a record that differs from every valid one instead).
        describe: ``(expected_meta, actual_meta) -> str | None``.
        identity_fast_path: pass at once when the value is the very object
            traced with; off for objects whose guarded settings can change in
            place (an FSDP2 state).
        on_source: ``(source, value) -> None``, called when a stamped block's
            guard of this kind is installed for a source no trace reached
            (NOTE [a block's guards carried over]), for bookkeeping a trace of
            the object would do.
    """

    kind: str
    extract: Callable[[Any], Any]
    describe: Callable[[Any, Any], str | None]
    identity_fast_path: bool = True
    on_source: Callable[[Any, Any], None] | None = None


def marker(key: str) -> str:
    """The verbose code part Dynamo prints for a failed guard; replaced by the reason."""
    return f"__dynamo_ext_guard_{key}"


def make_checker(spec: GuardSpec, obj: Any, key: str, label: str = "") -> Callable[[Any], bool]:
    """A guard check function for ``obj``: True while the value still matches it.

    ``label`` (the source's name, e.g. ``L['mesh']``) prefixes the failure reason.
    """
    prefix = f"{label}: " if label else ""
    meta = spec.extract(obj)
    traced = _reference(obj) if spec.identity_fast_path else None
    del obj  # NOTE [guards hold objects weakly]

    def check(value: Any) -> bool:
        if traced is not None and value is not None and value is traced():
            return True
        actual = spec.extract(value)
        if actual == meta:
            return True
        FAILURES[key] = prefix + (spec.describe(meta, actual) or f"{spec.kind} changed")
        return False

    return check


def _reference(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj``; a strong one only for objects that take no weak reference.

    Process groups and meshes take weak references; the strong fallback is for
    small immutable values (placements), which hold no resource.
    """
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


@functools.cache
def _guard_fn(spec: GuardSpec) -> Callable[[Any, Any], None]:
    # One function per spec, so Dynamo deduplicates guards on the same source.
    def create(builder: Any, guard: Any) -> None:
        key = str(next(_keys))
        check = make_checker(spec, builder.get(guard), key, guard.name)
        _compat.lambda_guard(builder, guard, check, marker(key))

    create.__name__ = f"DYNAMO_EXT_{spec.kind.upper().replace(' ', '_')}_MATCH"
    create.guard_spec = spec  # type: ignore[attr-defined]  # read when a block's guards are carried over
    return create


def install_spec_guard(source: Any, spec: GuardSpec) -> None:
    """Guard ``source`` (a Dynamo ``Source``) with ``spec``.  No-op for constant sources."""
    if source is None:
        return
    try:
        guard = source.make_guard(_guard_fn(spec))
    except NotImplementedError:  # constant source: nothing to guard
        return
    _compat.install_guard(guard)
