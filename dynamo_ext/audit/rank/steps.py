"""Training steps on a rank: the audit trains a target's ``make_step()`` itself, or counts the target's own steps.

NOTE [the audit drives the step]
A TARGET that names a function returning a :class:`.numerics.Step` (``pkg.train:make_step``,
``train.py:make_step``) hands the audit its training step: the audit builds it once (the call) and runs
``--steps N`` training steps with it (default :data:`DEFAULT_STEPS`), each ``step(True)``, the optimizer's
and the LR scheduler's step (:func:`.numerics.run_step`), every compile, break and recompile stamped with
the step it happened in (NOTE [steps] in ``schema/events.py``).  Three, because most recompiles a training
loop causes appear after its first step: in step 2, on what step 1 left behind (optimizer state made lazily,
FSDP2's lazy initialization, module state an eager pass changed between steps, a Python number that changed,
which Dynamo then makes dynamic), and in step 3, on what only the second step changes.

With ``--check-numerics`` nothing is built twice (NOTE [one build, saved state] in :mod:`.state`): the state
before each compiled step is saved and the step's outputs, gradients and parameters after the optimizer step
are kept; then, for each step, its saved state is put back and the step runs eagerly (the first one counted by
``CommDebugMode`` for the communication report), and the two are compared.  Each eager step starts from the
state its compiled step started from, not from the eager step before it: a compiled step that differs from
eager in its last bits (a fused eager kernel whose compiled decomposition sums in another order) would
otherwise make every later step differ more (AdamW turns a gradient near 0 of the other sign into a step of
the other sign), and a step's own difference would be lost in the ones before it.  It costs a copy of the
parameters, buffers and optimizer state per step.

A target that runs its own loop (a script, a ``module:function`` that returns nothing) is not driven: its
steps are counted by its optimizer (:class:`OptimizerSteps`): the first outermost ``optimizer.step()`` ends
step 1 (a container optimizer whose ``step()`` steps others, as torchtitan's ``OptimizersContainer``, counts
once; the eager reference step of a ``check_step`` the target calls does not count).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from . import state
from .numerics import Run, Step, compare_runs, is_aside, run_step

log = logging.getLogger(__name__)

DEFAULT_STEPS = 3


@dataclasses.dataclass
class Trained:
    """What :func:`train` leaves for :func:`check`: the step, the state before step 1, the compiled runs."""

    spec: Step
    steps: int
    saved: list[state.SavedState]
    compiled: list[Run]
    first: int = 1


def train(spec: Step, steps: int, collector: Any, *, keep: bool, first: int = 1) -> Trained:
    """``steps`` compiled training steps of ``spec``, ``collector.step`` set to each one's number (from ``first``).

    ``keep``: save the state before each step and keep its outputs, gradients and parameters (for :func:`check`).
    """
    saved = []
    comm = getattr(collector, "comm", None)
    if comm is not None:
        comm.root_module = spec.model  # modules named from the step's model (NOTE [module names by identity])
    runs = []
    for number in range(first, first + steps):
        collector.step = number
        log.info("audit: training step %d, compiled (%d of %d)", number, number - first + 1, steps)
        if keep:
            saved.append(state.save(spec.model, spec.optimizer, spec.lr_scheduler))
        run = run_step(spec, compiled=True, capture=keep)
        if run is not None:
            runs.append(run)
    return Trained(spec, steps, saved, runs, first)


def check(trained: Trained, rtol: float | None, atol: float | None) -> dict[str, Any]:
    """Each step eagerly from the state its compiled step started from, compared with it (NOTE [the audit drives
    the step]).

    Returns the ``numerics`` event's fields: ``compared``, ``mismatches`` (with ``step`` when more than one step),
    ``eager_comm`` (the first eager step's collectives, :func:`.eager_comm.count_eager`), ``steps`` and
    ``tolerances`` (the target's, in words, when ``rtol``/``atol`` do not replace them).
    """
    from .eager_comm import count_eager
    from .numerics import described_tolerances

    assert len(trained.saved) == trained.steps, "train(..., keep=True) saves the state check() starts from"
    spec = trained.spec
    counts: dict[str, Any] = {}
    eager = []
    for i, saved in enumerate(trained.saved):
        log.info("audit: training step %d, eager, from the compiled step's state", trained.first + i)
        state.restore(saved, spec.model, spec.optimizer, spec.lr_scheduler)
        if i == 0:  # the communication report compares the first step's graphs with it
            with count_eager(counts):
                run = run_step(spec, compiled=False)
        else:
            run = run_step(spec, compiled=False)
        assert run is not None
        eager.append(run)
    compared = compare_runs(eager, trained.compiled, rtol, atol, first=trained.first, tolerances=spec.tolerances)
    own = described_tolerances(spec.tolerances) if rtol is None else []
    return {**compared, "eager_comm": counts, "steps": trained.steps, "tolerances": own}


class OptimizerSteps:
    """Counts a target's own training steps by its optimizer: ``collector.step`` is 1 + the outermost
    ``optimizer.step()`` calls finished (torch's global optimizer step hooks; see NOTE [the audit drives the step]).
    """

    def __init__(self, collector: Any) -> None:
        self.collector = collector
        self.finished = 0
        self._depth = 0
        self._handles: list[Any] = []

    def __enter__(self) -> OptimizerSteps:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.collector.step = 1
        self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
        return self

    def _pre(self, *_: Any) -> None:
        if not is_aside():  # check_step's eager reference step is not one of the target's
            self._depth += 1

    def _post(self, *_: Any) -> None:
        if is_aside():
            return
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0:
            self.finished += 1
            self.collector.step = self.finished + 1

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
