"""Frames the plugin compiles keep every guard and stay out of Dynamo's precompile cache.

NOTE [frames kept out of the precompile cache]
Dynamo's precompile cache (``torch._dynamo.config.caching_precompile``,
``TORCH_CACHING_PRECOMPILE=1``; ``torch.compiler.save_cache_artifacts()``
writes it) saves each compiled frame's guards and graphs so that a restarted
job loads them instead of tracing.  While it is on, Dynamo also drops every
``ID_MATCH``, ``CLOSURE_MATCH``, ``WEAKREF_ALIVE`` and ``DICT_VERSION``
guard from the frame it compiles, in the running process too
(``CheckFunctionManager``, "dropped with caching_precompile=True"): a global
function replaced after the compile is not noticed and the frame runs the old
one (a wrong number, checked on 2.13).  The plugin's frames depend on such
guards (process groups, meshes and FSDP2 state by identity, FSDP2's hooks by
their closures: 124 dropped for the bundled Llama at 2 layers), and the
cache cannot bring the plugin's frames back: on 2.13 a restart that loaded a
saved FSDP-over-TP Llama graph (compiled whole) failed inside
``torch.compile()`` (an ``IndexError`` rebuilding a guard), and the block
split's compiled submodules are no backend the cache saves (Dynamo warns
"Backend not found" and traces again).

So while the plugin is installed, each frame Dynamo compiles:

- is left out of the package before its graph reaches the backend
  (``OutputGraph.bypass_package`` from ``compile_subgraph``).  Dynamo logs
  "Detected a package bypass: ..." as a warning, and raises ``PackageError``
  under ``torch._dynamo.config.strict_precompile``.  Left out any later (when
  its guards are built), a graph compiled whole missed AOTAutograd's cache on
  every restart;
- keeps every guard: ``caching_precompile`` reads False while its
  ``CheckFunctionManager`` is built, and its guards are not serialized.

A restarted job traces its frames again; AOTAutograd's and Inductor's caches
still serve their compiles (docs/compile_time.md).  Frames a package written
without the plugin brings in are not loaded either (NOTE [precompile packages
written without the plugin] in ``precompile_load.py``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from .._patching import Patcher

log = logging.getLogger(__name__)

BYPASS_REASON = (
    "dynamo-ext is installed: its frames keep every guard and are not saved to Dynamo's precompile cache "
    "(NOTE [frames kept out of the precompile cache]); a restart traces them again and hits AOTAutograd's "
    "and Inductor's caches"
)


def _left_out_of_package(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compile_subgraph(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Before the backend: its compile is then the one a run without the cache makes.
        if getattr(self, "package", None) is not None:
            self.bypass_package(BYPASS_REASON)
        return original(self, *args, **kwargs)

    return compile_subgraph


def _every_guard_kept(original: Callable[..., Any], output_graph_class: type) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807  (the wrapped method's name)
        bound = signature.bind(self, *args, **kwargs)
        output_graph: Any = bound.arguments.get("output_graph")
        if not torch._dynamo.config.caching_precompile or not isinstance(output_graph, output_graph_class):
            original(self, *args, **kwargs)  # not a frame being compiled (a saved frame's guards being loaded)
            return
        if getattr(output_graph, "package", None) is not None:  # a frame that compiled no graph
            output_graph.bypass_package(BYPASS_REASON)
        log.debug("caching_precompile is on: this frame keeps its identity, closure and dict-version guards")
        save = bound.arguments.get("save_guards", False)
        if "save_guards" in bound.arguments:
            bound.arguments["save_guards"] = False  # nothing of a bypassed frame is saved
        with torch._dynamo.config.patch(caching_precompile=False):
            original(*bound.args, **bound.kwargs)
        if save and self.guards_state is None:
            # Dynamo asks a frame compiled for a package for its guards' bytes; the package's entry for this
            # frame is bypassed, so CompilePackage.add_guarded_code returns before reading them.
            self.guards_state = b""

    return __init__


def install(patches: Patcher) -> None:
    """Keep every guard and leave each frame out of Dynamo's precompile cache (NOTE [frames kept out of the
    precompile cache]); a no-op on a release without that cache."""
    classes = _compat.precompile_cache_classes()
    if classes is None:
        if hasattr(torch._dynamo.config, "caching_precompile"):
            log.info(
                "Dynamo's precompile cache is not as dynamo_ext.guards.precompile_cache reads it: with "
                "caching_precompile on, this release's Dynamo drops identity and closure guards of the plugin's frames"
            )
        return
    output_graph, check_function_manager = classes
    patches.setattr(output_graph, "compile_subgraph", _left_out_of_package(output_graph.compile_subgraph))
    patches.setattr(
        check_function_manager, "__init__", _every_guard_kept(check_function_manager.__init__, output_graph)
    )
