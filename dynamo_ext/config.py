"""dynamo-ext settings, a torch config module (``torch.utils._config_module``).

Read and set them as attributes (``dynamo_ext.config.collective_check = False``)
or for a block with ``dynamo_ext.config.patch(collective_check=False)`` (also a
decorator).  Environment variables give the defaults:

* ``DYNAMO_EXT_COLLECTIVE_CHECK=0`` switches the collective-stream check off
  (NOTE [collective stream check]); collective buckets then run unmerged
  (NOTE [buckets only where ranks agree]);
* ``DYNAMO_EXT_COLLECTIVE_CHECK_TIMEOUT=<seconds>`` sets how long a rank waits
  for the others at a check;
* ``DYNAMO_EXT_DDP_SPLIT=1`` splits a DDP model's compiled-autograd backward at its
  gradient buckets (NOTE [split for overlap under DDP]);
* ``DYNAMO_EXT_BLOCK_REUSE=1`` compiles identical blocks once inside the one graph
  (NOTE [block reuse]).
"""

import os
import sys
from typing import TYPE_CHECKING

from ._compat import config_module

if TYPE_CHECKING:
    # patch(), get_hash(), load_config() ...: what install_config_module adds at run time, typed the way torch's
    # own config modules type them (a stub-only module, never imported at run time)
    from torch.utils._config_typing import *  # noqa: F403  # pyright: ignore[reportMissingModuleSource, reportWildcardImportFromLibrary]

_install_config_module, _Config = config_module()


def _seconds_from_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected a positive number of seconds, for example {name}={default:g}")
    return value


collective_check: bool = _Config(default=True, env_name_default="DYNAMO_EXT_COLLECTIVE_CHECK")
"""Before a compiled graph with collectives first runs, compare its collective sequence (forward and
backward) across the ranks of its groups and raise ``dynamo_ext.CollectiveMismatchError`` on a difference."""

collective_check_timeout_s: float = _seconds_from_env("DYNAMO_EXT_COLLECTIVE_CHECK_TIMEOUT", 300.0)
"""Seconds a rank waits at a graph's first run for a peer that has not arrived (it may still be compiling:
keep this above the longest compile); the default group's timeout caps it.  Mismatches between ranks that
both arrive are reported at once."""

ddp_split_for_overlap: bool = _Config(default=False, env_name_default="DYNAMO_EXT_DDP_SPLIT")
"""Opt-in: cut the compiled-autograd backward of a ``DistributedDataParallel`` model using DDP's python reducer
(``torch._dynamo.config.optimize_ddp = "python_reducer"``) at gradient-bucket boundaries, so each bucket's
all-reduce overlaps the rest of the backward (NOTE [split for overlap under DDP]).  Off by default: on the
2-core CPU gloo benchmark it was slower than one graph (benchmarks/README.md)."""

block_reuse: bool = _Config(default=False, env_name_default="DYNAMO_EXT_BLOCK_REUSE")
"""Opt-in: regions of a compiled graph that repeat (the compute of identical FSDP2 blocks) become one subgraph
called by ``invoke_subgraph`` at each place, so AOTAutograd traces and Inductor compiles it once (NOTE [block
reuse]).  Collectives, DTensor code and higher-order ops stay in the outer graph.  Off by default:
docs/compile_time.md has the measurements."""

compile_blocks_once: bool = _Config(default=True, env_name_default="DYNAMO_EXT_COMPILE_BLOCKS_ONCE")
"""Cut each forward graph the plugin traces at the boundaries of its repeated blocks (the items of its longest
module container) and compile each distinct block once with the backend, reusing that compile for every
identical block (NOTE [blocks compiled once]).  One Dynamo graph, one set of guards; AOTAutograd and Inductor
pay for one block whatever the depth.  Applies to ``inductor`` and the AOTAutograd backends (``aot_eager``, ...);
``False`` (or ``DYNAMO_EXT_COMPILE_BLOCKS_ONCE=0``) hands them the graph whole."""

trace_blocks_once: bool = _Config(default=True, env_name_default="DYNAMO_EXT_TRACE_BLOCKS_ONCE")
"""Dynamo traces the first of a container's identical blocks (``layers[0]``) and stamps the nodes and guards of
that trace out for each identical block after it, in place of tracing it (NOTE [blocks traced once]): the graph and
guards are those tracing gives, and a block that differs in any guarded way is traced.  ``False`` (or
``DYNAMO_EXT_TRACE_BLOCKS_ONCE=0``) traces every block."""

aliasing_guards_in_cpp: bool = _Config(default=True, env_name_default="DYNAMO_EXT_ALIASING_GUARDS_IN_CPP")
"""While the plugin compiles a frame, Dynamo builds its object-aliasing guards (``a is b``) as C++ relational
guards, not as one Python lambda (``torch._dynamo.config.use_lamba_guard_for_object_aliasing`` reads False):
about a third less guard-building time on FSDP2 models, the same guard-evaluation time (NOTE [object-aliasing
guards in C++]).  ``False`` (or ``DYNAMO_EXT_ALIASING_GUARDS_IN_CPP=0``) leaves Dynamo's switch as it is."""

outline_aot_backward: bool = _Config(default=True, env_name_default="DYNAMO_EXT_OUTLINE_AOT_BACKWARD")
"""Dynamo traces each AOTAutograd backward graph compiled autograd copies into its graph as one call, and puts
the graph's nodes back in its place before the backend (NOTE [AOT backward copies traced as one call]): the
backend gets the graph tracing op by op gives.  ``False`` (or ``DYNAMO_EXT_OUTLINE_AOT_BACKWARD=0``) traces those
copies op by op."""

reuse_block_compiles: bool = True
"""With ``compile_blocks_once``: a block identical to one already compiled runs that compile.  ``False`` cuts
the graph at the same places and compiles every block, so each logs its own graphs on the structured trace:
what ``dynamo-ext audit`` sets (NOTE [the audit compiles each block])."""

_install_config_module(sys.modules[__name__])
