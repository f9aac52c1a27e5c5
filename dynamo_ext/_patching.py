"""Every monkeypatch dynamo-ext makes goes through :data:`PATCHES`.

``install()`` records each change here and ``uninstall()`` undoes them in
reverse order, so the patched objects end up exactly as they were (attributes
that did not exist are deleted again, dict entries that did not exist are
popped).  Nothing else in the package may assign to a torch attribute.

NOTE [patches made after ours]
An attribute or entry is restored only while it still holds the value we set.
When another library (or the user) patched it after ``install()``, ``uninstall()``
leaves their value in place and logs a warning naming the attribute: restoring
ours-before-theirs would silently drop their patch.  If their patch wraps ours,
our function stays reachable through it until they undo theirs (uninstall
cannot unlink it; the trackers behind the builder hooks are gone, since the
registry is cleared, but a wrapped guard builder still builds our guard): the
warning says which attribute.  An attribute found on the class of
an instance (not in the instance's ``__dict__``) or inherited by a class from a
base class is deleted again on undo, so the class attribute shows through, as
before, rather than a copy of it left on the instance or subclass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import Any

log = logging.getLogger(__name__)
_MISSING = object()


def _own_value(owner: Any, name: str) -> Any:
    """What ``setattr(owner, name, ...)`` replaces: the entry in ``owner.__dict__``, else the value
    ``getattr`` reads from a ``__getattr__`` (a module or Inductor's config); ``_MISSING`` when the
    name is absent or comes from the class (of an instance) or a base class."""
    own = getattr(owner, "__dict__", None)
    if own is not None and name in own:
        return own[name]
    if isinstance(owner, type) or hasattr(type(owner), name) or not hasattr(owner, name):
        return _MISSING
    return getattr(owner, name)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001  (an == that raises or returns a tensor: not the same)
        return False


class Patcher:
    """An undo log of attribute, mapping and callback changes."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def setattr(self, owner: Any, name: str, value: Any) -> Any:
        """Set ``owner.name = value``; return the previous value (or ``None``).

        The previous value is read from ``owner.__dict__`` when it is there, so a
        staticmethod or classmethod is restored as the descriptor it was.
        """
        old = _own_value(owner, name)

        def undo() -> None:
            current = _own_value(owner, name)
            if not _same(current, value):  # NOTE [patches made after ours]
                log.warning(
                    "dynamo-ext uninstall: %s.%s was changed after install (now %r); leaving it as it is",
                    getattr(owner, "__name__", type(owner).__name__),
                    name,
                    current,
                )
                return
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

        setattr(owner, name, value)
        self._undo.append(undo)
        return None if old is _MISSING else old

    def setitem(self, mapping: MutableMapping[Any, Any], key: Any, value: Any) -> None:
        """Set ``mapping[key] = value``, remembering whether the key existed."""
        old = mapping.get(key, _MISSING)

        def undo() -> None:
            if not _same(mapping.get(key, _MISSING), value):  # NOTE [patches made after ours]
                log.warning("dynamo-ext uninstall: entry %r was changed after install; leaving it as it is", key)
                return
            if old is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = old

        mapping[key] = value
        self._undo.append(undo)

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the patches are undone (for registries with their own API)."""
        self._undo.append(fn)

    def undo_all(self) -> None:
        """Undo every change, newest first."""
        while self._undo:
            self._undo.pop()()


PATCHES = Patcher()
