"""``FunctionalWork``: what a traced ``async_op=True`` collective returns.

NOTE [async collectives in graphs]
A polyfill issues the functional collective (``_c10d_functional.all_reduce``
...) where the user calls ``dist.all_reduce(t, async_op=True)`` and returns a
``FunctionalWork`` holding the collective's output.  ``wait()`` emits
``_c10d_functional.wait_tensor`` and then copies the result into the user's
tensors (``copy_``), so the graph reads::

    all_reduce = torch.ops._c10d_functional.all_reduce(y, 'sum', '0')
    z = x * 3                      # compute the user put before wait()
    wait_tensor = torch.ops._c10d_functional.wait_tensor(all_reduce)
    copy_ = y.copy_(wait_tensor)

and the compute in between may overlap with the communication.  Until
``wait()`` the user's tensor keeps its old value, which eager leaves
unspecified, and ``is_completed()`` is ``False``; afterwards ``True``.  A
synchronous call is the same object waited on at once.

Dynamo traces this class like any user class.  When a work object leaves the
compiled frame unwaited (returned, stored), the collective's output is a graph
output and ``wait()`` runs eagerly after the graph: ``wait_tensor`` then waits
on the in-flight collective, as funcol's ``AsyncCollectiveTensor`` does.  It
is not a ``torch.distributed.Work`` (``isinstance`` is ``False``), and
``get_future()`` is a graph break: a future cannot be recorded in a graph.

NOTE [keep-alive]
AOTAutograd's default partitioner (the ``aot_eager`` backend's) builds the
forward and backward graphs of a training graph from their outputs, so a
collective whose waited result feeds no output is dropped, although
``wait_tensor`` is side-effectful in FX (Inductor's min-cut partitioner keeps
it).  Where only some ranks use the result (a send, a gather's leaves, a
reduce's non-destination ranks, a broadcast's root, a barrier) the others
would then wait forever.  Such works therefore "use" their result: a
one-byte token per device (a global tensor, so a graph input) is
incremented by a byte of the result (:func:`keep_alive`), and AOTAutograd
keeps input mutations.  Collectives every rank uses alike (all_reduce, ...)
are left as the user wrote them.
"""

from __future__ import annotations

from typing import Any

import torch

from .args import KeepAliveTokens, keep_alive_token
from .breaks import untraceable


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``_c10d_functional.wait_tensor``: the point where a collective's output becomes readable."""
    return torch.ops._c10d_functional.wait_tensor(tensor)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a collective's input: detached when it requires grad.

    Eager c10d collectives are invisible to autograd (the tensor keeps its
    ``grad_fn``; no gradient flows through the communication), while some
    releases register a backward for the functional ops: detaching, and
    writing results back under ``no_grad`` (:func:`copy_into`), keeps eager's
    gradients.  ``torch.distributed.nn.functional`` is the differentiable API.
    """
    return t.detach() if t.requires_grad else t


def _write(out: torch.Tensor, value: torch.Tensor) -> None:
    if out.requires_grad:
        with torch.no_grad():
            out.copy_(value)
    else:
        out.copy_(value)


def keep_alive(result: torch.Tensor) -> None:
    """Make a graph output depend on ``result`` at the cost of a one-byte read (NOTE [keep-alive])."""
    token = getattr(KeepAliveTokens, keep_alive_token(result.device))
    token.add_(result.reshape(-1)[:1].view(torch.uint8).sum())


def copy_into(result: torch.Tensor, outputs: list[torch.Tensor], start: int = 0) -> None:
    """Copy a waited collective ``result`` into ``outputs``, which tile it in order from element ``start``.

    One output of the same size takes it whole (viewed to its shape, so a
    ``(world, n)`` output of an all-gather of ``n`` works); ``k`` outputs of
    ``result[i]``'s shape take ``result[0..k)``; otherwise outputs take
    consecutive runs of ``result``'s elements.
    """
    if start == 0 and len(outputs) == 1 and outputs[0].numel() == result.numel():
        out = outputs[0]
        _write(out, result if result.shape == out.shape else result.view(out.shape))
        return
    rows = result.dim() > 0 and result.shape[0] == len(outputs)
    if start == 0 and rows and all(o.shape == result.shape[1:] for o in outputs):
        for i, out in enumerate(outputs):
            _write(out, result[i])
        return
    flat = result.reshape(-1)
    offset = start
    for out in outputs:
        n = out.numel()
        _write(out, flat[offset : offset + n].view(out.shape))
        offset += n


class FunctionalWork:
    """A ``torch.distributed.Work`` look-alike for collectives traced as functional ops.

    ``pending[i]`` is a functional collective's (unwaited) output and
    ``outputs[i]`` the user tensors it is copied into on ``wait()`` (empty for
    sends and barriers), from element ``start`` of it on.  ``source`` is the
    sender's global rank for a receive; ``keep`` marks a collective that only
    some ranks use (NOTE [keep-alive]).
    """

    def __init__(
        self,
        pending: list[torch.Tensor],
        outputs: list[list[torch.Tensor]],
        *,
        source: int | None = None,
        start: int = 0,
        keep: bool = False,
    ) -> None:
        self._pending = pending
        self._outputs = outputs
        self._source = source
        self._start = start
        self._keep = keep
        self._completed = False

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the collective and write its result into the user's tensors; ``True``.

        ``timeout`` is accepted for signature compatibility; the group's own
        timeout applies (a graph cannot time out one op).
        """
        if not self._completed:
            for pending, outputs in zip(self._pending, self._outputs):
                result = wait_tensor(pending)
                if outputs:
                    copy_into(result, outputs, self._start)
                if self._keep:
                    keep_alive(result)
            self._completed = True
        return True

    def synchronize(self) -> None:
        """Same as ``wait()`` (on CPU and, for functional collectives, on GPU streams too)."""
        self.wait()

    def is_completed(self) -> bool:
        """``True`` once ``wait()`` has run (before that eager's answer depends on timing)."""
        return self._completed

    def is_success(self) -> bool:
        """``True`` once completed: a failed collective raises from ``wait()`` instead."""
        return self._completed

    def exception(self) -> None:
        """Always ``None``: failures raise from the graph."""
        return None

    def result(self) -> list[torch.Tensor]:
        """Wait, then return the user's output tensors (eager's ``Work.result()``)."""
        self.wait()
        return [t for outputs in self._outputs for t in outputs]

    def source_rank(self) -> int:
        """The global rank a receive came from."""
        if self._source is None:
            raise RuntimeError("source_rank() is only available for receives (dist.irecv / dist.recv)")
        return self._source

    def get_future(self) -> Any:
        untraceable("Work.get_future()", "a future cannot be recorded in a graph; call wait() instead")

    def __repr__(self) -> str:
        state = "completed" if self._completed else "pending"
        return f"FunctionalWork({len(self._pending)} collective(s), {state})"


def finish(work: FunctionalWork, async_op: bool) -> FunctionalWork | None:
    """What a c10d call returns: the work for ``async_op=True``, else ``None`` after waiting."""
    if async_op:
        return work
    work.wait()
    return None
