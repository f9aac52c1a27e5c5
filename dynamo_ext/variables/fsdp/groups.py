"""FSDP2 module groups (``fully_shard([norm, output], mesh=...)``) traced like single modules.

One FSDP state shards the parameters of several modules.  FSDP2 registers,
on each module of the group, a pre-hook and a post-hook made per
``fully_shard`` call (``_register_group_forward_hooks`` in
torch/distributed/fsdp/_fully_shard/_fsdp_state.py), closures that share the
state's ``_modules_to_run_forward`` set:

- pre-hook: when the set is empty (a pass of the group starts), fill it with
  the group's modules; then run the state's pre-forward, which all-gathers the
  group's parameters only when they are sharded (at the pass's first module)
  and casts the inputs at every module;
- post-hook: remove the module from the set; when that empties it (the pass's
  last module), run the state's post-forward (reshard); otherwise only cast
  the output (``mp_policy.output_dtype``).

The closures are new functions per group, so the plugin recognises them by
their code (:func:`dynamo_ext._compat.fsdp_group_hook_codes`, a probe of
their behaviour) and traces :func:`group_pre_forward` /
:func:`group_post_forward` in their place: the same steps on the traced pass's
own record of the modules still to run (NOTE [FSDP2 passes in traced frames]:
FSDP2's set is left to its eager hooks), with the traced pre- and post-forward
of ``hooks.py``.  So each group parameter is all-gathered once per pass, at the
first module called, with FSDP2's reduction as the gather's backward (NOTE
[FSDP2 gradients in traced graphs]), and resharded at the last; the pass's
first state finishes, at its post-forward, a group pass that skipped a module,
as eager FSDP2's ``_force_complete_incomplete_states`` does.

A pass that starts outside any FSDP2 forward (a group module called on its
own, e.g. the output projection of a chunked loss after the model's forward)
is finished in eager FSDP2 by its backward's final callback, which the traced
backward does not run: that call breaks the graph
(``dynamo_ext: FSDP2 setting not traced``) and FSDP2's hooks run eagerly, as
they do for a group whose parameters eager FSDP2 hooks unsharded in a pass they
started (after a graph break or a skipped frame, as in transformers' Mixtral,
whose expert dispatch skips the frames above it; ``hooks.check_state``).
"""

from __future__ import annotations

import logging
from typing import Any

from ... import _compat, graph_breaks
from .. import registry
from ..base import wrap_constant
from ..functions import HandledFunctionVariable, build_variable
from . import hooks

log = logging.getLogger(__name__)


def group_pre_forward(state: Any, module: Any, args: Any, kwargs: Any, count: int) -> Any:
    """Traceable group pre-hook: gather at the pass's first module, cast inputs at every one.

    ``count``: how many modules the group has (NOTE [FSDP2 passes in traced frames]: the traced pass keeps
    their indices in ``state._modules``, not the modules, so no module is reached through the state).
    """
    if state._dynamo_ext_modules_to_run is None:
        state._dynamo_ext_modules_to_run = tuple(range(count))
        return hooks.pre_forward(state, module, args, kwargs)
    return hooks.cast_inputs(state, args, kwargs)


def group_post_forward(state: Any, module: Any, input: Any, output: Any, index: int) -> Any:
    """Traceable group post-hook: reshard at the pass's last module, cast the output at the others.

    ``index``: the module's index in ``state._modules``.
    """
    to_run = state._dynamo_ext_modules_to_run
    if to_run is not None:
        left = tuple(i for i in to_run if i != index)
        if len(left) < len(to_run):
            state._dynamo_ext_modules_to_run = left
            if len(left) == 0:
                state._dynamo_ext_modules_to_run = None
                return hooks.post_forward(state, module, input, output)
    return hooks.cast_output(state, output)


def _refuse_untraceable_pass(tx: Any, state_vt: Any) -> None:
    """Break the graph where the group's pass is not one the traced hooks can finish (module docstring).

    Reads the traced pass's bookkeeping as the trace sees it (NOTE [FSDP2 passes in traced frames]:
    written earlier in this trace, or guarded), through Dynamo's trackers.
    """
    to_run = _compat.tracker_getattr(tx, state_vt, "_dynamo_ext_modules_to_run")
    ctx = _compat.tracker_getattr(tx, state_vt, "_state_ctx")
    root = _compat.tracker_getattr(tx, ctx, "_dynamo_ext_forward_root")
    starts = to_run.is_python_constant() and to_run.as_python_constant() is None
    if starts and root.is_python_constant() and root.as_python_constant() is None:
        graph_breaks.graph_break(
            graph_breaks.FSDP_UNTRACED,
            "a module of an FSDP2 module group (fully_shard([...])) called outside its root module's forward: "
            "eager FSDP2 finishes such a pass in its backward's final callback, which the traced backward "
            "does not run",
        )


def _build_group_hook(tx: Any, value: Any, source: Any) -> Any:
    codes = _compat.fsdp_group_hook_codes()
    inner = getattr(value, "__wrapped__", None)
    code = getattr(inner, "__code__", None)
    if codes is None or source is None or inner is None or code not in codes[1:]:
        return None  # another FSDP2 hook (reached by identity elsewhere) or a value made while tracing
    impl = group_pre_forward if code is codes[1] else group_post_forward
    bound = inner.__wrapped__  # the state's bound _pre_forward / _post_forward
    state_source = _compat.AttrSource(
        _compat.AttrSource(_compat.AttrSource(source, "__wrapped__"), "__wrapped__"), "__self__"
    )
    state_vt = build_variable(tx, bound.__self__, state_source)

    def handler(tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        hooks.check_state(tx, [state_vt], {})
        modules = tuple(bound.__self__._modules)
        if impl is group_pre_forward:
            _refuse_untraceable_pass(tx, state_vt)
            extra = len(modules)
        else:
            module = getattr(args[0], "value", None) if args else None
            extra = next((i for i, m in enumerate(modules) if m is module), None)
            if extra is None:
                graph_breaks.graph_break(
                    graph_breaks.FSDP_UNTRACED,
                    "an FSDP2 module-group post-hook whose module is not known at trace time",
                )
        return _compat.user_function_variable(impl).call_function(
            tx, [state_vt, *args, wrap_constant(tx, extra)], kwargs
        )

    log.debug("FSDP2 module group hook %s traced", impl.__name__)
    return HandledFunctionVariable(value, handler, source=source)


def register() -> None:
    """Trace FSDP2's module-group hooks when this torch release's hooks are the ones mirrored here."""
    codes = _compat.fsdp_group_hook_codes()
    if codes is None:
        log.debug("FSDP2 module-group hooks not recognised on this torch release: they run eagerly")
        return
    registry.register_variable(codes[0], _build_group_hook, match="code")
