"""Private torch APIs and the differences between torch releases, one module per torch subsystem.

Supported: torch 2.11 to 2.15.  Each difference between releases is a feature
probe here (an import attempt, ``hasattr``, a signature or behaviour check),
never a version-string comparison, so a point release that back-ports a
feature is handled too; each probe's docstring says what it probes and which
releases have it where known.

Every public name of its modules (each module's ``__all__``) is re-exported here, where callers read it
(``_compat.has_functional_op``) and tests patch it.  Importing it imports ``torch._dynamo`` (:mod:`.dynamo`); other modules load on first use.

- :mod:`.dynamo`, :mod:`.autograd_compiler`: trackers, builders, sources, guards, frames, the lock; compiled autograd.
- :mod:`.frame_state`: the traced frame's state read and added to directly (side effects, inputs, guards).
- :mod:`.automatic_dynamic`: the frame's automatic-dynamic record of the scalars it met, read and added to.
- :mod:`.aot`: AOTAutograd (partitioner, input fakification, checkpointing).
- :mod:`.caches`: AOTAutograd's cache entries; Dynamo's precompile packages.
- :mod:`.tracing`, :mod:`.structured_logs`: fake tensors, shapes, dispatch modes, op metadata; logged graphs.
- :mod:`.inductor`: Inductor config, lowerings, IR, post-grad passes, comm cost model.
- :mod:`.distributed`: c10d (functional collectives, process groups, store), DDP and DDPOptimizer.
- :mod:`.dtensor`, :mod:`.fsdp`, :mod:`.symm_mem`: DeviceMesh and DTensor, FSDP2, symmetric memory internals.
- :mod:`.probes`, :mod:`.releases`: ``optional_attr``, config modules; the verified release.
"""

from __future__ import annotations

from . import (
    aot,
    autograd_compiler,
    automatic_dynamic,
    caches,
    distributed,
    dtensor,
    dynamo,
    frame_state,
    fsdp,
    inductor,
    probes,
    structured_logs,
    symm_mem,
    tracing,
)
from .aot import *  # noqa: F403
from .autograd_compiler import *  # noqa: F403
from .automatic_dynamic import *  # noqa: F403
from .caches import *  # noqa: F403
from .distributed import *  # noqa: F403
from .dtensor import *  # noqa: F403
from .dynamo import *  # noqa: F403
from .frame_state import *  # noqa: F403
from .fsdp import *  # noqa: F403
from .inductor import *  # noqa: F403
from .probes import *  # noqa: F403
from .structured_logs import *  # noqa: F403
from .symm_mem import *  # noqa: F403
from .tracing import *  # noqa: F403

__all__: list[str] = []
__all__ += aot.__all__
__all__ += autograd_compiler.__all__
__all__ += automatic_dynamic.__all__
__all__ += caches.__all__
__all__ += distributed.__all__
__all__ += dtensor.__all__
__all__ += dynamo.__all__
__all__ += frame_state.__all__
__all__ += fsdp.__all__
__all__ += inductor.__all__
__all__ += probes.__all__
__all__ += structured_logs.__all__
__all__ += symm_mem.__all__
__all__ += tracing.__all__
