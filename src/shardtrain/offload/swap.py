"""Swap files and the directories they live in: per-rank scratch directories under ``nvme_path`` and one file
per offloaded tensor, read and written with positional I/O; every error names the rank and the path.

[Note: page cache]
A write through the page cache only moves the state into the kernel's memory: a rank whose state does not fit would
fill the cache with dirty pages, and a benchmark would measure memory, not the disk (DeepSpeed uses O_DIRECT). So a
swap file of at least ``DROP_BYTES`` is synced (``fdatasync``, on the I/O thread, overlapped with the step) and
dropped from the cache (``posix_fadvise(DONTNEED)``) after each write, and dropped after each read: the state really
leaves memory, and a full disk surfaces at the step that wrote it (the sync reports ENOSPC at write-back). Smaller
files (biases, norms) stay cached: a sync each would cost more than their bytes.

[Note: scratch directories]
Swap files are scratch, never state: each run makes ``<nvme_path>/shardtrain-swap-<host>-<pid>-rank<r>-*``
(``tempfile.mkdtemp``: never an existing directory), takes an exclusive ``flock`` on its ``lock`` file for the
directory's life, then writes ``owner.json`` (:func:`shardtrain.distributed.failure.process_record`). It is removed by
``Engine.close()``, when its :class:`ScratchDir` is collected, and at interpreter exit. A new run removes other
directories that (a) have a lock nobody holds, (b) were made on this host by name (network file systems may keep
locks per client) and (c) have their ``owner.json`` (written after locking, so a directory not locked yet is never
taken for dead). The lock, not the record, decides: the kernel drops a process's locks however it ends, and locks are
seen across pid namespaces, where pids are not (guessing from pids deleted a live run's files). Without a usable lock
(no ``flock``, or a directory older than the lock) the record decides through the failure survey's liveness check
(only a process of this machine that is gone, or whose pid was reused, is dead); a directory with neither is removed
once ``GRACE_S`` old. Checkpoints copy the state out (``OptimizerOffload.state_of`` maps the files) and loading
writes it into fresh files. More in docs/offload.md, "Swap files are scratch".

[Note: bounded descriptors]
A rank has one swap file per (stepped tensor, state key): thousands for a large model (counts in docs/offload.md,
"Swap files are scratch"), past the usual descriptor limit if each stayed open. So each file is opened for a read or
write and closed after it: a rank holds at most one descriptor per thread touching them (the two I/O threads, and
the training thread, which writes offloaded gradients and the optimizer's first-step state). An empty fragment has
no file. An ``open`` costs microseconds against a tensor state's I/O.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.failure import process_alive, process_record
from shardtrain.errors import OffloadError

PREFIX = "shardtrain-swap-"
MARKER = "owner.json"
LOCK = "lock"  # held (flock) by the owning process for the directory's life
GRACE_S = 60.0  # a directory with neither lock nor record is removed only once it is this old (seconds)
ALIGN = 4096  # the probe's size; buffer regions start on page boundaries too (and could use O_DIRECT)
DROP_BYTES = 1 << 20  # files at least this large leave the page cache after each write and read


# -- scratch directories ---------------------------------------------------------------------------


def _host_tag() -> str:
    """This host's name as scratch directory names carry it (no '-', which separates the fields)."""
    return socket.gethostname().replace("-", "_")


def _hold_lock(path: Path) -> int | None:
    """An exclusive lock on ``path/LOCK``, held by the returned descriptor until it is closed; None when the file
    system has no ``flock`` (the record alone then speaks for the directory)."""
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a new run's clear_stale looks at it (microseconds)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise
    return fd


