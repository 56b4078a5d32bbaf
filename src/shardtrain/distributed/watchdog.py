"""Failures of collectives that do not block the host (NCCL): named by a watchdog thread, not left to NCCL's.

[Note: failures under NCCL]
Under NCCL ``wait()`` only makes the stream wait: a collective whose peer is gone never raises in Python, and NCCL's
watchdog kills the process at the group's timeout naming a sequence number, not the lost rank. So a Communicator
whose backend does not block the host (:func:`blocks_host`) hands each collective to one daemon thread
(:class:`Watchdog`) checking the oldest incomplete one every :data:`POLL_S` (``is_completed()`` does not wait). From
:data:`PROBE_S` after issue it asks the store, not NCCL, if a peer is down (:class:`~shardtrain.errors.PeerLostError`;
:func:`shardtrain.distributed.failure.peer_down`) and runs the wait probes ([Note: probes while waiting] in
:mod:`shardtrain.distributed.communicator`): a ZeRO-3 rank's departure ([Note: departures from a trusted order] in
:mod:`shardtrain.zero.departure`) is named even while this host is stuck in CUDA. At ``collective_timeout_s``:
:class:`~shardtrain.errors.CollectiveTimeoutError`. Either way it builds the gloo path's message, writes this rank's
failure to the store (peers name the same lost rank), prints it with every thread's stack and ``os._exit``s with
:data:`EXIT_CODE`; it never raises (the main thread may be blocked in CUDA). ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 0/2:
report only; ``TORCH_NCCL_BLOCKING_WAIT=1``, ``SHARDTRAIN_WATCHDOG=0``: no watchdog. Unwatched: object collectives,
point-to-point, captured graphs.

A ``Work`` is held only until its ``wait()`` returns, then an event after the wait is watched: NCCL's ``Work`` keeps
its outputs alive, which raised the next forward's peak as the host ran ahead (docs/benchmarks-gpu.md, second session).
NCCL's watchdog is the backstop: our groups' timeout adds :func:`backend_margin_s`; on a user's group no longer than
ours this fires half a margin earlier (``Communicator.watch_timeout_s``). Limits: docs/reliability.md, "Under NCCL".
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import faulthandler
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


OFF_ENV = "SHARDTRAIN_WATCHDOG"
"""Set to ``0``: no watchdog thread; NCCL's own error handling alone, as without shardtrain."""


def blocks_host(backend: str) -> bool:
    """Whether ``wait()`` on a collective of ``backend`` (``dist.get_backend``'s string) blocks the host until it
    completes (gloo) or only the device's stream (NCCL and other device backends; a group of ``"cpu:gloo,cuda:nccl"``
    sends device tensors to NCCL). The watchdog serves the latter; host tensors on a mixed group complete before
    their wait returns, so watching them costs one queue entry each. With ``TORCH_NCCL_BLOCKING_WAIT=1`` NCCL's
    ``wait()`` blocks the host and raises at the timeout, which the Communicator names as on gloo; with
    ``SHARDTRAIN_WATCHDOG=0`` the user has turned the watchdog off."""
    if os.environ.get(OFF_ENV) == "0" or os.environ.get("TORCH_NCCL_BLOCKING_WAIT") in ("1", "true", "True"):
        return True
    return not any(name in backend for name in _DEVICE_BACKENDS)


def ends_process() -> bool:
    """Whether a failure the watchdog names ends the process, as NCCL's own error handling would
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` unset, 1 or 3). With 0 or 2 the user asked NCCL not to kill the process
    (an in-process restart, say): the watchdog then reports and leaves it running."""
    return os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3") not in ("0", "2")


