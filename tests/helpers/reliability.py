"""Shared pieces of the reliability tests: killing a rank at a chosen point, what every survivor must show, and a
disk that fills up (:class:`FullDisk`)."""

from __future__ import annotations

import builtins
import errno
import io
import os
import re
import signal
from pathlib import Path
from typing import Any

from shardtrain.checkpoint import durable, latest, safetensors_io, writer
from shardtrain.checkpoint.durable import KILL_ENV
from shardtrain.testing import RankOutcome

SURVIVOR_LIMIT_S = 30.0
"""Every survivor must have exited this long after the killed rank at most (the default collective timeout is
1800 s; measured: well under a second)."""


def die(*args, **kwargs) -> None:
    """Used as a hook or in place of a method: the process is killed as the OOM killer would."""
    os.kill(os.getpid(), signal.SIGKILL)


def arm(engine, point: str) -> None:
    """Make this rank kill itself at ``point`` of its next training step or save: ``forward`` (entering the second
    block), ``backward`` (the second block's backward, after the first reductions launched), ``step`` (the torch
    optimizer's step, between gradient reduction and the parameter all-gather) or a save crash point
    (:data:`shardtrain.checkpoint.durable.CRASH_POINTS`)."""
    if point == "forward":
        engine.module.blocks[1].register_forward_pre_hook(die)
    elif point == "backward":
        engine.module.blocks[1].register_full_backward_pre_hook(die)
    elif point == "step":
        engine.optimizer.step = die
    else:
        os.environ[KILL_ENV] = point


def last_error(outcome: RankOutcome) -> str:
    """The final line of a rank's traceback: ``module.Class: message``."""
    assert outcome.error is not None, f"rank {outcome.rank} raised nothing (returned {outcome.value!r})"
    return outcome.error.strip().splitlines()[-1]


def check_rank_death(outcomes: list[RankOutcome], victim: int, tp: int = 1) -> dict[int, tuple[float, str]]:
    """The killed rank died of SIGKILL; no process was left for the harness to kill; every survivor raised a
    PeerLostError naming the killed rank, without the word timeout, and exited on its own within
    :data:`SURVIVOR_LIMIT_S` of it. Returns {survivor: (seconds after the killed rank, message)}.

    On a (dp, tp) mesh (``tp`` > 1, world > tp) a survivor that shares neither its tensor-parallel nor its
    data-parallel group with the killed rank may fail in a collective of its own groups when a peer there leaves
    (rather than in a world collective such as the desync check); its survey covers the group of the failing
    collective only, so it then names that peer ("rank(s) [1] failed in the same way", or "rank 0 (...) is gone" when
    that peer hosted the rendezvous store and has exited already) and not the killed rank: see docs/reliability.md
    (limits)."""
    dead = outcomes[victim]
    assert dead.exitcode == -signal.SIGKILL, f"rank {victim} was to be killed: {dead}"
    assert not [o.rank for o in outcomes if o.killed_by_harness], "processes left behind"
    out = {}
    for o in outcomes:
        if o.rank == victim:
            continue
        line = last_error(o)
        assert line.startswith("shardtrain.errors.PeerLostError: "), line
        message = line.removeprefix("shardtrain.errors.PeerLostError: ")
        assert message.startswith(f"rank {o.rank}: "), message
        if victim == 0:  # rank 0 hosts the rendezvous store of run_ranks: its loss is what the others see
            named = "store no longer answers" in message and "gone: rank 0, which hosts it" in message
        else:
            # "rank 1 (pid 42 on h) is gone: killed ...", or with the others gone by then (the store's host exited
            # first, see [Note: naming the rank that vanished]) "rank 0 (...), rank 1 (...) are gone: killed ..."
            named = f"rank {victim} (pid " in message and re.search(r"\) (is|are) gone: killed", message)
        isolated = tp > 1 and o.rank // tp != victim // tp and o.rank % tp != victim % tp  # no group with the victim
        if isolated and not named:  # it failed in a collective of its own groups (not the world's desync check)
            peer = r"rank\(s\) \[[\d, ]+\] failed in the same way|\) (is|are) gone: killed"  # the peer that left
            assert re.search(peer, message), message
        else:
            assert named, message
        assert "timeout" not in message.lower() and "timed out" not in message.lower(), message
        assert " in Engine." in message, message  # where this rank was
        seconds = o.exited_after - dead.exited_after
        assert seconds < SURVIVOR_LIMIT_S, (o.rank, seconds)
        out[o.rank] = (seconds, message)
    return out


# -- a disk that fills up --------------------------------------------------------------------------------------------

NOSPACE = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"


class FullDisk:
    """Files opened for writing (whose name passes ``which``) take ``room`` more bytes in all, then every write fails
    with ENOSPC, as on a disk that fills up; with ``at_fsync`` the writes succeed and the fsync fails instead (as on
    NFS or a thin-provisioned volume, where the space runs out when the data is written back)."""

    def __init__(self, room: int, which=lambda name: True, at_fsync: bool = False) -> None:
        self.room, self.which, self.at_fsync = room, which, at_fsync
        self._fsync = os.fsync

    def open(self, file, mode="r", *args, **kwargs):
        f = builtins.open(file, mode, *args, **kwargs)  # noqa: SIM115 (returned to the caller, who closes it)
        if not set(mode) & set("wax+") or not self.which(Path(file).name):
            return f
        return _Filling(f, self)

    def fsync(self, fd: int) -> None:
        if self.at_fsync:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._fsync(fd)

    def __enter__(self) -> FullDisk:
        for module in (safetensors_io, durable, writer, latest):
            module.open = self.open  # module globals shadow the builtin
        if self.at_fsync:
            os.fsync = self.fsync
        return self

    def __exit__(self, *exc) -> None:
        for module in (safetensors_io, durable, writer, latest):
            del module.open
        os.fsync = self._fsync


class _Filling:
    def __init__(self, f, disk: FullDisk) -> None:
        self._f, self._disk = f, disk

    def write(self, data) -> int:
        """A raw file (``buffering=0``) writes what fits and says so (a short write), then fails; a buffered or
        text file writes everything or raises."""
        n = len(data) if isinstance(data, str) else len(memoryview(data).cast("B"))
        take = min(n, self._disk.room)
        if take < n and (take == 0 or not isinstance(self._f, io.RawIOBase)):
            self._f.write(data[:take])
            self._disk.room -= take
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a kernel write error: no file name
        self._disk.room -= take
        return self._f.write(data[:take])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


def walk_and_set(doc: Any, walk: list[int], delete: bool, value: Any) -> Any:
    """``doc`` (parsed JSON, changed in place) with the value at the path ``walk`` chooses (an index per level, taken
    modulo the keys in sorted order or the list's length) deleted from its dict or replaced by ``value``; ``value``
    itself when the walk stops at the top. The fuzz harnesses' mutation of a manifest, a header or a config."""
    parent, key, node = None, None, doc
    for i in walk:
        if isinstance(node, dict) and node:
            k: Any = sorted(node)[i % len(node)]
        elif isinstance(node, list) and node:
            k = i % len(node)
        else:
            break
        parent, key, node = node, k, node[k]
    if parent is None:
        return value
    if delete and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = value
    return doc
