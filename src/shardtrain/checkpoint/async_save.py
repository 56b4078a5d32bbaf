"""Asynchronous checkpoint saves: the snapshot on the caller's thread, the files and the commit in the background.

[Note: asynchronous checkpoints]
``save_checkpoint(..., async_save=True)`` splits ``writer.py``'s protocol in two (as DCP's ``async_save``):

* on the caller, :func:`writer.prepare` (steps 1-2): each rank copies what it saves (device tensors into pinned memory,
  host ones cloned) and encodes its objects; one gather agrees on the plan; a bad or existing tag or an unstorable
  object raises here, on every rank. After it, nothing is shared with training: the next step cannot change the save;
* on one background thread per engine, :func:`writer.commit` (steps 3-5): files written and fsynced, rank 0
  publishes, outcome gathered. ``latest`` moves only once every rank's files are durable (a kill mid-write leaves it).

The commit's gathers run on a gloo group of their own (same ranks; made at the first asynchronous save, as
``new_group`` is collective): a second thread's collectives on training's group would interleave differently per rank
(deadlock or mismatched data); gloo for small host objects, off NCCL's streams. Committing on the training thread's
next call was rejected: ``latest`` would lag durable files by up to a save interval, and a crash would lose one.

At most one save is in flight: the next ``save_checkpoint``, ``close()`` and exit (non-daemon thread) join it. A
background failure is shared by the commit's gathers: every rank raises the same :class:`CheckpointError` at the next
``save_checkpoint`` or ``close()``, nothing published. Not at ``step()``: threads finish at different times, so one
rank would raise a step early and leave the others waiting in training's collectives. Memory: a host copy of all
this rank saves lives until its files are written.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import threading
import time
import weakref

import torch.distributed as dist

from shardtrain.checkpoint.writer import PreparedSave, SaveResult, commit
from shardtrain.distributed.communicator import Communicator

log = logging.getLogger("shardtrain")

_unfinished: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()
"""Savers whose last outcome nobody collected: reported at exit (see :func:`_report_at_exit`)."""


class AsyncSaver:
    """The background saves of one engine: one in flight at most, committed over its own checkpoint group."""

    def __init__(self) -> None:
        self._comm: Communicator | None = None  # the checkpoint group; created on the first save of a multi-rank job
        self._thread: threading.Thread | None = None
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._what = ""  # the checkpoint in flight, for messages
        self.blocked_s = 0.0  # seconds the last wait() blocked its caller (benchmarks)

    def commit_comm(self, comm: Communicator) -> Communicator | None:
        """The checkpoint group over the ranks of ``comm`` (None for one process). Collective the first time."""
        if comm.size == 1:
            return None
        if self._comm is None:
            ranks = dist.get_process_group_ranks(comm.group)
            timeout = datetime.timedelta(seconds=comm.timeout_s)
            group = dist.new_group(ranks, timeout=timeout, backend="gloo")
            self._comm = Communicator(group, comm.timeout_s)
            assert self._comm.rank == comm.rank, "the checkpoint group orders ranks like the training group"
        return self._comm

    def start(self, prepared: PreparedSave, comm: Communicator | None) -> None:
        """Commit ``prepared`` in the background; the previous save must have been waited for."""
        assert not self.in_flight, "wait() for the previous save first"
        self._result, self._error = None, None
        self._what = str(prepared.save_dir / prepared.tag)
        self._thread = threading.Thread(
            target=self._run, args=(prepared, comm), name=f"shardtrain checkpoint {prepared.tag}", daemon=False
        )
        _unfinished.add(self)
        self._thread.start()

    def _run(self, prepared: PreparedSave, comm: Communicator | None) -> None:
        try:
            self._result = commit(prepared, comm)
        except BaseException as err:  # raised on the caller's thread by wait()
            self._error = err

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> SaveResult | None:
        """Block until the save in flight (if any) is complete; raise its failure here, once. Returns its result
        (None when no save was started since the last wait)."""
        t0 = time.perf_counter()
        thread, self._thread = self._thread, None
        if thread is None:
            self.blocked_s = 0.0
            return None
        thread.join()
        self.blocked_s = time.perf_counter() - t0
        _unfinished.discard(self)
        error, self._error = self._error, None
        result, self._result = self._result, None
        if error is not None:
            raise error
        return result

    def close(self) -> None:
        """Release the checkpoint group (local, not collective)."""
        if self._comm is not None:
            comm, self._comm = self._comm, None
            with contextlib.suppress(Exception):  # the default group is already gone: so is this one
                dist.destroy_process_group(comm.group)


@atexit.register
def _report_at_exit() -> None:
    """Log the failures of saves nobody waited for. The interpreter joins non-daemon threads before it runs the
    exit hooks, so every save is over by now, and its process group was still intact while it ran."""
    for saver in list(_unfinished):
        thread = saver._thread
        if thread is None:
            continue
        try:
            saver.wait()
        except BaseException as err:
            log.error("the asynchronous checkpoint save of %s failed: %s", saver._what, err)