def _record(d: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((d / MARKER).read_text())
        return record if isinstance(record, dict) else None
    return None


def _old(d: Path) -> bool:
    try:
        return time.time() - d.stat().st_mtime > GRACE_S
    except OSError:
        return False


def _remove_if_stale(d: Path) -> bool:
    """Remove scratch directory ``d`` if its run is gone (see [Note: scratch directories]); True if removed."""
    try:
        fd = os.open(d / LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None
    except OSError:
        return False  # not ours to open (another user's): leave it
    try:
        locked = False
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                return False  # its owner holds the lock: alive, whatever its record says
            except OSError:
                pass  # no flock on this file system
        record = _record(d)
        by_name_here = d.name[len(PREFIX) :].rsplit("-", 3)[0] == _host_tag()
        if record is None:  # not locked yet (a run starting now) or killed before it could be: by age only
            dead = by_name_here and _old(d)
        elif locked:  # nobody holds the lock: its process has ended
            dead = record.get("host") == socket.gethostname()
        else:
            dead = process_alive(record) is False
        if dead:
            shutil.rmtree(d, ignore_errors=True)  # while holding its lock: no other cleaner races this one
        return dead
    finally:
        if fd is not None:
            os.close(fd)


_MINE: set[Path] = set()
"""This process's live scratch directories: never judged by their lock, which on a network file system may be
a per-process POSIX lock that this same process could take again."""


def clear_stale(root: Path) -> list[Path]:
    """Remove scratch directories under ``root`` left by runs that are gone (see [Note: scratch directories])."""
    return [d for d in sorted(root.glob(PREFIX + "*")) if d not in _MINE and d.is_dir() and _remove_if_stale(d)]


def _remove_scratch(path: Path, lock_fd: int | None, owner_pid: int) -> None:
    """The finalizer of a :class:`ScratchDir`: its files first, then its lock. A forked child that inherited the
    object never removes its parent's directory."""
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)
        _MINE.discard(path)
    if lock_fd is not None:
        with contextlib.suppress(OSError):
            os.close(lock_fd)


class ScratchDir:
    """This rank's fresh swap directory under ``root``, locked for its life (see [Note: scratch directories]) and
    checked by writing, syncing and reading a probe file; removed by :meth:`remove`, when garbage-collected, and
    at interpreter exit."""

    def __init__(self, root: str | Path, rank: int, what: str) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            why = "is not a directory" if self.root.exists() else "does not exist"
            raise OffloadError(f"rank {rank}: {what}.nvme_path {str(self.root)!r} {why}; create it or pick another")
        clear_stale(self.root)
        try:
            prefix = f"{PREFIX}{_host_tag()}-{os.getpid()}-rank{rank}-"
            self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.root))
        except OSError as err:
            raise OffloadError(
                f"rank {rank}: cannot create a swap directory in {what}.nvme_path {str(self.root)!r}: "
                f"{err.strerror or err}"
            ) from None
        lock_fd, failed = None, None
        try:
            lock_fd = _hold_lock(self.path)
        except OSError as err:
            failed = err
        # from here on the directory goes with this object: remove(), garbage collection or interpreter exit
        self._finalizer = weakref.finalize(self, _remove_scratch, self.path, lock_fd, os.getpid())
        _MINE.add(self.path)
        self.locked = lock_fd is not None
        probe = self.path / "probe"
        try:
            if failed is not None:
                raise failed
            (self.path / MARKER).write_text(json.dumps(process_record()))
            with open(probe, "wb") as f:
                f.write(b"\0" * ALIGN)
                f.flush()
                os.fsync(f.fileno())
            if probe.read_bytes() != b"\0" * ALIGN:
                raise OSError(0, "the probe file read back different bytes")
            probe.unlink()
        except OSError as err:
            self.remove()
            raise OffloadError(
                f"rank {rank}: {what}.nvme_path {str(self.root)!r} is not usable for swap files "
                f"({err.strerror or err} in {str(self.path)!r})"
            ) from None

    def remove(self) -> None:
        """Remove the directory and release its lock (once; later calls do nothing)."""
        self._finalizer()


T = TypeVar("T")


def on_every_rank(world: Communicator, what: str, make: Callable[[], T], undo: Callable[[T], None] | None = None) -> T:
    """``make()`` on every rank; if it raises :class:`OffloadError` on any, every rank raises one error naming
    them all (after ``undo(result)`` where it succeeded) instead of the others running into a collective that
    never comes. Collective over ``world``."""
    result, error = None, None
    try:
        result = make()
    except OffloadError as err:
        error = str(err)
    failed = [e for e in world.all_gather_object(error, what=what) if e is not None]
    if failed:
        if error is None and undo is not None:
            undo(result)
        raise OffloadError("; ".join(failed))
    return result


def prepare_scratch(root: str | Path, rank: int, what: str, world: Communicator) -> ScratchDir:
    """Every rank makes its scratch directory; if any fails, every rank raises one error naming them all.
    Collective over ``world``."""
    return on_every_rank(
        world, f"{what} swap directory check", partial(ScratchDir, root, rank, what), ScratchDir.remove
    )


# -- swap files ------------------------------------------------------------------------------------


