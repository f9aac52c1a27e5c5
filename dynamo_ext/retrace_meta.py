"""Dynamo reads a traced ``GraphModule``'s node metadata once per code object, not once per node.

NOTE [original node meta read once per code object]
When Dynamo traces code that FX generated for a ``GraphModule`` (compiled
autograd's backward graph is such code: its runtime wrapper hands the captured
graph module to ``torch.compile``), ``SubgraphTracer._create_proxy`` copies
each new node's ``stack_trace`` and the ``_COPY_META_FIELDS`` from the
original node that the traced line came from.  It looks the original graph up,
and builds the list of all its nodes' ``meta`` dicts, whenever "the traced
code object is not ``_cur_code``".  Nothing ever assigns ``_cur_code`` (2.13,
and every other release's copy of ``output_graph.py`` checked), so the list
is rebuilt for every proxy: the trace is quadratic in the graph's size.  On
the bundled Llama (FSDP over TP, fake group, one process, torch 2.13) the
rebuilds took 1.4 s of the compiled-autograd backward's Dynamo trace at 8
layers and 3.4 s at 32 (``create_proxy``: 5.1 s, 1.7 s without them); they
grow with the square of the depth.

After each proxy we set ``_cur_code`` to the code object it was traced from,
so the lookup is redone only when the code changes, as the check intends.
What ends up in the graph is unchanged:
- the state the lookup sets (``_orig_gm_meta``, ``_orig_gm_lineno_map``,
  ``_orig_gm_firstlineno``) is a function of the code object, and a rebuilt
  list holds the same ``meta`` dicts as the kept one;
- the lookup also decides ``is_retracing``, which then skips a block that adds
  ``nn_module_stack`` and ``source_fn_stack`` to a node lacking them; the
  lines before that block always set both for the nodes it would touch, so it
  adds nothing either way.
``tests/test_retrace_meta.py`` compares every node's metadata of a
compiled-autograd graph traced with and without this against each other, on
the release it runs on.  A release whose ``SubgraphTracer`` has no
``_cur_code`` is left as it is.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from . import _compat
from ._patching import Patcher

log = logging.getLogger(__name__)


def install(patches: Patcher) -> None:
    """Wrap ``SubgraphTracer._create_proxy`` to remember the code object its last proxy came from.

    NOTE [original node meta read once per code object].  A no-op where the tracer has no
    ``_create_proxy``; the wrapper calls the original unchanged on a tracer without ``_cur_code``.
    """
    tracer_class = _compat.subgraph_tracer_class()
    original = getattr(tracer_class, "_create_proxy", None)
    if original is None:
        log.debug("SubgraphTracer has no _create_proxy on this release; its node meta lookup is left as it is")
        return

    @functools.wraps(original)
    def _create_proxy(self: Any, *args: Any, **kwargs: Any) -> Any:
        proxy = original(self, *args, **kwargs)
        if "_cur_code" in self.__dict__:
            tx = self.output_graph.current_tx
            self._cur_code = tx.f_code  # NOTE [original node meta read once per code object]
        return proxy

    patches.setattr(tracer_class, "_create_proxy", _create_proxy)
