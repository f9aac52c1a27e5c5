"""A watchdog for fused-kernel runs on one GPU: ends a stuck run and prints each simulated rank's barrier state.

Used by ``scripts/gpu_check.sh``'s phases (the race test, the benchmark sweep, and through
``gpu_check_pytest.py`` the GPU-gated tests).

NOTE [gpu_check watchdog]
The fused kernels spin in cross-rank barriers (NOTE [one-shot barrier] in
``_one_shot_all_reduce_rms_norm_kernel.py``).  A barrier bug, or W ranks whose programs
are not all resident on the one device, shows as a kernel that never ends; the host then
waits forever in a CUDA call (a synchronize, an ``.item()``), which releases the GIL.  A
daemon thread watches a heartbeat that the run beats after each unit of work; when no beat
came for ``timeout_s`` it prints, for every set of ranks registered with :meth:`Watchdog.watch`,
each rank's signal pad (which peers' programs raised which slots and still wait) and whether
its stream is idle, plus whatever the run's describers add (the call in flight on each
rank), then ends the process with ``os._exit`` (the driver tears the context down, and with
it the spinning kernels).  The pads are read on a side stream into pinned memory, in a
helper thread joined with a deadline: when the device queue is blocked too, the report says
the pads could not be read instead of hanging the watchdog itself.  Runs that poll events
(:func:`wait_events`) fire the same report without waiting for the heartbeat's timeout.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

HANG_EXIT_CODE = 3
"""Exit status of a process the watchdog ended for want of progress (the orchestrator reports ``hang``)."""
DEADLINE_EXIT_CODE = 4
"""Exit status of a process the watchdog ended at its phase's deadline (reported ``timed_out``, with the report)."""
DEADLINE_ENV = "GPU_CHECK_DEADLINE"
"""Wall-clock time (seconds since the epoch) at which a phase's watchdogs report and end it: set by the
orchestrator a little before it kills the phase, so a run stuck near the end still reports its ranks' state."""

READ_TIMEOUT_S = 10.0


