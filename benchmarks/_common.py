"""What several benchmark scripts share: a rendezvous port and the shared corpus's timed cases.

Imported as ``from _common import ...`` (a script's own directory is on ``sys.path``).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torch's launcher's rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_corpus_cases(cases: dict[str, Any], env: Any, k: str | None) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(name, case, fn, args)`` of each corpus case to time: matching ``k`` (name or tag), not compiled-autograd,
    not expected to fail; the case's factory is called with ``env``."""
    for name, c in cases.items():
        if k and k not in name and not any(k in t for t in c.tags):
            continue
        if c.compiled_autograd or c.expect_error:
            continue
        made = c.factory(env)
        yield name, c, made[0], made[1]