def _write_at(fd: int, data: memoryview, offset: int) -> int:
    """One positional write (tests replace it to simulate a full disk)."""
    return os.pwritev(fd, [data], offset)


def _read_at(fd: int, out: memoryview, offset: int) -> int:
    return os.preadv(fd, [out], offset)


def _bytes_of(t: torch.Tensor) -> memoryview:
    if t.device.type != "cpu":  # the state of a host step; a device tensor here is a wiring bug, said plainly
        raise OffloadError(f"a swap file holds host memory; got a tensor on {t.device} (a bug in shardtrain)")
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


GRAD = "grad"  # the file key of a gradient shard (see [Note: gradient offload] in shardtrain.offload.gradients)


def _what(key: str) -> str:
    return "gradients" if key == GRAD else "optimizer state"


class SwapFiles:
    """One file per (stepped tensor, state key) in a scratch directory, opened only for each read or write (see
    [Note: bounded descriptors]); errors name the file. Reads and writes off the training thread run on the two I/O
    threads of :meth:`submit`."""

    def __init__(self, scratch: ScratchDir, rank: int) -> None:
        self.scratch, self.rank = scratch, rank
        self._lock = threading.Lock()
        # started at the first submit; os.preadv / os.pwritev release the GIL, so they overlap the training thread
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="shardtrain-swap")
        self.bytes_read = self.bytes_written = 0  # since construction (benchmarks report the bandwidth)
        self.open_now = self.most_open = 0  # descriptors open at once (tests read the most)

    def path(self, member: int | str, key: str) -> Path:
        return self.scratch.path / f"{member}.{key}.bin"

    @contextlib.contextmanager
    def _open(self, member: int | str, key: str, flags: int) -> Any:
        fd = os.open(self.path(member, key), flags | os.O_CLOEXEC, 0o600)
        with self._lock:
            self.open_now += 1
            self.most_open = max(self.most_open, self.open_now)
        try:
            yield fd
        finally:
            with self._lock:
                self.open_now -= 1
            os.close(fd)

    def write(self, member: int | str, key: str, t: torch.Tensor) -> None:
        data = _bytes_of(t.detach().contiguous())
        if not len(data):
            return  # an empty fragment has no file
        try:
            with self._open(member, key, os.O_WRONLY | os.O_CREAT) as fd:
                done = 0
                while done < len(data):
                    n = _write_at(fd, data[done:], done)
                    if n <= 0:
                        raise OSError(0, f"wrote {done} of {len(data)} bytes")
                    done += n
                if done >= DROP_BYTES:  # see [Note: page cache]
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with self._lock:
                self.bytes_written += done
        except OSError as err:
            raise OffloadError(
                f"rank {self.rank}: writing {_what(key)} to {str(self.path(member, key))!r} failed: "
                f"{err.strerror or err}"
            ) from None

    def read(self, member: int | str, key: str, out: torch.Tensor, offset: int = 0) -> None:
        """Fill ``out`` from the file's bytes at ``offset`` on."""
        data = _bytes_of(out)
        if not len(data):
            return
        try:
            with self._open(member, key, os.O_RDONLY) as fd:
                done = 0
                while done < len(data):
                    n = _read_at(fd, data[done:], offset + done)
                    if n <= 0:
                        raise OSError(0, f"the file ends after {done} of {len(data)} bytes")
                    done += n
                if done >= DROP_BYTES:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with self._lock:
                self.bytes_read += done
        except OSError as err:
            raise OffloadError(
                f"rank {self.rank}: reading {_what(key)} from {str(self.path(member, key))!r} failed: "
                f"{err.strerror or err}"
            ) from None

    def mapped(self, member: int, key: str, dtype: torch.dtype, numel: int, shared: bool = False) -> torch.Tensor:
        """The file as a tensor whose pages are read when touched, never all at once; ``shared``: writes to the
        tensor go to the file (else they stay private to it). The mapping keeps no descriptor open."""
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.from_file(str(self.path(member, key)), shared=shared, size=numel, dtype=dtype)

    def submit(self, work: Callable[..., Any], *args: Any) -> Future:
        """Run ``work(*args)`` on one of the two I/O threads (the optimizer state's reads and write-backs, the
        gradient shards' writes)."""
        return self._threads.submit(work, *args)

    def close(self) -> None:
        """Wait for the work submitted and stop the I/O threads (no file stays open between reads and writes)."""
        self._threads.shutdown(wait=True)
