"""Why a graph recompiled, in words, with what to change: read from the failed guard Dynamo names.

NOTE [why a recompile]
A recompile's ``reason`` is the guard that failed, as Dynamo (or the plugin's guards, already in words:
``placement changed: ...``) wrote it: ``___check_obj_id(fn.__code__, <id>)``, ``self.temperature == 1.0``,
``tensor 'x' size mismatch at index 0``.  The report adds ``why``: what changed between the calls, in a
sentence, and what makes the code compile once.  A guard this module does not know keeps ``why`` empty (its
``reason`` is still shown): the audit says nothing it cannot read from the guard.
"""

from __future__ import annotations

import re

_CODE_ID = re.compile(r"___check_obj_id\((?P<expr>[^,]+?)\.__code__,")
_OBJ_ID = re.compile(r"___check_obj_id\((?P<expr>[^,]+?),")
_TYPE_ID = re.compile(r"___check_type_id\((?P<expr>[^,]+?),")
_SIZE = re.compile(r"(size|stride) mismatch|dimensionality|\.size\(\)\[\d+\] ==|\.stride\(\)\[\d+\] ==")
_VALUE = re.compile(r"^(?P<expr>[\w.\[\]'\"]+) == (?P<value>[^\s#]+)")
_GRAD = re.compile(r"requires_grad mismatch|grad_mode|GRAD_MODE|dispatch key set mismatch")


def why_recompiled(reason: str) -> str:
    """What changed between the calls and what makes the code compile once (NOTE [why a recompile]); ``""``
    for a guard this module does not read."""
    first = reason.strip().splitlines()[0] if reason.strip() else ""
    if m := _CODE_ID.search(first):
        return (
            f"{m['expr']} is another function here than the one this graph was compiled for (another code object): "
            "a wrapper shared by several functions (a per-module forward wrapper calling each module's own forward) "
            "compiles once per function it calls. To compile once, compile the caller so that the call is traced "
            "into its graph (the whole model), or call one function at this line"
        )
    if m := _OBJ_ID.search(first):
        return (
            f"{m['expr']} is another object than the one this graph was compiled for (Dynamo guards its identity): "
            "an object made anew for each call (a module, function or constant built in the loop) recompiles. "
            "Make it once and reuse it, or pass what changes as a tensor"
        )
    if m := _TYPE_ID.search(first):
        return f"{m['expr']} has another type than when this graph was compiled: one compile per type"
    if _SIZE.search(first):
        return (
            "a tensor's shape changed: Dynamo compiled the first shapes as constants and recompiles once with "
            "dynamic sizes (automatic dynamic shapes). To compile once, mark the size dynamic from the start "
            "(torch._dynamo.mark_dynamic) or keep shapes fixed (padding)"
        )
    if _GRAD.search(first):
        return (
            "the same code ran under another grad mode or with inputs of another requires_grad (an eval pass under "
            "no_grad between training steps): one compile per mode, each kept"
        )
    if m := _VALUE.match(first):
        return (
            f"the Python value {m['expr']} changed (it was {m['value']}): Dynamo compiled it as a constant and "
            "recompiles when it changes: once, with it dynamic, for a number Dynamo can make dynamic (automatic "
            "dynamic), else for each new value up to the recompile limit. To compile once, pass it as a tensor"
        )
    return ""