class _StreamMarker:
    """A synchronous collective as the watchdog watches it: an event recorded on the current stream after it."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def is_completed(self) -> bool:
        return bool(self._event.query())


class _Waited:
    """A collective whose wait blocked the host until it completed."""

    def is_completed(self) -> bool:
        return True


_WAITED = _Waited()


def stream_marker() -> _StreamMarker | None:
    """An event after the work queued so far on the current CUDA stream (None without CUDA): what a synchronous NCCL
    collective's completion is watched by. It keeps no tensor alive."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return _StreamMarker(event)


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

    def describe_failure(
        self, kind: str, what: str, err: BaseException, *, started: float | None = None, frame: Any = None
    ) -> Any: ...


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
        wait_probes: Callable[[], list[Callable[[], None]]] = list,
    ) -> None:
        """``wait_probes()``: the probes a blocked wait would run (:mod:`shardtrain.distributed.wait_probes`, [Note:
        probes while waiting] in :mod:`shardtrain.distributed.communicator`), run here too with the store's probe:
        under NCCL the host may be stuck where no wait runs them (a CUDA synchronization behind the collective)."""
        self._peer_down = peer_down
        self._wait_probes = wait_probes
        self._report = report if report is not None else _print_and_exit
        self._clock = clock
        self._poll_s, self._probe_s = poll_s, probe_s
        self._queue: collections.deque[Pending] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None  # the message of the failure this watchdog reported

    def track(self, work: Work, issuer: Issuer, kind: str, what: str, started: float) -> Pending:
        """Watch ``work`` until it completes; starts the thread on first use. Returns its entry, for
        :meth:`waited`."""
        pending = Pending(work, issuer, kind, what, started)
        with self._lock:
            self._drop_completed()
            self._queue.append(pending)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()  # a watchdog stopped at close() serves the next engine
                device = _current_cuda_device()
                self._thread = threading.Thread(
                    target=self._run, args=(device,), name="shardtrain-watchdog", daemon=True
                )
                self._thread.start()
        return pending

    def waited(self, pending: Pending) -> None:
        """``pending``'s ``wait()`` has returned: its ``Work`` is released, and what is watched from now on is an
        event after the wait on the current stream (without CUDA, the wait blocked the host: it is complete)."""
        try:
            marker = stream_marker()
        except RuntimeError:  # a device that cannot record an event: the Work itself stays watched
            return
        with self._lock:
            pending.work = marker if marker is not None else _WAITED

    def pending(self) -> int:
        with self._lock:
            self._drop_completed()
            return len(self._queue)

    def stop(self) -> None:
        """End the thread and forget what is pending (idempotent; :func:`stop_watchdog` at exit)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5 * self._poll_s)
        if thread is not None and not thread.is_alive():
            self._thread = None
        # else still in a store call (at most store_calls.limit_s()): kept, so that no second thread starts before it
        # has ended
        with self._lock:
            self._queue.clear()

    def _drop_completed(self) -> None:
        """Collectives complete in issue order on one stream; across groups an earlier one may still run while a later
        one is done, so only the front is dropped, which bounds the queue by what the host runs ahead."""
        while self._queue and _completed(self._queue[0].work):
            self._queue.popleft()

    def _run(self, device: int | None) -> None:
        if device is not None:  # a new thread's current device is 0: event queries would make a context there
            import torch

            torch.cuda.set_device(device)
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
            named = self._probe_waits()
            if named is not None:  # a peer said why it will never join (a ZeRO-3 unit-order departure)
                self.fired = named
                self._report(named)
                return named
            down = self._peer_down(issuer.global_rank, issuer.peers())
            if down is not None:
                cause = f"not completed after {waited:.1f} s, and the rendezvous store says {down}"
        if cause is None and waited >= getattr(issuer, "watch_timeout_s", issuer.timeout_s):
            cause = f"not completed after {waited:.1f} s (watchdog)"
        if cause is None:
            return None
        # the error the gloo path raises, with the started time that makes it a timeout or not (see describe_failure),
        # and the main thread's stack for where the rank was (this thread's says nothing)
        main = sys._current_frames().get(threading.main_thread().ident)
        error = issuer.describe_failure(
            oldest.kind, oldest.what, RuntimeError(cause), started=oldest.started, frame=main
        )
        message = f"{type(error).__name__}: {error}"
        self.fired = message
        self._report(message)
        return message

    def _probe_waits(self) -> str | None:
        """The error a wait probe raises, as the message to report; None when none does."""
        from shardtrain.errors import ShardtrainError

        for probe in list(self._wait_probes()):
            try:
                probe()
            except ShardtrainError as err:
                return f"{type(err).__name__}: {err}"
        return None


def _completed(work: Work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # a work whose collective failed: NCCL's error handling owns it now
        return True


def _print_and_exit(message: str) -> None:
    """Report on stderr, with every thread's stack (where the main thread was stuck), and end the process unless
    NCCL's error handling was told to keep it (:func:`ends_process`)."""
    with contextlib.suppress(Exception):
        sys.stderr.write(f"shardtrain watchdog, see [Note: failures under NCCL]: {message}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
        sys.stdout.flush()
    if ends_process():
        os._exit(EXIT_CODE)


def _current_cuda_device() -> int | None:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


_watchdog: Watchdog | None = None


def watchdog() -> Watchdog:
    """This process's watchdog (one for every Communicator of a device backend)."""
    global _watchdog
    if _watchdog is None:
        from shardtrain.distributed import failure, wait_probes

        _watchdog = Watchdog(failure.peer_down, wait_probes=wait_probes.registered_wait_probes)
        atexit.register(stop_watchdog)
    return _watchdog


def stop_watchdog() -> None:
    """Stop this process's watchdog thread, if one runs (at ``engine.close()`` and at interpreter exit)."""
    if _watchdog is not None:
        _watchdog.stop()
