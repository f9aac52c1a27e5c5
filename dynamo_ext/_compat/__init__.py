"""Private torch APIs and the differences between torch releases, one module per torch subsystem.

Supported: torch 2.11 to 2.15.  Each difference between releases is a feature
probe here (an import attempt, ``hasattr``, a signature or behaviour check),
never a version-string comparison, so a point release that back-ports a
feature is handled too; each probe's docstring says what it probes and which
releases have it where known.

Every public name of its modules (each module's ``__all__``) is re-exported here, where callers read it
(``_compat.has_functional_op``) and tests patch it.  Importing it imports ``torch._dynamo`` (:mod:`.dynamo`); other modules load on first use.

- :mod:`.dynamo`, :mod:`.compiled_autograd`: trackers, builders, sources, guards, frames, the lock; compiled autograd.
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

from .aot import *  # noqa: F403
from .aot import __all__ as _aot
from .automatic_dynamic import *  # noqa: F403
from .automatic_dynamic import __all__ as _automatic_dynamic
from .caches import *  # noqa: F403
from .caches import __all__ as _caches
from .compiled_autograd import *  # noqa: F403
from .compiled_autograd import __all__ as _compiled_autograd
from .distributed import *  # noqa: F403
from .distributed import __all__ as _distributed
from .dtensor import *  # noqa: F403
from .dtensor import __all__ as _dtensor
from .dynamo import *  # noqa: F403
from .dynamo import __all__ as _dynamo
from .frame_state import *  # noqa: F403
from .frame_state import __all__ as _frame_state
from .fsdp import *  # noqa: F403
from .fsdp import __all__ as _fsdp
from .inductor import *  # noqa: F403
from .inductor import __all__ as _inductor
from .probes import *  # noqa: F403
from .probes import __all__ as _probes
from .structured_logs import *  # noqa: F403
from .structured_logs import __all__ as _structured_logs
from .symm_mem import *  # noqa: F403
from .symm_mem import __all__ as _symm_mem
from .tracing import *  # noqa: F403
from .tracing import __all__ as _tracing

__all__ = [
    *_aot,
    *_automatic_dynamic,
    *_caches,
    *_compiled_autograd,
    *_distributed,
    *_dtensor,
    *_dynamo,
    *_frame_state,
    *_fsdp,
    *_inductor,
    *_probes,
    *_structured_logs,
    *_symm_mem,
    *_tracing,
]
