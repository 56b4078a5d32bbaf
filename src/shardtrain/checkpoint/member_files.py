"""Opening the files a checkpoint names: inside its directory, regular files only, never blocking.

[Note: checkpoint member files]
A checkpoint may have been downloaded, copied or damaged, so reading a file its manifest names must neither leave the
directory nor block: the name is a normalised relative path (``format.member_name_problem``: no ``..``, absolute, empty
or ``.`` component), checked when the manifest is parsed; joined to the directory it must resolve (through symlinks)
inside the directory's resolved path; it must ``stat`` as a regular file (a FIFO or device is refused unopened), is
opened with ``O_NONBLOCK`` and checked again with ``fstat``, so a FIFO swapped in between cannot block. Every refusal is
a ``CheckpointError`` naming the path and what it was needed for.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shardtrain.errors import CheckpointError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def confined_path(directory: Path, name: str, what: str) -> Path:
    """``directory / name``, refused unless it resolves to a path inside ``directory`` (``name`` was checked by the
    manifest; this catches symlinks out). A symlink loop resolves to itself and is refused by :func:`open_regular`."""
    path = directory / name
    root = os.path.realpath(directory)
    resolved = os.path.realpath(path)
    if os.path.commonpath([root, resolved]) != root:
        raise CheckpointError(
            f"{path}: resolves to {resolved}, outside the checkpoint directory {root}; refused (needed for {what})"
        )
    return path


def stat_regular(path: Path, what: str) -> os.stat_result:
    """``os.stat(path)`` (which opens nothing), refused unless ``path`` is a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing (needed for {what})") from None
    except OSError as err:  # ELOOP (a symlink loop), EACCES, ENAMETOOLONG, ...
        raise CheckpointError(f"{path}: cannot be opened ({err.strerror}; needed for {what})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: is {_kind(st.st_mode)}, not a regular file; refused (needed for {what})")
    return st


def open_regular(path: Path, what: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its ``fstat``; ``path`` must be a regular file (see the Note)."""
    stat_regular(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be opened ({err.strerror}; needed for {what})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: is {_kind(st.st_mode)}, not a regular file; refused (needed for {what})")
    return fd, st


def read_regular(path: Path, what: str, limit: int) -> bytes:
    """The bytes of regular file ``path`` (see :func:`open_regular`), refused when larger than ``limit``."""
    fd, st = open_regular(path, what)
    try:
        if st.st_size > limit:
            raise CheckpointError(f"{path}: {st.st_size} bytes, more than the {limit} allowed (needed for {what})")
        chunks, got = [], 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror}; needed for {what})") from None
    finally:
        os.close(fd)
    if got > limit:  # it grew while being read
        raise CheckpointError(f"{path}: more than the {limit} bytes allowed (needed for {what})")
    return b"".join(chunks)