class _DevicePointer:
    """``n`` int32 at a raw device address, for ``torch.as_tensor`` (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i4", "data": (int(ptr), False), "version": 3}


def pad_tensors(peers: Any) -> list[Any]:
    """Every rank's signal pad of a ``PeerBuffers`` as int32 tensors (host-shared, in-process or symmetric memory).

    Only the slots the fused kernels use (``max_blocks * world_size``).
    """
    import torch

    n = peers.max_blocks * peers.world_size
    keep = peers.keepalive
    if len(keep) > 1 and isinstance(keep[1], list):  # in-process and host-shared: (buffers, pads, ...)
        return [p.view(torch.int32)[:n] if p.dtype == torch.uint8 else p[:n] for p in keep[1]]
    handle = keep[0] if keep else None
    ptrs = getattr(handle, "signal_pad_ptrs", None)
    if ptrs is None:
        raise TypeError(f"cannot find the signal pads of {type(handle).__name__}")
    return [torch.as_tensor(_DevicePointer(p, n), device="cuda") for p in ptrs]


def _read_in_thread(fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """``(True, fn())``, or ``(False, why)`` when it raised or did not return within ``timeout_s``."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except Exception as e:  # reported, never raised: the watchdog must finish its report
            box["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout_s)
    if "value" in box:
        return True, box["value"]
    return False, box.get("error", f"no answer within {timeout_s:.0f} s (the device queue is blocked)")


def read_pads(pads: list[Any], streams: list[Any] | None = None, *, timeout_s: float = READ_TIMEOUT_S) -> dict:
    """``{"pads": [[int, ...] per rank], "stream_idle": [bool per rank] or None}`` or ``{"error": why}``.

    CUDA pads are copied on a side stream into pinned memory and polled, in a thread joined
    after ``timeout_s`` (NOTE [gpu_check watchdog]); CPU pads are read directly.
    """

    def read() -> dict:
        import torch

        idle = [bool(s.query()) for s in streams] if streams else None
        if all(p.device.type == "cpu" for p in pads):
            return {"pads": [p.tolist() for p in pads], "stream_idle": idle}
        side = torch.cuda.Stream(device=pads[0].device)
        hosts = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in pads]
        with torch.cuda.stream(side):
            for h, p in zip(hosts, pads):
                h.copy_(p, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        while not done.query():
            time.sleep(0.005)
        return {"pads": [h.tolist() for h in hosts], "stream_idle": idle}

    ok, value = _read_in_thread(read, timeout_s)
    return value if ok else {"error": value}


def barrier_state(peers: Any, streams: list[Any] | None = None, *, timeout_s: float = READ_TIMEOUT_S) -> dict:
    """Each rank's raised signal slots: ``{"world_size", "max_blocks", "ranks": [{"rank", "stream_idle",
    "waiting": [[block, from_rank], ...]}]}`` (or ``"error"`` when the pads could not be read).

    A slot ``(block, q)`` raised in rank ``r``'s pad means rank ``q``'s program ``block`` reached a barrier
    and signalled ``r``, and rank ``r``'s program ``block`` has not taken the signal yet (it has not
    reached that barrier).  Zero everywhere after every complete collective.
    """
    w, blocks = peers.world_size, peers.max_blocks
    out: dict[str, Any] = {"world_size": w, "max_blocks": blocks}
    try:
        pads = pad_tensors(peers)
    except Exception as e:  # reported, never raised
        return {**out, "error": f"{type(e).__name__}: {e}"}
    read = read_pads(pads, streams, timeout_s=timeout_s)
    if "error" in read:
        return {**out, "error": read["error"]}
    ranks = []
    for r, pad in enumerate(read["pads"]):
        waiting = [[i // w, i % w] for i, v in enumerate(pad[: blocks * w]) if v != 0]
        idle = read["stream_idle"][r] if read["stream_idle"] else None
        ranks.append({"rank": r, "stream_idle": idle, "waiting": waiting})
    return {**out, "ranks": ranks}


def format_barrier_state(state: dict, label: str) -> str:
    """:func:`barrier_state` in words, one line per rank."""
    head = f"{label}: {state['world_size']} ranks, {state['max_blocks']} programs each"
    if "error" in state:
        return f"{head}; signal pads not readable: {state['error']}"
    lines = [head]
    for r in state["ranks"]:
        stream = {None: "", True: "stream idle; ", False: "stream busy; "}[r["stream_idle"]]
        if not r["waiting"]:
            lines.append(f"  rank {r['rank']}: {stream}pad clear")
            continue
        slots = ", ".join(f"program {b} <- rank {q}" for b, q in r["waiting"])
        lines.append(
            f"  rank {r['rank']}: {stream}signals not yet taken: {slots} "
            f"(those peers' programs wait in a barrier that rank {r['rank']}'s same program has not reached)"
        )
    return "\n".join(lines)


def ranks_state(ranks: Any, label: str, *, timeout_s: float = READ_TIMEOUT_S) -> str:
    """:func:`format_barrier_state` of an ``InProcessRanks`` (its input pads and its streams)."""
    return format_barrier_state(barrier_state(ranks.peers[0], ranks.streams or None, timeout_s=timeout_s), label)


class Watchdog:
    """Ends the process when no :meth:`beat` came for ``timeout_s`` (NOTE [gpu_check watchdog]), or at
    ``$GPU_CHECK_DEADLINE`` (:data:`DEADLINE_ENV`).

    ``on_fire(report)`` runs before the exit (a phase records the report in its JSON); ``exit``
    False only reports (tests).
    """

    def __init__(
        self, timeout_s: float, *, name: str, on_fire: Callable[[str], None] | None = None, exit: bool = True
    ) -> None:
        self.timeout_s = timeout_s
        self.name = name
        self.on_fire = on_fire
        self.exit = exit
        self.what: str | None = "start"
        self.last = time.monotonic()
        self.fired: str | None = None
        self.deadline = float(os.environ.get(DEADLINE_ENV, "inf"))
        self._watched: list[tuple[weakref.ref, str]] = []
        self._describers: list[Callable[[], str]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def beat(self, what: str) -> None:
        """Progress: ``what`` is running now; the deadline restarts (and the watchdog is armed)."""
        self.what, self.last = what, time.monotonic()

    def disarm(self) -> None:
        """Nothing to watch until the next :meth:`beat` (between tests)."""
        self.what = None

    def watch(self, obj: Any, label: str) -> None:
        """Report ``obj``'s barrier state if the run hangs (an ``InProcessRanks`` or a ``PeerBuffers``)."""
        self._watched = [(ref, lab) for ref, lab in self._watched if ref() is not None]
        self._watched.append((weakref.ref(obj), label))

    def describe_with(self, fn: Callable[[], str]) -> None:
        """Add ``fn()``'s text to the report (e.g. the call each rank is in)."""
        self._describers.append(fn)

    def forget(self) -> None:
        """Drop every watched object and describer (a run moving on to its next set of ranks)."""
        self._watched, self._describers = [], []

    def report(self, reason: str) -> str:
        """The text printed when the watchdog fires: the reason, the describers', every watched object's state."""
        parts = [f"WATCHDOG [{self.name}]: {reason}; in flight: {self.what}"]
        for fn in self._describers:
            ok, text = _read_in_thread(fn, READ_TIMEOUT_S)
            parts.append(text if ok else f"(describer failed: {text})")
        for ref, label in self._watched:
            obj = ref()
            if obj is None:
                continue
            if hasattr(obj, "peers") and hasattr(obj, "streams"):
                parts.append(ranks_state(obj, label))
            else:
                parts.append(format_barrier_state(barrier_state(obj), label))
        return "\n".join(parts)

    def fire(self, reason: str, *, code: int = HANG_EXIT_CODE) -> None:
        """Print the report, call ``on_fire``, end the process with status ``code``."""
        with self._lock:
            if self.fired is not None:
                return
            self.fired = self.report(reason)
        print(self.fired, file=sys.stderr, flush=True)
        print(self.fired, flush=True)
        if self.on_fire is not None:
            try:
                self.on_fire(self.fired)
            except Exception as e:  # the exit below must happen
                print(f"WATCHDOG: recording the report failed: {e}", file=sys.stderr, flush=True)
        if self.exit:
            os._exit(code)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            idle = time.monotonic() - self.last
            if self.what is not None and idle > self.timeout_s:
                self.fire(f"no progress for {idle:.0f} s (limit {self.timeout_s:.0f} s)")
                return
            if time.time() > self.deadline:
                self.fire("the phase's deadline came (its time is up, not necessarily a hang)", code=DEADLINE_EXIT_CODE)
                return

    def start(self) -> Watchdog:
        self.last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"watchdog-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_events(events: list[Any], *, timeout_s: float, watchdog: Watchdog | None, what: str) -> None:
    """Wait until every CUDA event in ``events`` completed, polling (never a blocking synchronize); past
    ``timeout_s`` fire ``watchdog`` (or raise TimeoutError without one)."""
    deadline = time.monotonic() + timeout_s
    pending = list(events)
    while pending:
        pending = [e for e in pending if not e.query()]
        if not pending:
            return
        if time.monotonic() > deadline:
            reason = f"{what}: {len(pending)} of {len(events)} events not done after {timeout_s:.0f} s"
            if watchdog is None:
                raise TimeoutError(reason)
            watchdog.fire(reason)
            raise TimeoutError(reason)  # only reached with exit=False
        time.sleep(0.0005)


class JsonPart:
    """A phase's results, rewritten whole (atomically) at every change so a killed phase keeps what it had."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def set(self, **values: Any) -> None:
        self.data.update(values)
        self.write()

    def append(self, key: str, row: Any) -> None:
        self.data.setdefault(key, []).append(row)
        self.write()

    def write(self) -> None:
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)
