"""A pytest fixture with the CLI's gate: ``dynamo_audit``.

Register it in a conftest.py (``pytest_plugins = ["dynamo_ext.audit.pytest_plugin"]``),
on the command line (``pytest -p dynamo_ext.audit.pytest_plugin``), or import
the fixture into a test module (``from dynamo_ext.audit.pytest_plugin import dynamo_audit``).

    def test_step_compiles_whole(dynamo_audit):
        dynamo_audit(step, x, backend="aot_eager", max_breaks=0, max_recompiles=0)

    def test_training_script(dynamo_audit):
        dynamo_audit.run("examples/train.py", nproc=2, max_breaks=3, baseline="tests/audit_baseline.json")

A call fails the test (with the report in the message) when a budget is
exceeded, a break the baseline lacks appears, a graph's collectives differ
across ranks, the numerics check (``check_numerics=``) finds a tensor that
differs between the compiled and the eager step, or, for ``run``, a rank fails;
it returns the :class:`~dynamo_ext.audit.AuditReport` otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from .api import audit
from .gate.diff import gate
from .model.io import load_report
from .model.records import AuditReport


class AuditGate:
    """The fixture's value: call it for an in-process audit, ``.run`` for a multi-rank one."""

    def _check(
        self,
        report: AuditReport,
        max_breaks: int | None,
        max_recompiles: int | None,
        baseline: str | None,
        max_hang_risks: int | None = 0,
        comm_budget: int | None = None,
    ) -> AuditReport:
        problems = list(report.errors)
        problems += gate(
            report,
            max_breaks=max_breaks,
            max_recompiles=max_recompiles,
            baseline=load_report(baseline) if baseline else None,
            max_hang_risks=max_hang_risks,
            max_comm_bytes=comm_budget,
        )
        if problems:
            pytest.fail(
                "dynamo-ext audit gate failed:\n  " + "\n  ".join(problems) + "\n\n" + str(report), pytrace=False
            )
        return report

    def __call__(
        self,
        fn: Any,
        *args: Any,
        max_breaks: int | None = 0,
        max_recompiles: int | None = None,
        baseline: str | None = None,
        check_numerics: Any = None,
        rtol: float | None = None,
        atol: float | None = None,
        comm_budget: int | None = None,
        **compile_kwargs: Any,
    ) -> AuditReport:
        """Audit ``torch.compile(fn, **compile_kwargs)(*args)`` in this process; fail the test past the budgets.

        ``check_numerics``: a ``make_step`` callable; a tensor that differs between
        its compiled and eager step fails the test (see :func:`.api.audit`).
        ``comm_budget``: bytes the compiled graphs' collectives may send per rank (as ``--comm-budget``).
        """
        report = audit(fn, *args, check_numerics=check_numerics, rtol=rtol, atol=atol, **compile_kwargs)
        return self._check(report, max_breaks, max_recompiles, baseline, comm_budget=comm_budget)

    def run(
        self,
        target: str,
        args: Sequence[str] = (),
        *,
        nproc: int = 2,
        backend: str | None = None,
        plugin: bool = True,
        timeout: float = 300.0,
        max_breaks: int | None = 0,
        max_recompiles: int | None = None,
        baseline: str | None = None,
        max_hang_risks: int | None = 0,
        check_numerics: bool = False,
        rtol: float | None = None,
        atol: float | None = None,
        comm_budget: int | None = None,
        steps: int | None = None,
    ) -> AuditReport:
        """``dynamo-ext audit`` on ``nproc`` ranks (script path, module:function or script.py:function), with the
        same gate.

        ``check_numerics``: as ``--check-numerics`` (the target defines ``make_step()``);
        ``comm_budget``: as ``--comm-budget``; ``steps``: as ``--steps`` (a target function returning a step).
        """
        from .launch import run_ranks

        report = run_ranks(
            target,
            list(args),
            nproc=nproc,
            backend=backend,
            plugin=plugin,
            timeout=timeout,
            check_numerics=check_numerics,
            rtol=rtol,
            atol=atol,
            steps=steps,
        )
        return self._check(report, max_breaks, max_recompiles, baseline, max_hang_risks, comm_budget)


@pytest.fixture
def dynamo_audit() -> AuditGate:
    """Audit a function or a multi-rank program and fail the test past a break/recompile budget."""
    return AuditGate()
