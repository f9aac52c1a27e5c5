"""One function per kind of graph break Dynamo has (torch 2.11-2.15), each breaking on a marked line.

tests/test_audit.py audits each in-process and checks the break's gb_type,
file:line and source; keep the BREAK_* comments on the breaking lines.
"""

import contextlib

import torch


def data_dependent_branch(x):
    x = x * 2
    if x.sum() > 0:  # BREAK_DATA_DEPENDENT
        x = x + 1
    return x.relu()


def unsupported_call(x):
    x = x * 2
    print("unsupported_call")  # BREAK_UNSUPPORTED_CALL
    return x + 1


def skipped_frame(x):
    for _ in range(2):
        x = x + 1
        print("skipped_frame")  # BREAK_SKIPPED_FRAME
    return x


@torch._dynamo.disable
def _not_compiled(x):
    return x + 1


def disabled(x):
    x = x * 2
    x = _not_compiled(x)  # BREAK_DISABLED
    return x + 1


@contextlib.contextmanager
def _generic_context():
    yield


def generic_context_manager(x):
    with _generic_context():
        x = x * 2
        print("generic_context_manager")  # BREAK_GENERIC_CONTEXT
    return x


def _scaled(x, n):
    return x * n  # BREAK_RECOMPILE_LIMIT


def recompile_limit(x):
    """Dynamo skips this frame (a break in a loop); each call of ``_scaled`` with a new ``n`` recompiles it."""
    for n in range(4):
        print("recompile_limit")  # BREAK_LOOP_OF_RECOMPILE_LIMIT
        x = _scaled(x, n)
    return x
