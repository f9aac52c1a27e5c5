"""Module full backward hooks traced without compiled autograd, and guards on the hook dicts.

Stock Dynamo meets ``BackwardHook(module, hooks, pre_hooks)`` when it inlines
the ``__call__`` of a module with ``register_full_backward_hook`` /
``register_full_backward_pre_hook`` hooks (or global ones).  Under compiled
autograd it records the hooks for the compiled backward; otherwise it breaks
the graph ("Module-level backwards hooks require compiled autograd").

With dynamo-ext installed, the same point without compiled autograd traces
:class:`ModuleBackwardHooksVariable` instead: the module's positional input
tensors and its output tensors pass through identity points whose backward
calls the module's hooks eagerly at run time (NOTE [module backward hooks
without compiled autograd] in ``backward_hook_ops.py``), so the forward stays
one graph and the hooks see eager's gradients.  What we cannot model the same
way (tensor subclasses such as DTensor at the hook points, a module returning
a named tuple or a tuple subclass) is a ``dynamo_ext:`` graph break whose hint
says how to enable compiled autograd.

Compiled autograd keeps stock's path.  Either way a hook registered or removed
after the first compile recompiles: stock skips the guard on an *empty* hook
dict (``config.skip_nnmodule_hook_guards``), so a late
``register_full_backward_pre_hook`` was silently ignored and gave wrong
gradients (pytorch#117265); we guard the empty backward hook dicts
(``guards/hook_dicts.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ... import _compat, graph_breaks
from ..._patching import Patcher
from . import backward_hook_ops as ops

log = logging.getLogger(__name__)

_Base: Any = _compat.backward_hook_variable_class() or _compat.VariableTracker


def _example(vt: Any) -> Any:
    return vt.as_proxy().node.meta.get("example_value")


def _plain(t: Any) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t)


class ModuleBackwardHooksVariable(_Base):
    """Dynamo's ``BackwardHook`` for one call of a hooked module, outside compiled autograd.

    ``setup_input_hook(args)`` / ``setup_output_hook(result)`` (what
    ``Module._call_impl`` calls) put :func:`backward_hook_ops.hook_inputs` /
    :func:`backward_hook_ops.hook_outputs` on the tensors, as eager's
    ``BackwardHook._apply_on_tensors`` puts ``BackwardHookFunction``.
    """

    def __init__(self, site_id: int, module_name: str, **kwargs: Any) -> None:
        _compat.VariableTracker.__init__(self, **kwargs)
        self.site_id = site_id
        self.module_name = module_name

    def as_proxy(self) -> Any:
        graph_breaks.graph_break(
            graph_breaks.MODULE_BACKWARD_HOOK, f"BackwardHook of {self.module_name} used as a value"
        )

    def python_type(self) -> type:
        return torch.utils.hooks.BackwardHook

    def reconstruct(self, codegen: Any) -> None:
        graph_breaks.graph_break(
            graph_breaks.MODULE_BACKWARD_HOOK, f"BackwardHook of {self.module_name} live across a graph break"
        )

    def call_method(self, tx: Any, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if name == "setup_input_hook" and len(args) == 1 and not kwargs:
            return self._setup_inputs(tx, args[0])
        if name == "setup_output_hook" and len(args) == 1 and not kwargs:
            return self._setup_outputs(tx, args[0])
        return _compat.VariableTracker.call_method(self, tx, name, args, kwargs)

    def _hook(self, tx: Any, fn: Any, items: list[Any], what: str) -> tuple[list[Any], tuple[int, ...] | None]:
        """Put ``fn`` on the tensors among ``items``; return the new items and the tensors' positions."""
        idx = tuple(i for i, v in enumerate(items) if v.is_tensor())
        examples = [_example(items[i]) for i in idx]
        if not (torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in examples)):
            return items, None  # eager: no hook point when no tensor requires grad
        bad = [i for i, t in zip(idx, examples) if not _plain(t)]
        if bad:
            kind = type(examples[idx.index(bad[0])]).__name__
            graph_breaks.graph_break(
                graph_breaks.MODULE_BACKWARD_HOOK,
                f"{self.module_name}: {what}[{bad[0]}] is a {kind} (a tensor subclass)",
            )
        proxy = tx.output.create_proxy("call_function", fn, (self.site_id, *[items[i].as_proxy() for i in idx]), {})
        hooked = _compat.wrap_fx_proxy(tx, proxy)
        new = list(items)
        for i, vt in zip(idx, hooked.items):
            new[i] = vt
        return new, idx

    def _setup_inputs(self, tx: Any, args: Any) -> Any:
        if type(args) is not _compat.TupleVariable:
            graph_breaks.graph_break(graph_breaks.MODULE_BACKWARD_HOOK, f"{self.module_name}: inputs {args}")
        items, idx = self._hook(tx, ops.hook_inputs, list(args.items), "input")
        site = ops.site(self.site_id)
        site.n_inputs, site.input_idx = len(items), idx
        return args if idx is None else _compat.TupleVariable(items)

    def _setup_outputs(self, tx: Any, result: Any) -> Any:
        site = ops.site(self.site_id)
        if result.is_tensor():
            items, single = [result], True
        elif type(result) is _compat.TupleVariable:
            items, single = list(result.items), False
        else:
            try:
                is_tuple = issubclass(result.python_type(), tuple)
            except NotImplementedError:
                is_tuple = True
            if is_tuple:
                graph_breaks.graph_break(
                    graph_breaks.MODULE_BACKWARD_HOOK,
                    f"{self.module_name} returns a {result.python_type().__name__} (a tuple subclass)",
                )
            site.n_outputs, site.output_idx = 1, None  # eager: one non-tensor result, no hook point
            return result
        items, idx = self._hook(tx, ops.hook_outputs, items, "output")
        site.n_outputs, site.output_idx = len(items), idx
        if idx is None:
            return result
        return items[0] if single else _compat.TupleVariable(items)


def _create(orig: Any) -> Any:
    def create(tx: Any, module: Any, user_hooks: Any, user_pre_hooks: Any) -> Any:
        if _compat.compiled_autograd_enabled():
            return orig(tx, module, user_hooks, user_pre_hooks)
        mod = getattr(module, "value", None)
        if not isinstance(mod, torch.nn.Module):
            graph_breaks.graph_break(graph_breaks.MODULE_BACKWARD_HOOK, f"BackwardHook of {module}")
        name = type(mod).__name__
        site_id = ops.new_site(mod)
        log.debug("module backward hooks of %s (site %d) traced as eager hook points", name, site_id)
        return ModuleBackwardHooksVariable(site_id, name)

    return create


def register(patches: Patcher) -> None:
    """Trace module backward hooks without compiled autograd; guard the empty backward hook dicts."""
    from ...guards.hook_dicts import install as install_hook_dict_guards

    install_hook_dict_guards(patches)
    cls = _compat.backward_hook_variable_class()
    if cls is None:  # no BackwardHook support in this Dynamo: stock behaviour
        log.info("torch._dynamo has no BackwardHookVariable; module backward hooks keep stock behaviour")
        return
    ops.define_ops()
    patches.on_undo(ops.undefine_ops)
    patches.setattr(cls, "create", staticmethod(_create(cls.create)))
