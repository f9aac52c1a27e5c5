"""Module paths of modules a compiled frame reached through an FSDP2 state, not through their parent.

NOTE [modules reached through an FSDP2 state]
Dynamo names a module in ``nn_module_stack`` by the source it first reached the
module through.  The traced FSDP2 hooks set each group's unsharded parameters
on their modules (``fsdp_param._module_info.module``), so a module of an FSDP2
module group that the hooks reach before the model calls it (``output`` of
``fully_shard([norm, output])``: its parameter is gathered at ``norm``) is
named ``L['model'].norm._forward_hooks[...].__self__._fsdp_param_groups[0]
.fsdp_params[1]._module_info.module``.  Each FSDP2 state a trace checks
(:func:`.hooks.check_state`) is remembered by its source name, so such a name
resolves to the module's path from the root (FSDP2's own parameter FQN);
the audit's communication report attributes collectives by that path.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

from ... import _compat

# Dynamo's nn_module_stack spells ``._modules['0']`` as ``.0`` (torch/_dynamo/variables/nn_module.py): so do the keys.
_REDUNDANT = re.compile(r"\._(?:modules|parameters|buffers)\[(['\"])([^'\"\]]+)\1\]")
_STATES: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
# "<state source>._fsdp_param_groups[g].fsdp_params[i]._module_info.module<rest>" (2.11: "._fsdp_param_group.")
_THROUGH_STATE = re.compile(
    r"^(?P<state>.+?)\._fsdp_param_group(?:s\[(?P<group>\d+)\])?\.fsdp_params\[(?P<param>\d+)\]"
    r"\._module_info\.module(?P<rest>.*)$"
)


def remember_state(source: Any, state: Any) -> None:
    """Record an FSDP2 state a trace reached through ``source`` (a Dynamo ``Source``), and the states of its
    tree through ``<source>._state_ctx.all_states[k]`` (the traced root's pre-forward walks them)."""
    name = _REDUNDANT.sub(r".\2", _compat.source_name(source))
    tree = getattr(getattr(state, "_state_ctx", None), "all_states", None) or ()
    for key, value in [(name, state), *((f"{name}._state_ctx.all_states[{k}]", s) for k, s in enumerate(tree))]:
        try:
            _STATES[key] = value
        except TypeError:  # not weakly referenceable: nothing to resolve through it
            pass


def module_path_through_state(name: str) -> str | None:
    """The module's path from the FSDP2 root for a source name through a remembered state's parameter, else ``None``.

    ``name``: Dynamo's source name of a module (``nn_module_stack``).  The result is ``"output"`` (or
    ``"output" + rest`` for a submodule reached below it, in the source's own spelling); ``""`` for the root.
    """
    m = _THROUGH_STATE.match(name)
    state = _STATES.get(m.group("state")) if m else None
    if m is None or state is None:
        return None
    groups = _compat.fsdp_param_groups(state)
    try:
        fsdp_param = groups[int(m.group("group") or 0)].fsdp_params[int(m.group("param"))]
    except (IndexError, AttributeError, TypeError):
        return None
    fqn = _compat.fsdp_param_module_fqn(fsdp_param)
    return None if fqn is None else fqn + m.group("rest")
