"""Whether torch paths exist in the torch this interpreter imports; run under each release's interpreter.

    python scripts/support_docs/presence.py < paths.json > presence.json

Reads a JSON list of ``[path, module]`` pairs (a dotted torch path, the prefix the plugin imports as a
module) on stdin and writes, on stdout, a JSON object with the release (``torch.__version__``), the date
(UTC) and, for each path, whether it resolves: the module imported, then each name after it an attribute
of the object before it, or, failing that, a submodule imported by name (as ``from a import b`` finds
``b``).  A present path records the module it lies in (the longest prefix whose every step is a module:
the table's module column); a missing one records the first prefix that does not resolve and why.

Standard library and torch only, run as a script, so it works with any release's interpreter.
"""

from __future__ import annotations

import datetime
import importlib
import json
import platform
import sys
import types
import warnings
from typing import Any


def resolve(path: str, module: str = "") -> dict[str, Any]:
    """``{"present": True, "module": ...}`` or ``{"present": False, "missing": prefix, "error": ...}``.

    ``module``: the prefix the plugin's code imports as a module (``torch._dynamo.code_context`` in
    ``torch._dynamo.code_context.code_context``, where the package's attribute of that name is another object).
    """
    parts = path.split(".")
    start = len(module.split(".")) if module and (path == module or path.startswith(module + ".")) else 1
    first = ".".join(parts[:start])
    try:
        obj: Any = importlib.import_module(first)
    except Exception as e:  # noqa: BLE001  (any failure to import is an absence, with its reason)
        return {"present": False, "missing": first, "error": _why(e)}
    found = first
    for i in range(start + 1, len(parts) + 1):
        prefix, name = ".".join(parts[:i]), parts[i - 1]
        try:
            obj = getattr(obj, name)
        except AttributeError as e:
            if not isinstance(obj, types.ModuleType):
                return {"present": False, "missing": prefix, "error": _why(e)}
            try:
                obj = importlib.import_module(prefix)
            except ModuleNotFoundError as e2:
                # Not a submodule (it, or the parent that is no package, is what was not found): the
                # attribute error says why; another missing module is an import failure inside it.
                inside = e2.name is not None and not prefix.startswith(e2.name)
                return {"present": False, "missing": prefix, "error": _why(e2 if inside else e)}
            except Exception as e2:  # noqa: BLE001
                return {"present": False, "missing": prefix, "error": _why(e2)}
        except Exception as e:  # noqa: BLE001  (a lazy attribute that fails to load)
            return {"present": False, "missing": prefix, "error": _why(e)}
        if isinstance(obj, types.ModuleType) and found == ".".join(parts[: i - 1]):
            found = prefix
    return {"present": True, "module": found}


def _why(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


def probe(paths: list[list[str]]) -> dict[str, Any]:
    """The presence record of ``[path, module]`` pairs in this interpreter's torch."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apis = {path: resolve(path, module) for path, module in sorted(map(tuple, paths))}
    version = str(torch.__version__)
    return {
        "release": version.split("+")[0],
        "torch_version": version,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "apis": apis,
    }


if __name__ == "__main__":
    json.dump(probe(json.load(sys.stdin)), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
