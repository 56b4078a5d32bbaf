"""A clean exit: every engine still open is closed at interpreter exit, while the interpreter is whole.

[Note: what the engine starts and who joins it]
What an engine starts beside the training thread, and what stops it (``Engine.close()`` does all of it, once; the
exit hook of this module calls ``close()`` for every engine nobody closed):

* process groups (``distributed/mesh.py``): ``init_topology`` creates the engine's groups with ``new_group`` (each
  axis, the host-side gloo twins under NCCL, a world group of its own when the default group is not shardtrain's and
  the job runs on the CPU or the group has another timeout; ``Topology.own_groups``). Each gloo group runs two worker
  threads (``pt_gloo_runloop``) and a TCP loop; an NCCL group its watchdog. ``close()`` waits for the collectives
  still in flight (the parameter all-gathers the last step launched, a ZeRO-3 unit-order exchange issued ahead),
  destroys these groups (``destroy_own_groups``; for NCCL this joins the watchdog) and then drops every reference the
  engine holds to a group: each communicator built for it (``Communicator.release``; they refuse a collective
  afterwards) and the topology's groups and device mesh (``release_groups``). A gloo group's workers are joined only
  by its destructor, so only this frees them while the interpreter is whole (see [Note: gloo workers that outlive
  the engine] in :mod:`shardtrain.distributed.gloo_threads`). The default group is its creator's: when shardtrain
  created it (``ensure_process_group``) ``mesh._destroy_own_process_group`` destroys it at exit; when the Hugging
  Face Trainer did (accelerate, from ``TrainingArguments``), ``ShardtrainTrainer.end()`` and its exit hook do; a
  user's own group is the user's to destroy, as PyTorch documents (``destroy_process_group`` at the end of the
  script).
* under torchrun, rank 0's TCP store of the attempt (``attempt_store``, a ``pt_tcpstore_uv`` thread): owned by the
  default group's store, it goes with the default group;
* the asynchronous checkpoint save (``checkpoint/async_save.py``): one non-daemon thread per save in flight, joined
  by the next ``save_checkpoint`` and by ``close()`` (and by the interpreter before the exit hooks run), and a gloo
  group of its own, destroyed by ``close()``; the fsync thread of each file written (``writer.py``), joined before
  the write returns;
* optimizer state offloaded to swap files (``offload/optimizer_state.py``): a pool of two I/O threads
  (``shardtrain-swap``), shut down with ``wait=True`` by ``close()``; the swap directory is removed by ``close()``,
  else by a ``weakref.finalize`` at exit (``offload/swap.py``);
* monitors (``engine/monitor.py``): TensorBoard's writer thread and a wandb run, closed by ``close()``.

The engine starts no process (data loader workers are the data loader's; ``shardtrain.testing`` is test tooling).

Why at exit, and why before the interpreter tears down: ``terminate called without an active exception`` (SIGABRT
after the script has finished; torchrun then reports a finished job as failed) is a gloo worker thread that drops
the last reference to a completed collective's work object after the interpreter has started to finalize; the core
dumps and the mechanism are in [Note: gloo workers that outlive the engine]. Destroying a group is not enough: its
workers live as long as the Python object does, and before ``close()`` dropped the engine's references they reached
the finalization (2 aborts in 167 Trainer rank exits with destroyed but referenced groups; docs/reliability.md).
The hook is registered when the first engine is built, after the process group exists, so it runs before
``mesh._destroy_own_process_group`` (exit hooks run last-registered first): engines first, then the default group;
the hook this module registers on import runs after both, last, and waits until the gloo workers of groups that
others keep alive are idle (``settle_gloo_workers``). A failing process (a collective failed, or the script ended
with an uncaught exception) closes nothing at exit: its collectives in flight may never be matched, and it must exit
rather than wait for them.
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
