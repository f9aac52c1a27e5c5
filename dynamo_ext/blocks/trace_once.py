"""Identical blocks traced once by Dynamo: the first block's call recorded, the others stamped from it.

NOTE [blocks traced once]
Dynamo interprets every block of a model's ``nn.ModuleList``: at 32 layers
that is most of the plugin's compile time once AOTAutograd and Inductor pay
for one block (NOTE [blocks compiled once] in ``split.py``).  A call of item
``i`` of a module container (``layers[i](h)``) whose block is identical to
an item already traced in this frame adds, in place of a trace, copies of
the nodes that item's call added, with block ``i``'s parameters as inputs:

- **Recording.**  The first call of a (block class, argument metadata,
  argument aliasing (NOTE [a stamp keeps its arguments' aliasing] in
  ``trace_aliasing.py``), call site, grad mode) in a frame's root graph is
  traced as usual and recorded: the nodes it added, the graph inputs it
  lifted (by source), its result, the guards of its trace on the block's
  sources, and its effects.
  A recording is kept only when the call is self-contained: its nodes read
  only its arguments and graph inputs, its result is a tensor it made, and
  every object outside it that it mutated (FSDP2 swaps each module's
  ``_parameters`` for the gathered tensor and back) holds its own value
  again when it returns, so the call leaves no state a later call could
  read (:func:`_restored`).
- **Stamping.**  A later call is checked before anything is added: block
  ``i``'s modules and hook counts match (:func:`.trace_guards.hook_key_map`),
  every guard of the recording holds renamed to block ``i`` (NOTE [a block's
  guards carried over]), nothing block ``i`` owns has a pending mutation,
  and nothing outside the blocks changed since the recording.  Then block
  ``i``'s graph inputs are lifted through Dynamo's own ``VariableBuilder``
  (their guards and fake tensors made as tracing makes them), the recorded
  nodes are copied with their module stacks moved to block ``i`` and fake
  values fresh where anything after the call can tell (NOTE [fake values a
  stamp reuses] in ``trace_record.py``), the renamed guards are installed,
  and the call returns a tracker of the copied result.  The graph, its module stacks and stack
  traces are those a trace gives (``tests/test_block_trace_once.py``
  compares them, and AOTAutograd's graphs, with tracing every block).
- **StampError** (logged at DEBUG, the block traced): anything else, among it
  a block that differs in any guarded way (another shape, dtype, placement,
  hook, attribute, mixed-precision policy), a call inside a higher-order op
  or from another line, symbolic shapes, a call that mutates state it does
  not restore, registers tensor hooks, or changes global state.

Which blocks are stamped may differ between ranks (an uneven shard gives one
rank's block another signature), but a stamped block's graph is the graph
tracing gives, so every rank's collectives, block split, bucketing pass and
collective check are what they are without stamping.
Switch: ``dynamo_ext.config.trace_blocks_once`` (``DYNAMO_EXT_TRACE_BLOCKS_ONCE=0``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import _compat, config
from .._patching import Patcher
from . import trace_aliasing
from .trace_guards import StampError
from .trace_record import Recording, call_key, log, record, site
from .trace_stamp import stamp

_RECORDING_TRIES = 3
_FRAME_ATTR = "_dynamo_ext_block_recordings"


@dataclasses.dataclass
class _FrameRecordings:
    """One frame trace's recordings (a key's value is None once refused) and how often each key was refused.

    NOTE [recordings live on the graph]: a recording holds nodes of the root graph Dynamo is building, and a node
    holds its graph, so a table keyed weakly by the graph would keep every graph alive through its own values.
    The table is an attribute of that graph instead and goes with it.
    """

    recordings: dict[tuple[Any, ...], Recording | None] = dataclasses.field(default_factory=dict)
    refusals: dict[tuple[Any, ...], int] = dataclasses.field(default_factory=dict)


def _frame_recordings(graph: torch.fx.Graph) -> _FrameRecordings:
    """The recordings of the frame whose root graph is ``graph`` (NOTE [recordings live on the graph])."""
    state = graph.__dict__.get(_FRAME_ATTR)
    if state is None:
        state = _FrameRecordings()
        setattr(graph, _FRAME_ATTR, state)
    return state


def _container_item(tx: Any, module_vt: Any) -> Any:
    """The block's source when ``module_vt`` is an item of a module container (``ModuleList``, ``ModuleDict``,
    ``Sequential``); else None."""
    source = getattr(module_vt, "source", None)
    if source is None:
        return None
    base = _compat.container_item_base(source)
    if base is None:
        return None
    try:
        container = _compat.source_value(tx, base)
    except Exception:
        return None
    if not isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
        return None
    return source


def call(tx: Any, module_vt: Any, args: list[Any], kwargs: dict[str, Any], trace: Any) -> Any:
    """``module_vt(*args, **kwargs)``: stamped from a recording of an identical block, or ``trace()``d.

    ``trace`` runs Dynamo's own inlining of the call; NOTE [blocks traced once].
    """
    # Graph deduplication (block reuse, NOTE [block reuse]) finds its regions by the instruction that made each
    # node: a stamped node has none of its own, so under it every block is traced.
    stamping = config.trace_blocks_once and not _compat.tracks_nodes_for_deduplication()
    source = _container_item(tx, module_vt) if stamping else None
    if source is None or _compat.inside_higher_order_op(tx):
        return trace()
    module = module_vt.value
    try:
        # The call reads its arguments anyway: realizing them here adds no guard the trace would not.
        arguments, leaves = call_key([a.realize() for a in args], {k: v.realize() for k, v in kwargs.items()})
        # which arguments are one tensor, share storage or are reachable otherwise: NOTE [a stamp keeps its
        # arguments' aliasing] in trace_aliasing.py
        key = (type(module), arguments, site(tx), trace_aliasing.pattern(tx.output, leaves))
    except StampError as why:
        log.debug("%s traced: %s", _compat.source_name(source), why)
        return trace()
    frame = _frame_recordings(tx.output.root_tracer.graph)
    recordings = frame.recordings
    recording = recordings.get(key)
    if recording is not None:
        try:
            return stamp(tx, recording, module_vt, source, leaves)
        except StampError as why:
            log.debug("%s traced, the recording of %s not used: %s", _compat.source_name(source), recording.path, why)
            return trace()
    refused = frame.refusals
    if key in recordings:
        # Refused for something of that block's own (a pending mutation): the next one may record.  A few tries,
        # then every such call is traced without the cost of recording.
        refused[key] = refused.get(key, 0) + 1
        if refused[key] >= _RECORDING_TRIES:
            return trace()
    _log_aliasing_apart(source, key, recordings)
    return record(tx, module_vt, source, leaves, trace, recordings, key)


def _log_aliasing_apart(source: Any, key: tuple[Any, ...], recordings: dict[tuple[Any, ...], Any]) -> None:
    """Say why a call is recorded although a recording of the same block, arguments and site exists: its
    arguments alias otherwise (NOTE [a stamp keeps its arguments' aliasing])."""
    for other, rec in recordings.items():
        if rec is not None and other[:3] == key[:3]:
            log.debug(
                "%s recorded apart from %s: its arguments alias otherwise (%s; there: %s)",
                _compat.source_name(source),
                rec.path,
                trace_aliasing.describe(key[3]),
                trace_aliasing.describe(other[3]),
            )
            return


def install(patches: Patcher) -> None:
    """Route calls of module-container items through :func:`call` (NOTE [blocks traced once])."""
    if not (_compat.block_trace_supported() and _compat.automatic_dynamic_supported()):
        log.info("blocks traced once: not on this torch release (a Dynamo API it needs is missing)")
        return
    _compat.install_block_trace(patches, call)
    _compat.install_scalar_log(patches)  # NOTE [a stamp keeps Dynamo's automatic dynamic] in trace_record.py
