"""The bookkeeping of an FSDP2 forward pass in traced frames: the plugin's own, not FSDP2's.

NOTE [FSDP2 passes in traced frames]
Eager FSDP2 keeps a forward pass's bookkeeping on its states: the iteration's
forward root (``FSDPStateContext.iter_forward_root``), a module group's modules
still to run (``FSDPState._modules_to_run_forward``) and each state's training
state.  Eager code leaves them mid-pass between compiled steps: torchtitan's
chunked loss runs the ``[norm, lm_head]`` group's ``lm_head`` eagerly after the
model's forward, so the group's pass stays open (``norm`` still to run, the
group the forward root, its training state FORWARD) until FSDP2's final
backward callback, which a traced backward does not queue; a validation pass
under ``no_grad`` leaves the same.  Eager FSDP2 copes (its next forward
continues the open pass); traced hooks that read that state would guard on it
and recompile, then break, on every step after the first.

So the traced hooks read none of it.  They keep their own bookkeeping, in two
attributes only they write:

- ``FSDPStateContext._dynamo_ext_forward_root``: the state whose traced
  pre-forward began the pass (its post-forward finishes the module groups the
  pass left open, as ``_force_complete_incomplete_states`` does); the tree's
  root begins a new pass on every call;
- ``FSDPState._dynamo_ext_modules_to_run``: the indices (in the state's
  ``_modules``) of a module group's modules still to run in the traced pass,
  ``None`` outside one: indices, so that no module is reached through the
  state (Dynamo names a module by the first source it meets it through).

Dynamo replays the writes after the graph and at a graph break, so a pass split
over frames goes on in the next frame (which reads them, guarded); a pass in one
frame leaves both as it found them (``None``: the forward root's post-forward
sets every entry back), so a frame reads them as ``None`` (a guard that holds
from step to step).

The one thing of FSDP2's eager bookkeeping a traced pass writes is what
FSDP2's final backward callback (``_root_post_backward_final_callback``) resets
at the end of every backward, which a traced backward does not queue: the
forward root (``None``, when the tree's root begins a traced pass) and every
state's and parameter group's training state (IDLE, when the tree's root ends
its traced pass).  Without it an eager pass under ``no_grad`` (torchtitan's
validator running the chunked loss) leaves the ``[norm, lm_head]`` group's
training state FORWARD, and the next training step's eager ``lm_head`` calls,
taking that for a pass already under way, register no post-backward hook:
``lm_head``'s gradient would never be reduce-scattered (eager FSDP2's final
callback reduces it).  The traced hooks read no training state, so writing them
at the end of the pass leaves the same values after the frame as writing them
at its start; at the end, the root reaches the other states (through
``_state_ctx.all_states``) only after the blocks have met theirs through their
own modules, which names them by their block: what stamping a block needs
(NOTE [blocks traced once] in ``dynamo_ext/blocks/trace_once.py``; at the start,
every block's state was named through the root and no block was stamped).

What the traced hooks do read of FSDP2's own state is whether eager FSDP2 holds
a module's parameters unsharded (``FSDPParamGroup.is_sharded``, in the settings
guard): a pass its hooks started and have not finished (after a graph break or a
skipped frame), or ``reshard_after_forward=False`` with no backward since.  The
traced gather would then replace parameters eager FSDP2 still owns, so that
module's hooks run eagerly (a named graph break).  torchtitan's chunked loss
reshards the group when it ends (``lm_head.reshard()``).
"""

from __future__ import annotations

from typing import Any

from ... import _compat

FORWARD_ROOT = "_dynamo_ext_forward_root"
MODULES_TO_RUN = "_dynamo_ext_modules_to_run"


def init(state: Any) -> None:
    """Give ``state``'s FSDP2 tree the bookkeeping attributes, ``None``, where they are missing (at trace time)."""
    ctx = state._state_ctx
    if not hasattr(ctx, FORWARD_ROOT):
        setattr(ctx, FORWARD_ROOT, None)
    for other in getattr(ctx, "all_states", None) or [state]:
        if not hasattr(other, MODULES_TO_RUN):
            setattr(other, MODULES_TO_RUN, None)


def eagerly_unsharded(state: Any) -> bool:
    """Whether eager FSDP2 holds some parameter group of ``state`` unsharded (module docstring)."""
    return any(not getattr(group, "is_sharded", True) for group in _compat.fsdp_param_groups(state))
