"""One job owns a save directory: a lock global rank 0 holds from the job's first save there, and a record of the job.

[Note: one job per save directory]
Two jobs saving into one directory (a relaunch while the old job still runs, a copied output path) destroy each
other's work: a save's setup removes the other's ``.tmp-*`` saves in progress, the "same save done again" rule
replaces its checkpoints of the same step, ``latest`` moves back. So a save first claims ``save_dir/.owner``
(:meth:`SaveDirOwner.claim`, on rank 0, which alone removes, renames and moves ``latest``): an exclusive ``flock`` on
an open descriptor, held until ``Engine.close`` (the engines of one process share it: one job), and a JSON record of
the job (host, pid, ``TORCHELASTIC_RUN_ID``, since when). Another job's save raises :class:`SaveDirInUseError` on
every rank, naming the owner, before anything in the directory is touched. A clean release removes the record; the
kernel drops the lock of a process that dies, so the next job (a torchrun restart of the same job too) takes over a
dead owner's record, and its save then finishes or drops what the crash left (``latest.recover``). A load claims
nothing (reading a running job's checkpoints is allowed) but skips that recovery while another process owns the
directory: it would race the owner's publish. The "same save done again" rule also needs the same run id ([Note:
saving a tag that exists] in ``writer.py``). flock holds on local filesystems, NFS (as a whole-file lock) and Lustre
mounted with ``flock``; where locks are not supported, a warning says that the directory is not guarded.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardtrain.errors import CheckpointError, SaveDirInUseError  # noqa: F401  importable from here too

log = logging.getLogger("shardtrain")

OWNER_NAME = ".owner"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
CLAIM_RETRY_S = 1.0  # a load's probe holds a shared lock for an instant: a claim retries this long before refusing


def run_id() -> str | None:
    """This job's torchrun run id; None outside torchrun and for torchrun's default id ``none`` (which every job
    launched without ``--rdzv-id`` shares)."""
    value = os.environ.get(RUN_ID_ENV)
    return None if value in (None, "", "none") else value


def job_record() -> dict[str, object]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "run_id": run_id(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def describe_owner(record: dict | None) -> str:
    if not record:
        return "a job whose record is not written yet"
    run = f", torchrun run id {record.get('run_id')}" if record.get("run_id") else ""
    return f"pid {record.get('pid')} on {record.get('host')}{run}, since {record.get('since')}"


@dataclass
class _Claim:
    path: Path
    fd: int
    inode: tuple[int, int]  # (device, inode) of the lock file: a directory deleted and made again is claimed anew
    holders: set[int] = field(default_factory=set)  # ids of the SaveDirOwner objects sharing it


_claims: dict[str, _Claim] = {}  # this process's claims, by the directory's real path


def _key(save_dir: Path) -> str:
    return os.path.realpath(save_dir)


def _current(save_dir: Path) -> _Claim | None:
    """This process's claim of ``save_dir``, if it still holds the lock file that is there."""
    claim = _claims.get(_key(save_dir))
    if claim is None:
        return None
    try:
        st = os.stat(save_dir / OWNER_NAME)
    except OSError:
        return None
    return claim if (st.st_dev, st.st_ino) == claim.inode else None


def _read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class SaveDirOwner:
    """The save directories one engine (one job) has claimed; see [Note: one job per save directory]."""

    def __init__(self) -> None:
        self._held: set[str] = set()

    def claim(self, save_dir: Path) -> None:
        """Own ``save_dir`` (which exists) from now until :meth:`release`; raises :class:`SaveDirInUseError` naming
        the owner when another process holds it."""
        key = _key(save_dir)
        claim = _current(save_dir)
        if claim is None:
            claim = _lock(save_dir)
            if claim is None:  # the filesystem has no locks: not guarded
                return
            stale = _claims.pop(key, None)  # a directory deleted and made again: the old descriptor goes
            if stale is not None:
                os.close(stale.fd)
            _claims[key] = claim
        claim.holders.add(id(self))
        self._held.add(key)

    def release(self) -> None:
        """Give up this owner's claims; a directory no other owner of this process holds is unlocked. Not
        collective."""
        for key in self._held:
            claim = _claims.get(key)
            if claim is None:
                continue
            claim.holders.discard(id(self))
            if not claim.holders:
                del _claims[key]
                with contextlib.suppress(OSError):
                    if _same_file(claim.fd, claim.path):  # a clean exit leaves no record (a crash leaves its own)
                        os.unlink(claim.path)
                os.close(claim.fd)  # drops the lock
        self._held.clear()


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _lock(save_dir: Path) -> _Claim | None:
    """Lock ``save_dir/.owner`` and write this job's record into it; None where the filesystem has no locks."""
    path = save_dir / OWNER_NAME
    deadline = time.monotonic() + CLAIM_RETRY_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            locked = _try_lock(fd, save_dir, path, deadline)
        except BaseException:
            os.close(fd)
            raise
        if locked is None:
            os.close(fd)
            return None
        if locked and _same_file(fd, path):  # else its owner removed it as we opened it: open the one there now
            break
        os.close(fd)
        time.sleep(0.05)
    record = json.dumps(job_record()).encode() + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    st = os.fstat(fd)
    return _Claim(path, fd, (st.st_dev, st.st_ino))


def _try_lock(fd: int, save_dir: Path, path: Path, deadline: float) -> bool | None:
    """True: locked; False: try again; None: no locks on this filesystem. Raises once ``deadline`` has passed."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        if time.monotonic() < deadline:
            return False
        raise SaveDirInUseError(
            f"{save_dir} belongs to another job ({describe_owner(_read_record(path))}), which holds the lock on "
            f"{path}: two jobs saving into one directory delete each other's saves in progress and replace each "
            "other's checkpoints. Save this job's checkpoints into another directory, or stop that job first (a job "
            "that has exited, or was killed, releases the directory)"
        ) from None
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        log.warning(
            "checkpoint directory %s: its filesystem does not support locks (%s); nothing stops another job from "
            "saving into it as well",
            save_dir,
            err,
        )
        return None


def owned_elsewhere(save_dir: Path) -> str | None:
    """Who owns ``save_dir`` when another process holds its lock (for a load, which then leaves its recovery to
    the owner); None when nobody does, or this process does. Writes nothing."""
    path = save_dir / OWNER_NAME
    if _current(save_dir) is not None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released by the close below
    except BlockingIOError:
        return describe_owner(_read_record(path))
    except OSError:
        return None
    finally:
        os.close(fd)
    return None
