"""Every monkeypatch dynamo-ext makes goes through :data:`PATCHES`.

``install()`` records each change here and ``uninstall()`` undoes them in
reverse order, so the patched objects end up exactly as they were (attributes
that did not exist are deleted again, dict entries that did not exist are
popped).  Nothing else in the package may assign to a torch attribute.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

_MISSING = object()


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
        old = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        if old is _MISSING and hasattr(owner, name) and not isinstance(owner, type):
            old = getattr(owner, name)

        def undo() -> None:
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
