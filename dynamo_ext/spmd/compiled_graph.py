"""Compile a graph of a data-parallel step: the same issuing location on every rank, errors raised as themselves.

NOTE [rank-invariant names for the step's code]
Each graph of a data-parallel step (the whole step, or each submodule of the
split) is compiled by Dynamo from the code FX generated for it, and FX names
that code with a per-process counter (``<eval_with_key>.33``).  The plugin's
collective check compares each collective's issuing location across the ranks
(NOTE [collective stream check]); for this code that is the generated file's
name.  A rank that compiled one graph more than its peers (the rank given a
single sample at a later step recompiles for it: Dynamo specializes a size-1
dim) has a counter ahead of theirs from then on, so the next graph it checks
(a retrace for new optimizer state or a changed hyperparameter, another
data-parallel step) carries another name: the check raises a
``CollectiveMismatchError`` on every rank although every rank issues the same
collectives.  So the code is named after its content
(:func:`_compat.tracing.name_generated_code`): ``<data_parallel submod_0 1a2b...>``
is the same on every rank that compiled the same graph.  Where this torch
ignores the name (the probe fails) it is logged at WARNING, once.

NOTE [errors from a compiled graph]
``torch.compile(graph_module, fullgraph=True)`` runs the module's call
wrapper (``torch.fx.graph_module._WrappedCall``) inside Dynamo's frame hook;
when the compiled code raises, that wrapper formats the traceback with a
generator, which Dynamo, asked for one full graph, refuses: every error (a
``CollectiveMismatchError``, a process group's timeout) reached the user as
``Unsupported: Attempt to trace generator``.  The generated ``forward`` is
compiled instead, so the error propagates as raised.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from .. import _compat

log = logging.getLogger(__name__)

_unnamed_warned: list[bool] = []


def _name_code(gm: torch.fx.GraphModule, label: str) -> None:
    """NOTE [rank-invariant names for the step's code]."""
    digest = hashlib.sha1(gm.code.encode()).hexdigest()[:16]
    filename = f"<data_parallel {label} {digest}>"
    if _compat.tracing.name_generated_code(gm, filename):
        log.debug("data_parallel: %s compiled as %s", label, filename)
    elif not _unnamed_warned:
        _unnamed_warned.append(True)
        log.warning(
            "data_parallel: this torch does not take a file name for FX's generated code (Graph._co_fields), so "
            "the step's collectives are checked at <eval_with_key> lines, whose numbers differ between ranks "
            "once one rank compiled more graphs; a CollectiveMismatchError naming only such lines is a false "
            "one: set DYNAMO_EXT_COLLECTIVE_CHECK=0 to skip the check"
        )


class CompiledGraph(torch.nn.Module):
    """``gm`` compiled with ``backend`` (dynamic shapes, one graph), callable as ``gm`` is.

    A module, so it can replace a submodule of a split graph; it keeps ``gm`` as ``graph_module``.
    """

    def __init__(self, gm: torch.fx.GraphModule, backend: str | Callable[..., Any], *, label: str) -> None:
        super().__init__()
        _name_code(gm, label)
        self.graph_module = gm
        # NOTE [errors from a compiled graph]: the forward, not the module.
        self._compiled = torch.compile(gm.forward, backend=backend, dynamic=True, fullgraph=True)

    def forward(self, *args: Any) -> Any:
        return self._compiled(*args)
