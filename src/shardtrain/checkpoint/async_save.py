"""Asynchronous checkpoint saves: the snapshot on the caller's thread, the files and the commit in the background.

[Note: asynchronous checkpoints]
``save_checkpoint(..., async_save=True)`` splits the save protocol of ``writer.py`` in two, as PyTorch DCP's
``async_save`` and DeepSpeed's decoupled checkpoint engine do:

* on the calling thread, :func:`writer.stage` (steps 1-2): rank 0 prepares ``.tmp-<tag>``; every rank copies each
  tensor it saves (parameters or masters, optimizer state; device tensors into pinned memory, host ones cloned) and
  encodes its objects (RNG states, scheduler, counters, ``client_state``) into bytes and fresh JSON; one gather over
  the training group agrees on the plan. A bad tag, an existing tag or an object that cannot be stored is raised
  here, at once, on every rank. When it returns nothing the save reads is shared with training any more: the next
  optimizer step cannot change what is written;
* on one background thread per engine, :func:`writer.commit` (steps 3-5): write and fsync the files, gather the
  file lists, rank 0 publishes (manifest, rename, ``latest``), gather the outcome. ``latest`` moves only once every
  rank's files are durable, exactly as in a synchronous save, so a process killed during the background write
  leaves the previous checkpoint loadable and ``latest`` unchanged (the crash points of ``durable.py`` are the same).

The commit's gathers are collectives, and a collective issued from a second thread on the training's process group
would interleave with training's own collectives in an order that differs between ranks (a deadlock or, worse,
mismatched data). They run on a separate gloo group created for checkpoints (the same ranks, in the same order),
once per engine, on the first asynchronous save: ``new_group`` is itself collective over the world, and every rank
calls ``save_checkpoint`` at the same point (the desync check verifies it). Gloo because the commit exchanges small
Python objects on the host; it also keeps the background thread off the GPU's NCCL streams. The alternative,
deferring the commit to the next engine call on the training thread, was rejected: ``latest`` would then lag behind
durable files by up to a whole save interval, and a crash in between would lose a checkpoint that was on disk.

At most one save is in flight per engine: the next ``save_checkpoint`` and ``close()`` wait for it first, and the
interpreter's exit waits too (the thread is not a daemon; an outcome nobody collected is logged at exit). A failure
of the background save (a full disk on any rank, a lost peer) is carried between ranks by the commit's gathers as
in a synchronous save, so every rank holds the same :class:`CheckpointError`; it is raised at the next
``save_checkpoint`` or ``close()`` on every rank, and nothing was published (``latest`` names the previous
checkpoint). Not at ``step()``: the background threads of different ranks finish at different times, so a poll at
each step would raise on one rank at step k and on another at step k+1, and the first would leave the others waiting
in training's collectives; the next save and ``close()`` are points every rank reaches together, after joining.
Memory: a host copy of everything this rank saves is held until its files are written.
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

from shardtrain.checkpoint.writer import SaveResult, StagedSave, commit
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

    def start(self, staged: StagedSave, comm: Communicator | None) -> None:
        """Commit ``staged`` in the background; the previous save must have been waited for."""
        assert not self.in_flight, "wait() for the previous save first"
        self._result, self._error = None, None
        self._what = str(staged.save_dir / staged.tag)
        self._thread = threading.Thread(
            target=self._run, args=(staged, comm), name=f"shardtrain checkpoint {staged.tag}", daemon=False
        )
        _unfinished.add(self)
        self._thread.start()

    def _run(self, staged: StagedSave, comm: Communicator | None) -> None:
        try:
            self._result = commit(staged, comm)
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
