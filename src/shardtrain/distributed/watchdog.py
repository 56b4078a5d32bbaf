"""Failures of collectives that do not block the host (NCCL): named by a watchdog thread, not left to NCCL's.

[Note: failures under NCCL]
On gloo a collective's ``wait()`` blocks the calling thread until the peers answer or the group's timeout fires. A
failure raises in that call, and the Communicator names the lost rank ([Note: naming the rank that vanished] in
:mod:`shardtrain.distributed.failure`). Under NCCL ``wait()`` only makes the current CUDA stream wait: the host runs
on, and a collective whose peer is gone never raises in Python. What ends the hang is NCCL's own watchdog thread,
which at the group's timeout aborts the communicators and, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` at torch's
default, kills the process. Its message names a work sequence number, not the rank that is gone, not what the
collective carried, and it comes only after the whole timeout even when the peer died at once.

So a Communicator whose backend does not block the host (:func:`blocks_host`) hands every collective it issues to
this module's :class:`Watchdog`: the ``Work`` (its ``is_completed()`` reads the collective's CUDA event without
waiting, from any thread), its kind, what it carried and when it was issued. One daemon thread per process looks at
the oldest collective that has not completed, every :data:`POLL_S`:

1. From :data:`PROBE_S` after its issue, it asks the rendezvous store, which does not go through NCCL, whether a
   peer of its group reported a failure or was recorded gone, and whether a peer's process on this machine is gone
   (:func:`shardtrain.distributed.failure.peer_down`: a few store reads, no collective, nothing written). A peer down
   ends the wait at once: :class:`~shardtrain.errors.PeerLostError`.
2. At the collective timeout (``collective_timeout_s``) it is a :class:`~shardtrain.errors.CollectiveTimeoutError`.

In both cases the thread makes the survey and the message of the gloo path (``Communicator.describe_failure``):
it writes this rank's failure to the store, so the other ranks' watchdogs find it at their next probe and name the
same lost rank. It prints the message to stderr and ends the process with :data:`EXIT_CODE` (``os._exit``). That is
what NCCL's watchdog would do a moment later, but with the message first. The main thread cannot be made to raise:
it may be blocked inside CUDA, waiting for the very kernel that waits for the lost peer.

Completed collectives leave the watchdog's queue at the next ``track`` or poll. A ``Work`` keeps its tensors
alive until it is released, so the queue must not hold finished ones: it holds about as many as the host runs ahead
of the GPU.

NCCL's watchdog stays as the backstop. The NCCL groups that shardtrain creates get a backend timeout of
``collective_timeout_s`` plus :func:`backend_margin_s`, so this watchdog reports first. A group the user created with a
timeout of exactly ``collective_timeout_s`` gets no margin. Then the two watchdogs race, and the process ends either
way.

Not covered: collectives inside captured graphs (functional collectives have no ``Work``), whose hang ends at NCCL's
timeout as before. None of this has run on NCCL with a lost peer on this project's machines. The thread's decisions
are tested with fake ``Work`` objects and a store (``tests/distributed/test_watchdog.py``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

POLL_S = 1.0
"""How often the thread looks at the oldest pending collective."""
PROBE_S = 10.0
"""How long a collective may be pending before the store is asked whether a peer is down. Collectives are short:
a pending one at this age is waiting for a peer, not for bandwidth."""
EXIT_CODE = 1
"""The exit code of a process whose watchdog named a failure."""


_DEVICE_BACKENDS = ("nccl", "xccl", "hccl")


def blocks_host(backend: str) -> bool:
    """Whether ``wait()`` on a collective of ``backend`` (``dist.get_backend``'s string) blocks the host until it
    completes (gloo) or only the device's stream (NCCL and other device backends; a group of ``"cpu:gloo,cuda:nccl"``
    sends device tensors to NCCL). The watchdog serves the latter; host tensors on a mixed group complete before
    their wait returns, so watching them costs one queue entry each."""
    return not any(name in backend for name in _DEVICE_BACKENDS)


def backend_margin_s(timeout_s: float) -> float:
    """How much later than ``collective_timeout_s`` NCCL's own watchdog fires in a group that shardtrain creates:
    enough for this module's thread, which polls every :data:`POLL_S` and then surveys the store, to report first."""
    return max(30.0, 0.05 * timeout_s)


class Work(Protocol):
    def is_completed(self) -> bool: ...


