"""Durable file operations of the save protocol, and the test hook that kills a save at a chosen point.

Durability on POSIX needs the data fsynced before it is renamed into place, and the directory fsynced after a rename
so that the new name survives a power loss; SIGKILL alone keeps the page cache, so the crash tests exercise the
ordering and the fsyncs are what extend it to power loss.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardtrain.checkpoint.format import FileEntry, crc32_of_bytes

# Test hook: the process that reaches the named point of the protocol kills itself with SIGKILL; ``<point>:<n>``: the
# n-th time it reaches it (a later save's, whichever thread runs it: an asynchronous save's commit may still be
# running when the next save is armed). Only the crash-safety tests and examples/elastic_train.py set it; the points
# are listed in protocol order.
KILL_ENV = "SHARDTRAIN_CHECKPOINT_KILL_AT"
CRASH_POINTS = (
    "start",
    "tmp_created",
    "tensor_file_torn",
    "tensor_file_written",
    "objects_written",
    "files_synced",
    "manifest_torn",
    "manifest_written",
    "tmp_synced",
    "latest_torn",  # the journal (latest.tmp): from its fsync on, the save is committed
    "latest_tmp_written",
    "renamed",
    "latest_renamed",
    "done",
)


_reached: dict[str, int] = {}  # how many times this process reached each point (for ``<point>:<n>``)


def crash_point(name: str, path: Path | None = None) -> None:
    point, _, nth = os.environ.get(KILL_ENV, "").partition(":")
    if point != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if nth and _reached[name] != int(nth):
        return
    if path is not None:  # a torn write: the file holds only its first half when the process dies
        with open(path, "r+b") as f:
            f.truncate(max(1, os.path.getsize(path) // 2))
    os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def naming(path: Path) -> Iterator[None]:
    """Give ``path`` to an OSError that has no file name: a failed ``write`` or ``fsync`` ("No space left on device",
    "Input/output error") says nothing of the file it was writing."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror or str(err), str(path)) from err


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable)."""
    with naming(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_object_file(path: Path, rank: int, data: bytes) -> FileEntry:
    """A small file written whole and fsynced, with the CRC-32 of its bytes (the object files)."""
    with naming(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(path.name, rank, len(data), crc32_of_bytes(data))
