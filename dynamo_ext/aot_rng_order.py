"""Keep AOTAutograd's saved RNG states among the saved tensors when opaque objects are saved too.

NOTE [rng states after opaque objects]
When an activation-checkpointed region holds a random op (on CPU even
``scaled_dot_product_attention`` is one: its ``_scaled_dot_product_flash_attention_for_cpu``
is tagged ``nondeterministic_seeded``), the min-cut partitioner's
``functionalize_rng_ops`` saves each op's RNG state for the recomputation in
the backward: it inserts the states into the forward graph's outputs just
before the saved SymInts, and their placeholders into the backward graph just
before the tangents.  When the forward also saves opaque objects for the
backward (device meshes and process groups are opaque graph inputs on 2.12+,
and a checkpointed region that uses a DTensor parameter saves its mesh), those
sit between the saved tensors and the SymInts, so the RNG states land *after*
them.  AOTAutograd's runtime slices the saved values as
``[tensors, opaque objects, SymInts]`` by count, so the forward raises
``AssertionError: expected all tensors_saved_with_vc_check to be Tensors, got
types: [..., DeviceMesh]`` (torch 2.13; a torchtitan-style Llama with TP and
activation checkpointing on CPU hits it: ``examples/titan_llama_audit.py``).

We wrap ``functionalize_rng_ops`` and move the RNG states it added in front of
the opaque objects they were placed after, in the forward outputs and in the
backward placeholders alike, which is the order the runtime expects (and the
order they have when nothing opaque is saved).  A graph without RNG states, or
whose states already precede every opaque object, is left untouched.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Any

from . import _compat
from ._patching import Patcher

log = logging.getLogger(__name__)

_RNG_PLACEHOLDER_PREFIX = "rng_state_output_"  # functionalize_rng_ops names its backward placeholders so


def _is_rng_state_output(node: Any) -> bool:
    """``getitem(run_and_save_rng_state(...), 0)``: the state ``functionalize_rng_ops`` saves for the backward."""
    if getattr(node, "op", None) != "call_function" or node.target is not operator.getitem or node.args[1] != 0:
        return False
    producer = node.args[0]
    return getattr(producer, "op", None) == "call_function" and "run_and_save_rng_state" in str(producer.target)


def _move_before_opaque(items: list[Any], is_rng: Any) -> list[Any] | None:
    """``items`` with each run of RNG states moved in front of the opaque objects just before it; ``None`` if unchanged."""
    out = list(items)
    changed = False
    i = 0
    while i < len(out):
        if not is_rng(out[i]):
            i += 1
            continue
        end = i
        while end < len(out) and is_rng(out[end]):
            end += 1
        start = i
        while start > 0 and _compat.is_opaque_fx_node(out[start - 1]):
            start -= 1
        if start < i:
            out[start:end] = out[i:end] + out[start:i]
            changed = True
        i = end
    return out if changed else None


def reorder_rng_states(fw_module: Any, bw_module: Any) -> bool:
    """Move saved RNG states before the opaque objects saved with them (NOTE [rng states after opaque objects]).

    ``fw_module``/``bw_module``: the partitioned forward and backward ``GraphModule``s, changed in place
    and recompiled.  Returns whether anything moved.
    """
    output = next(iter(fw_module.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    new_outs = _move_before_opaque(outs, _is_rng_state_output)
    placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
    new_phs = _move_before_opaque(placeholders, lambda n: n.name.startswith(_RNG_PLACEHOLDER_PREFIX))
    if new_outs is None or new_phs is None:
        if new_outs is not None or new_phs is not None:
            # Only one side matched the pattern: the graphs are not what this fix knows; leave them as they are.
            log.warning(
                "saved RNG states after opaque objects in only one of the forward/backward graphs; not reordered"
            )
        return False
    output.args = (tuple(new_outs), *output.args[1:])
    first = placeholders[0]
    if new_phs[0] is not first:
        first.prepend(new_phs[0])
    for prev, ph in zip(new_phs, new_phs[1:]):  # each placeholder right after the one before it in the new order
        prev.append(ph)
    fw_module.recompile()
    bw_module.recompile()
    log.debug("moved %d saved RNG state(s) before the saved opaque objects", sum(map(_is_rng_state_output, outs)))
    return True


def install(patches: Patcher) -> None:
    """Wrap the partitioner's ``functionalize_rng_ops`` (a no-op on a torch release without it)."""
    partitioners = _compat.partitioners_module()
    original = getattr(partitioners, "functionalize_rng_ops", None)
    if original is None:
        return

    @functools.wraps(original)
    def functionalize_rng_ops(joint_module: Any, fw_module: Any, bw_module: Any, *args: Any, **kwargs: Any) -> Any:
        fw_module, bw_module = original(joint_module, fw_module, bw_module, *args, **kwargs)
        reorder_rng_states(fw_module, bw_module)
        return fw_module, bw_module

    patches.setattr(partitioners, "functionalize_rng_ops", functionalize_rng_ops)