class Issuer(Protocol):
    """What the watchdog needs of a Communicator: its timeout, and the error it would raise for a failure."""

    timeout_s: float
    global_rank: int

    def peers(self) -> list[int]: ...

    def describe_failure(self, kind: str, what: str, err: BaseException, *, started: float | None = None) -> Any: ...


@dataclass
class Pending:
    work: Work
    issuer: Issuer
    kind: str
    what: str
    started: float  # time.monotonic() at issue
    probed: float = 0.0  # when the store was last asked about this collective's peers


class Watchdog:
    """See [Note: failures under NCCL]. ``peer_down(global_rank, peers)`` names a peer known to be down or returns
    None; ``report(message)`` ends the process (tests pass their own); ``clock`` is ``time.monotonic``."""

    def __init__(
        self,
        peer_down: Callable[[int, list[int]], str | None],
        report: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
        probe_s: float = PROBE_S,
    ) -> None:
        self._peer_down = peer_down
        self._report = report if report is not None else _print_and_exit
        self._clock = clock
        self._poll_s, self._probe_s = poll_s, probe_s
        self._queue: collections.deque[Pending] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None  # the message of the failure this watchdog reported

    def track(self, work: Work, issuer: Issuer, kind: str, what: str, started: float) -> None:
        """Watch ``work`` until it completes; starts the thread on first use."""
        with self._lock:
            self._drop_completed()
            self._queue.append(Pending(work, issuer, kind, what, started))
            if self._thread is None:
                self._stop.clear()  # a watchdog stopped at close() serves the next engine
                self._thread = threading.Thread(target=self._run, name="shardtrain-watchdog", daemon=True)
                self._thread.start()

    def pending(self) -> int:
        with self._lock:
            self._drop_completed()
            return len(self._queue)

    def stop(self) -> None:
        """End the thread and forget what is pending (idempotent; :func:`stop_watchdog` at exit)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5 * self._poll_s)
        with self._lock:
            self._queue.clear()

    def _drop_completed(self) -> None:
        """Collectives complete in issue order on one stream; across groups an earlier one may still run while a later
        one is done, so only the front is dropped, which bounds the queue by what the host runs ahead."""
        while self._queue and _completed(self._queue[0].work):
            self._queue.popleft()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            with contextlib.suppress(Exception):  # the thread must outlive a store or a driver that failed once
                if self.check() is not None:
                    return

    def check(self) -> str | None:
        """One look at the oldest pending collective (the thread's loop body; tests call it with their clock). Returns
        the reported message when it decided a failure."""
        with self._lock:
            self._drop_completed()
            oldest = self._queue[0] if self._queue else None
        if oldest is None:
            return None
        now = self._clock()
        waited = now - oldest.started
        issuer = oldest.issuer
        cause: str | None = None
        if waited >= self._probe_s and now - oldest.probed >= self._probe_s:
            oldest.probed = now
            down = self._peer_down(issuer.global_rank, issuer.peers())
            if down is not None:
                cause = f"not completed after {waited:.1f} s, and the rendezvous store says {down}"
        if cause is None and waited >= issuer.timeout_s:
            cause = f"not completed after {waited:.1f} s (watchdog)"
        if cause is None:
            return None
        # the error the gloo path raises, with the started time that makes it a timeout or not (see describe_failure)
        error = issuer.describe_failure(oldest.kind, oldest.what, RuntimeError(cause), started=oldest.started)
        message = f"{type(error).__name__}: {error}"
        self.fired = message
        self._report(message)
        return message


def _completed(work: Work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # a work whose collective failed: NCCL's error handling owns it now
        return True


def _print_and_exit(message: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"shardtrain watchdog, see [Note: failures under NCCL]: {message}\n")
        sys.stderr.flush()
    os._exit(EXIT_CODE)


_watchdog: Watchdog | None = None


def watchdog() -> Watchdog:
    """This process's watchdog (one for every Communicator of a device backend)."""
    global _watchdog
    if _watchdog is None:
        from shardtrain.distributed import failure

        _watchdog = Watchdog(failure.peer_down)
        atexit.register(stop_watchdog)
    return _watchdog


def stop_watchdog() -> None:
    """Stop this process's watchdog thread, if one runs (at ``engine.close()`` and at interpreter exit)."""
    if _watchdog is not None:
        _watchdog.stop()
