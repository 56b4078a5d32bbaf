"""Swap files and the directories they live in: per-rank scratch directories under ``nvme_path`` and one file
per offloaded tensor, read and written with positional I/O; every error names the rank and the path.

[Note: page cache]
A write through the page cache only moves the state from this process's memory to the kernel's: a rank
whose state does not fit in memory would then fill the page cache with dirty pages, and a benchmark would
measure memory, not the disk. DeepSpeed reads and writes with O_DIRECT. Here a swap file of at least
``DROP_BYTES`` is synced (``fdatasync``, on the I/O thread, overlapped with the step) and dropped from the
cache (``posix_fadvise(DONTNEED)``) after each write, and dropped after each read; so the state really
leaves memory and a full disk surfaces at the step that wrote it (ENOSPC at write-back is reported by the
sync). Smaller files (biases, norms) stay cached: their bytes do not matter and a sync each would.

[Note: scratch directories]
Swap files are scratch, never state: each run makes ``<nvme_path>/shardtrain-swap-<host>-<pid>-rank<r>-*``
(``tempfile.mkdtemp``, so never an existing directory) with an ``owner.json`` naming host, pid and the
process's start time. It is removed by ``Engine.close()`` and at interpreter exit. A directory whose owner
on this host is no longer running (pid gone, or reused by a process started later) is from a killed run and
is removed when a new run prepares its own; a directory of another host, or of a live process, is left
alone. Checkpoints copy the state out (``OptimizerOffload.state_of`` maps the files; pages are read as the
writer goes) and loading writes it into fresh files.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

import torch

from shardtrain.comm import Communicator
from shardtrain.errors import OffloadError

PREFIX = "shardtrain-swap-"
MARKER = "owner.json"
ALIGN = 4096  # the probe's size; buffer regions start on page boundaries too (and could use O_DIRECT)
DROP_BYTES = 1 << 20  # files at least this large leave the page cache after each write and read


# -- scratch directories ---------------------------------------------------------------------------


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` (field 22 of /proc/<pid>/stat), to tell a reused pid from the original."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _host_tag() -> str:
    """This host's name as scratch directory names carry it (no '-', which separates the fields)."""
    return socket.gethostname().replace("-", "_")


def _owner_alive(host: str, pid: int, started: str | None) -> bool | None:
    """Whether the process that made a scratch directory still runs; None when it ran on another host.
    ``started`` None: not known (the marker is not written yet), a live pid counts as the owner."""
    if host != _host_tag():
        return None
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    now = _process_start(pid)
    return started is None or now is None or now == started


def clear_stale(root: Path) -> list[Path]:
    """Remove scratch directories under ``root`` left by runs that are gone (see [Note: scratch directories])."""
    removed = []
    for d in root.glob(PREFIX + "*"):
        parts = d.name[len(PREFIX) :].split("-")
        if not d.is_dir() or len(parts) < 4 or not parts[-3].isdigit():
            continue
        started = None  # no marker yet (its run is between mkdtemp and writing it) or a damaged one: the name tells
        with contextlib.suppress(OSError, ValueError, AttributeError):
            started = json.loads((d / MARKER).read_text()).get("started")
        if _owner_alive("-".join(parts[:-3]), int(parts[-3]), started) is False:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


_LIVE: weakref.WeakSet[ScratchDir] = weakref.WeakSet()


@atexit.register
def _remove_all() -> None:
    for d in list(_LIVE):
        d.remove()


class ScratchDir:
    """This rank's fresh swap directory under ``root``, checked by writing, syncing and reading a probe file."""

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
        _LIVE.add(self)
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_start(os.getpid())}
        probe = self.path / "probe"
        try:
            (self.path / MARKER).write_text(json.dumps(owner))
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
        shutil.rmtree(self.path, ignore_errors=True)
        _LIVE.discard(self)


def on_every_rank(world: Communicator, what: str, make: Any, undo: Any = None) -> Any:
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
        world, f"{what} swap directory check", lambda: ScratchDir(root, rank, what), lambda d: d.remove()
    )


# -- swap files ------------------------------------------------------------------------------------


def _write_at(fd: int, data: memoryview, offset: int) -> int:
    """One positional write (tests replace it to simulate a full disk)."""
    return os.pwritev(fd, [data], offset)


def _read_at(fd: int, out: memoryview, offset: int) -> int:
    return os.preadv(fd, [out], offset)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class SwapFiles:
    """One file per (stepped tensor, state key) in a scratch directory; errors name the file."""

    def __init__(self, scratch: ScratchDir, rank: int) -> None:
        self.scratch, self.rank = scratch, rank
        self._fds: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0  # since construction (benchmarks report the bandwidth)

    def path(self, member: int, key: str) -> Path:
        return self.scratch.path / f"{member}.{key}.bin"

    def _fd(self, member: int, key: str) -> int:
        with self._lock:
            if (member, key) not in self._fds:
                self._fds[(member, key)] = os.open(self.path(member, key), os.O_RDWR | os.O_CREAT, 0o600)
            return self._fds[(member, key)]

    def write(self, member: int, key: str, t: torch.Tensor) -> None:
        data = _bytes_of(t.detach().contiguous())
        try:
            fd, done = self._fd(member, key), 0
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
                f"rank {self.rank}: writing optimizer state to {str(self.path(member, key))!r} failed: "
                f"{err.strerror or err}"
            ) from None

    def read(self, member: int, key: str, out: torch.Tensor) -> None:
        data = _bytes_of(out)
        try:
            fd, done = self._fd(member, key), 0
            while done < len(data):
                n = _read_at(fd, data[done:], done)
                if n <= 0:
                    raise OSError(0, f"the file ends after {done} of {len(data)} bytes")
                done += n
            if done >= DROP_BYTES:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with self._lock:
                self.bytes_read += done
        except OSError as err:
            raise OffloadError(
                f"rank {self.rank}: reading optimizer state from {str(self.path(member, key))!r} failed: "
                f"{err.strerror or err}"
            ) from None

    def mapped(self, member: int, key: str, dtype: torch.dtype, numel: int, shared: bool = False) -> torch.Tensor:
        """The file as a tensor whose pages are read when touched, never all at once; ``shared``: writes to the
        tensor go to the file (else they stay private to it)."""
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.from_file(str(self.path(member, key)), shared=shared, size=numel, dtype=dtype)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
