"""Cache keys that stay the same across launches for graphs with ``DeviceMesh`` inputs.

NOTE [device meshes in the cache key]
Where Dynamo passes a ``DeviceMesh`` to the graph as an opaque input (torch 2.12
and 2.13 register it with ``register_opaque_type``), AOTAutograd's and
Inductor's cache picklers (``AOTAutogradCachePickler``, a subclass of
``FxGraphCachePickler``) pickle the mesh object itself into the key: the state
``DeviceMesh.__getstate__`` returns, its ``__dict__``.  Once the mesh has been
hashed (DTensor hashes the meshes of the specs it propagates shardings for, so
every TP sub-mesh has been) that dict holds ``_hash``, the cached ``hash()`` of a
tuple with the axis names in it.  String hashes are randomized per process, so
the same graph gets another key in each launch and a restarted job misses
AOTAutograd's cache; 1-D FSDP2 meshes, never hashed, kept ``_hash = None`` and hit.

While the plugin is installed the picklers store a mesh as pickle does by
default (its class, then its state: same bytes for a mesh never hashed) but with
the state less ``_hash`` (``_compat.mesh_state_for_cache_key``).  ``_hash`` is a
function of the layout, rank map, device type, axis names and thread id, which
all stay in the key, as do the rank, the coordinates, the per-axis group names
and the root mesh: another mesh shape, other ranks in a sub-mesh, another axis
order or another process group still gives another key.  Graphs compiled
without the plugin's trackers (stock ones) get the same stable key while the
plugin is installed.  The collective check's records key off the key computed
here (NOTE [collective records beside AOTAutograd's cache]), unchanged.
"""

from __future__ import annotations

import copyreg
import functools
import logging
from collections.abc import Callable
from typing import Any

from . import _compat
from ._patching import Patcher

log = logging.getLogger(__name__)


def reduce_mesh_for_cache_key(mesh: Any) -> tuple[Any, ...]:
    """The ``__reduce__`` tuple the cache picklers store a ``DeviceMesh`` as: class, no arguments, the state
    less ``_hash`` (NOTE [device meshes in the cache key]).  Nested meshes in the state (the root mesh,
    flattened meshes) go through the pickler again, so they are reduced the same way."""
    # what pickle writes for an object by default: NEWOBJ of the class, then BUILD with the state
    newobj = copyreg.__newobj__  # pyright: ignore[reportAttributeAccessIssue]  (defined, not in typeshed)
    return (newobj, (type(mesh),), _compat.mesh_state_for_cache_key(mesh))


def _stable_meshes(original: Callable[..., Any]) -> Callable[..., Any]:
    from torch.distributed.device_mesh import DeviceMesh

    @functools.wraps(original)
    def reducer_override(self: Any, obj: Any) -> Any:
        if isinstance(obj, DeviceMesh):
            return reduce_mesh_for_cache_key(obj)
        return original(self, obj)

    return reducer_override


def install(patches: Patcher) -> None:
    """Make the cache picklers store meshes without their per-process hash (NOTE [device meshes in the cache
    key]); nothing when torch's pickler has no ``reducer_override`` of its own."""
    pickler = _compat.cache_key_pickler_class()
    if pickler is None:
        log.debug("cache key pickler without reducer_override: DeviceMesh inputs keep torch's cache key")
        return
    patches.setattr(pickler, "reducer_override", _stable_meshes(pickler.__dict__["reducer_override"]))
