"""A clean exit: every engine still open is closed at interpreter exit, while the interpreter is whole.

[Note: what the engine starts and who joins it]
``Engine.close()`` stops all of it, once; this module's exit hook closes every engine nobody closed.
* process groups (``init_topology``; ``Topology.own_groups``): each gloo group runs two workers and a TCP loop, an
  NCCL group its watchdog. ``close()`` waits for collectives in flight, destroys these groups, then drops every
  reference the engine holds (``Communicator.release``, which then refuses collectives; ``release_groups``). A gloo
  group joins its workers only in its destructor, so dropping the references is what frees them ([Note: gloo workers
  that outlive the engine] in :mod:`shardtrain.distributed.gloo_threads`). The default group is its creator's to
  destroy: ours at exit (``mesh._destroy_own_process_group``), the Trainer's by ``ShardtrainTrainer.end()``, the
  user's by the user. Under torchrun rank 0's attempt store goes with the default group.
* asynchronous saves (``checkpoint/async_save.py``): a non-daemon thread per save, joined by the next save and by
  ``close()``, and a gloo group destroyed by ``close()``; each file's fsync thread is joined before the write returns.
* swap (``offload/``): two I/O threads and the directory (else a ``weakref.finalize``); monitors (TensorBoard's
  writer, a wandb run): all closed by ``close()``. No process is started.
* a daemon thread per call on the rendezvous store, ended when the call returns; one that the store's host never
  answers is left to the exit ([Note: every wait on the store is bounded] in ``distributed/store_calls.py``).

Why before finalization: a gloo worker dropping a work object after it began aborts the process ("terminate called
without an active exception"; mechanism and counts: docs/reliability.md, "A clean exit"). The hook is registered at
the first engine, after the process group exists, so (LIFO) it runs before ``_destroy_own_process_group``; the hook
registered on import runs last and waits for idle workers of groups others keep (``settle_gloo_workers``). A failing
process closes nothing at exit: its collectives in flight may never be matched; it must exit, not wait.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import weakref
from typing import Protocol

import torch.distributed as dist

from shardtrain.distributed import failure
from shardtrain.distributed.gloo_threads import settle_gloo_workers

log = logging.getLogger("shardtrain")


def _settle_at_exit() -> None:
    if not settle_gloo_workers():
        log.warning("gloo worker threads were still busy at exit after 2 s")


# registered on import, before every other exit hook of shardtrain, so it runs after them: the last one
atexit.register(_settle_at_exit)


class Closable(Protocol):
    """What this module needs of an engine (``engine.py`` imports this module, not the other way round)."""

    def close(self) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()
"""Engines built and not closed yet: closed by :func:`close_open_engines` at exit."""
_registered = False


def track(engine: Closable) -> None:
    """Close ``engine`` at interpreter exit unless it was closed before (see [Note: what the engine starts and who
    joins it])."""
    global _registered
    if not _registered:
        atexit.register(close_open_engines)
        _registered = True
    _open.add(engine)


def closed(engine: Closable) -> None:
    """``engine.close()`` ran: nothing is left for the exit hook."""
    _open.discard(engine)


def close_open_engines() -> None:
    """Close every engine still open; a failure is logged, not raised (the process is exiting, and one engine's
    failure must not keep the others open). Nothing is done when the script is failing: its collectives in flight
    may never be matched by the other ranks, and waiting for them would hold a failed rank for the whole collective
    timeout instead of letting it exit."""
    if failing():
        return
    for engine in list(_open):
        try:
            engine.close()
        except BaseException as err:
            log.error("closing the engine at exit failed: %s", err)


def end_at_exit() -> None:
    """At interpreter exit, close every open engine and then destroy the default process group: what
    ``Trainer.end()`` does, for a ``ShardtrainTrainer`` whose script never calls it (the Trainer's arguments created
    the group, through accelerate; see [Note: what the engine starts and who joins it]). Registered once; after the
    engines' own hook, so it runs first."""
    global _end_registered
    if not _end_registered:
        atexit.register(_end)
        _end_registered = True


_end_registered = False


def failing() -> bool:
    """Whether the process is exiting because of a failure: a collective failed (its groups are broken; NCCL's
    teardown may wait for the peers that are gone), or the script ended with an uncaught exception (which sets
    ``sys.last_value`` before the exit hooks run)."""
    return failure.any_failed() or getattr(sys, "last_value", None) is not None


def _end() -> None:
    if failing():  # as mesh._destroy_own_process_group
        return
    close_open_engines()
    with contextlib.suppress(Exception):  # destroyed already (Trainer.end(), the user)
        if dist.is_initialized():
            dist.destroy_process_group()
