"""Why a collective failed: which rank is gone, whether a timeout really fired, and where this rank was.

[Note: naming the rank that vanished]
Gloo's error for a killed peer names a listening socket, not a rank, and under a ring the failing connection is often
to another survivor. So ranks use the rendezvous store, which all can reach:
1. building a :class:`~shardtrain.distributed.communicator.Communicator` writes ``shardtrain/proc/<global rank>`` =
   (host, machine id, pid); after its first collectives complete it reads the peers' entries, to still tell who is
   gone once the store's host has exited;
2. on a failure it first writes ``shardtrain/failed/<rank>`` = (pid, time), then classifies each peer: *reported*,
   *gone* (process absent or a zombie on this machine, or recorded ``shardtrain/gone/<rank>`` by another rank, which
   it records in turn), *alive* (exists, no report), *unknown* (exists, store lost first) or *silent* (other
   machine, no report). Keys with another pid than the registered one are from an earlier torchrun attempt: ignored;
3. it polls until every peer reported or is gone, at most :data:`SETTLE_S` for a live rank of this machine (it may be
   blocked in a collective with us) and :data:`REPORT_WAIT_S` for other machines;
4. it writes ``shardtrain/surveyed/<rank>`` and waits for the reporters' keys: the store's host must not exit, taking
   the store, before slower survivors have asked.

The first failure is the earliest gone/failed record (it still names rank 2 after rank 0, the store host, recorded it
and exited). An unreachable store means its host is gone (rank 0, or the first node's torchrun agent when the user's
group uses that store; [Note: restarts under torchrun] in ``shardtrain.distributed.mesh``): what was read is kept, a
running process is *unknown*, never "did not fail". A store that does not answer in time names its host as stopped,
hung or unreachable ([Note: every wait on the store is bounded] in ``shardtrain.distributed.store_calls``). A timeout
needs ``elapsed >= TIMEOUT_FRACTION * timeout``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from shardtrain.distributed import store_calls
from shardtrain.distributed.store_calls import BoundedStore, StoreSilentError

REPORT_WAIT_S = 3.0
"""How long a failing rank waits for ranks on other machines to report the same failure."""
SETTLE_S = 0.5
"""How long it waits for a rank on this machine whose process exists to report: such a rank may be blocked in a
collective with this one until this process exits, so a long wait would only delay both."""
TIMEOUT_FRACTION = 0.9
"""A collective that failed after this fraction of its timeout counts as timed out."""

_PROC_KEY = "shardtrain/proc/{}"
_FAILED_KEY = "shardtrain/failed/{}"
_GONE_KEY = "shardtrain/gone/{}"
_SURVEYED_KEY = "shardtrain/surveyed/{}"
_PACKAGE = Path(__file__).resolve().parents[1]  # the shardtrain package
# package files that call the API like a user (relative to the package)
_LAUNCHERS = {"testing/__init__.py", "testing/parity.py", "cli/__init__.py", "cli/demo.py", "__main__.py"}


# -- liveness: one answer, for the failure survey here and for swap directories (shardtrain.offload.swap) -------------


def _machine_id() -> str:
    """The same string for every process that shares this process table (host, boot, pid namespace): two
    containers with the same host name (host networking) but their own pid namespaces differ here."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return "|".join(parts)


def process_start(pid: int) -> str | None:
    """The start time of ``pid`` (field 22 of /proc/<pid>/stat), to tell a reused pid from the original."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def process_record() -> dict[str, Any]:
    """This process as :func:`process_alive` can judge it later, from any process: host, machine, pid, start."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "machine": _machine_id(), "pid": pid, "started": process_start(pid)}


def process_alive(record: dict[str, Any]) -> bool | None:
    """Whether the process ``record`` names (see :func:`process_record`) still runs: True or False when it ran on
    this machine (same host, boot and pid namespace), None when that cannot be told from here (another machine,
    or a record without its machine). A pid is only meaningful inside its own pid namespace: without this check a
    process in another container of the same host name looks gone."""
    if record.get("machine") != _machine_id():
        return None
    try:
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return None
    if pid <= 0 or _process_gone(pid):
        return False
    started, now = record.get("started"), process_start(pid)
    return started is None or now is None or now == started  # a different start time: the pid was reused


def process_stopped(record: dict[str, Any]) -> bool:
    """Whether the process ``record`` names runs on this machine and is stopped (SIGSTOP, a debugger's stop)."""
    if process_alive(record) is not True:
        return False
    try:
        stat = Path(f"/proc/{int(record['pid'])}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError, KeyError, TypeError, ValueError):
        return False


def _process_gone(pid: int) -> bool:
    """True when ``pid`` no longer exists on this machine or is a zombie (exited, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X", "x")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def _default_store() -> Any | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # not initialized, or an older/newer torch without it: the survey is skipped
        return None


def bounded_store() -> BoundedStore | None:
    """The default group's store, every call bounded ([Note: every wait on the store is bounded] in
    :mod:`shardtrain.distributed.store_calls`); None without one."""
    store = _default_store()
    return BoundedStore(store) if store is not None else None


def register(global_rank: int, timeout_s: float) -> None:
    """Step 1 of the Note: make this rank's process findable by the others; store calls are bounded by
    ``timeout_s`` (the collective timeout) from now on. Never raises."""
    store_calls.use_collective_timeout(timeout_s)
    store = bounded_store()
    if store is None:
        return
    me = process_record()
    with contextlib.suppress(Exception):  # a store that refuses it only costs the survey its answers
        store.set(_PROC_KEY.format(global_rank), json.dumps(me))


_known: dict[int, dict] = {}
"""Peers' registrations read once their first collective with this rank completed (step 1b of the Note)."""


def remember(peers: list[int]) -> bool:
    """Read the registrations of ``peers`` not read yet; True when every one is known. Never raises."""
    store = bounded_store()
    if store is None:
        return True
    try:
        for r in peers:
            if r not in _known and store.check([_PROC_KEY.format(r)]):
                _known[r] = json.loads(store.get(_PROC_KEY.format(r)))
    except Exception:
        return True
    return all(r in _known for r in peers)


@dataclass
class Survey:
    """What a failing rank learnt about the other ranks of its group (step 2 of the Note)."""

    reported: list[int] = field(default_factory=list)
    gone: list[tuple[int, str]] = field(default_factory=list)  # (rank, "pid 123 on host")
    alive: list[tuple[int, str]] = field(default_factory=list)
    unknown: list[tuple[int, str]] = field(default_factory=list)  # alive when the store went away
    stopped: list[tuple[int, str]] = field(default_factory=list)  # a process of this machine stopped (SIGSTOP)
    silent: list[tuple[int, str]] = field(default_factory=list)  # (rank, host or "unknown host")
    store_error: str | None = None
    store_silent: bool = False
    """The store did not answer in time (its host stopped or hung) rather than refused (its host gone)."""
    waited_s: float = 0.0
    """How long the survey waited for the others to report."""
    events: dict[int, tuple[float, str]] = field(default_factory=dict)
    """The store's record, by rank: (wall time, "reported its failure" or "was found gone by rank N")."""

    def first(self) -> tuple[int, str] | None:
        """The rank that failed first by the store's record, and how it is known; None without such a record. A rank
        found gone comes before every rank that reported a failure: it died without reporting, and its loss is what
        made the others' collectives fail (it is found only after they failed, so its time is later)."""
        if not self.events:
            return None
        rank, (_, how) = min(self.events.items(), key=lambda e: ("found it gone" not in e[1][1], e[1][0], e[0]))
        return rank, how


_surveys: dict[tuple[int, tuple[int, ...]], Survey] = {}
"""Surveys already made, by (store, peers): once a collective failed, the process group is broken and the next
collective fails for the same reason (e.g. the reductions still in flight when backward unwinds)."""


def any_failed() -> bool:
    """Whether a collective of this process has failed (its groups are broken)."""
    return bool(_surveys)


def survey(global_rank: int, peers: list[int]) -> Survey:
    """Report this rank's failure and classify ``peers`` (global ranks); see the Note. Never raises."""
    store = bounded_store()
    if store is None:
        return Survey(silent=[(r, "unknown host") for r in peers])
    key = (store.key, tuple(peers))
    if key not in _surveys:
        _surveys[key] = _survey(store, global_rank, peers)
    return _surveys[key]


def _survey(store: BoundedStore, global_rank: int, peers: list[int]) -> Survey:
    out = Survey()
    procs: dict[int, dict] = {r: _known[r] for r in peers if r in _known}
    status: dict[int, str] = {}

    def lost_store(err: Exception) -> None:
        out.store_silent = isinstance(err, StoreSilentError)
        out.store_error = str(err) if out.store_silent else f"{type(err).__name__}: {_first_line(str(err))}"

    try:
        store.set(_FAILED_KEY.format(global_rank), f"{os.getpid()} {time.time():.6f}")
    except Exception as err:
        lost_store(err)
    start = time.monotonic()
    while True:
        for r in peers:
            if status.get(r) in ("reported", "gone"):
                continue
            if out.store_error is None:
                try:
                    if r not in procs and store.check([_PROC_KEY.format(r)]):
                        procs[r] = json.loads(store.get(_PROC_KEY.format(r)))
                    when = _written_by(store, _FAILED_KEY.format(r), procs.get(r))
                    if when is not None:
                        status[r] = "reported"
                        out.events[r] = (when, "reported its failure")
                        continue
                    found = _gone_record(store, r, procs.get(r))
                    if found is not None:
                        status[r] = "gone"
                        out.events[r] = (found[1], f"rank {found[0]} found it gone")
                        continue
                except Exception as err:  # the store went away while we asked (its host is gone), or is silent
                    lost_store(err)
            alive = process_alive(procs[r]) if r in procs else None  # None: another machine
            if alive is not None:
                status[r] = "alive" if alive else "gone"
                if not alive and out.store_error is None:
                    _record_gone(store, r, procs[r], global_rank, out)
        waited = time.monotonic() - start
        pending = [r for r in peers if status.get(r) not in ("reported", "gone")]
        if not pending or out.store_error is not None or waited >= REPORT_WAIT_S:
            break
        if waited >= SETTLE_S and all(status.get(r) == "alive" for r in pending):
            break  # an alive rank may be blocked in a collective with this one: waiting longer would hold it there
        time.sleep(0.02)
    out.waited_s = time.monotonic() - start
    if out.store_error is None:  # step 4: stay until the others have asked too, in case this process hosts the store
        _linger(store, global_rank, {r: procs.get(r) for r in peers if status.get(r) == "reported"})

    def where(r: int) -> str:
        info = procs.get(r)
        return f"pid {info['pid']} on {info['host']}" if info else "unknown host"

    for r in peers:
        s = status.get(r)
        if s == "reported":
            out.reported.append(r)
        elif s == "gone":
            out.gone.append((r, where(r)))
        elif s == "alive" and procs.get(r) and process_stopped(procs[r]):
            out.stopped.append((r, where(r)))
        elif s == "alive" and out.store_error is not None:
            out.unknown.append((r, where(r)))
        elif s == "alive":
            out.alive.append((r, where(r)))
        elif out.store_error is None:
            out.silent.append((r, procs[r]["host"] if procs.get(r) else "unknown host"))
    return out


def peer_down(global_rank: int, peers: list[int]) -> str | None:
    """A sentence naming a peer (global rank) known to be down, or None: it reported a failure, a rank recorded it
    gone, or its process on this machine is gone. Reads the store only, writes nothing and never raises: the NCCL
    watchdog's probe of a collective that is taking long ([Note: failures under NCCL] in
    :mod:`shardtrain.distributed.watchdog`). A silent store says nothing yet: the collective's timeout decides
    ([Note: every wait on the store is bounded] in :mod:`shardtrain.distributed.store_calls`)."""
    store = bounded_store()
    if store is None:
        return None
    remember(peers)
    for r in peers:
        info = _known.get(r)
        try:
            if _written_by(store, _FAILED_KEY.format(r), info) is not None:
                return f"rank {r} reported a failure"
            found = _gone_record(store, r, info)
            if found is not None:
                return f"rank {r} is gone (found by rank {found[0]})"
        except StoreSilentError:
            return None
        except Exception as err:  # the store's host is gone: rank 0, or the agent
            return f"the store no longer answers ({type(err).__name__}): its host, {store_host(store.store)}, is gone"
        if info is not None and process_alive(info) is False:
            return f"rank {r} is gone (pid {info['pid']} on {info['host']})"
    return None


def _written_by(store: BoundedStore, key: str, info: dict | None) -> float | None:
    """When ``key`` was written (wall time; 0.0 when it does not say), if it exists and was written by the process
    ``info`` registered; None otherwise. A torchrun agent keeps its store across restarts, so a key may be left from
    the previous attempt, by a process that no longer exists. The value is "pid" or "pid time"."""
    if not store.check([key]):
        return None
    pid, _, when = store.get(key).decode().partition(" ")
    if info is not None and pid != str(info.get("pid")):
        return None
    try:
        return float(when) if when else 0.0
    except ValueError:
        return 0.0


def _gone_record(store: BoundedStore, rank: int, info: dict | None) -> tuple[int, float] | None:
    """(the rank that found ``rank`` gone, when) from the store, or None; a record naming another pid than the one
    ``info`` registered is left from an earlier attempt and ignored."""
    key = _GONE_KEY.format(rank)
    if not store.check([key]):
        return None
    record = json.loads(store.get(key))
    if info is not None and record.get("pid") != info.get("pid"):
        return None
    return int(record["by"]), float(record["time"])


def _record_gone(store: BoundedStore, rank: int, info: dict, global_rank: int, out: Survey) -> None:
    """Step 2: tell the others, by the store, that this rank found ``rank`` gone (the first finder's record stays)."""
    now = time.time()
    out.events.setdefault(rank, (now, f"rank {global_rank} found it gone"))
    record = json.dumps({"by": global_rank, "time": now, "pid": info.get("pid")})
    with contextlib.suppress(Exception):
        store.compare_set(_GONE_KEY.format(rank), "", record)


def _linger(store: BoundedStore, global_rank: int, reported: dict[int, dict | None]) -> None:
    """Mark this rank's survey done; wait (at most :data:`REPORT_WAIT_S`) until the ranks that reported are done."""
    start = time.monotonic()
    try:
        store.set(_SURVEYED_KEY.format(global_rank), str(os.getpid()))
        while time.monotonic() - start < REPORT_WAIT_S:
            if all(_written_by(store, _SURVEYED_KEY.format(r), info) is not None for r, info in reported.items()):
                return
            time.sleep(0.02)
    except Exception:
        pass


def store_host(store: Any | None = None) -> str:
    """Who hosts the rendezvous store (default: the process group's), for the message when it cannot be reached.

    Under torchrun shardtrain's own group uses rank 0's store of the attempt, not the agent's
    (:func:`shardtrain.distributed.mesh.attempt_store`): the agent hosts it only when its port is the agent's
    ``MASTER_PORT`` (a group the user initialized from the environment)."""
    store = _default_store() if store is None else store
    host = store_calls.host_of(store)
    return host if host != "rank 0" else "rank 0, which hosts it (killed, e.g. by the OOM killer, or exited)"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


_GLOO_PATH = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


def backend_text(err: BaseException) -> str:
    """The backend's message without its source location and boilerplate (the full text stays the cause)."""
    text = _GLOO_PATH.sub("", _first_line(str(err)))
    return text.split(". This is typically caused", 1)[0].strip()


def peer_lost_text(err: BaseException) -> bool:
    """Does the backend's message say that a connection to a peer broke?"""
    text = str(err).lower()
    return any(
        s in text
        for s in ("connection reset", "connection closed", "broken pipe", "connection refused", "closed by peer")
    )


def backend_error(err: BaseException) -> bool:
    """Does ``err`` come from the communication backend (a gloo source location, NCCL, a broken connection)?"""
    text = str(err)
    # gloo closes a connection when an operation on it times out; another operation in flight on it (in a graph, an
    # all-gather issued ahead while a reduce-scatter is waited for) then fails with a message without a location
    closed = "timeout caused pair closure" in text
    return bool(_GLOO_PATH.search(text)) or "NCCL" in text or closed or peer_lost_text(err)


def api_call(frame: FrameType | None = None) -> str | None:
    """Where this rank was: the outermost shardtrain call on the stack and the user's line that made it, e.g.
    ``Engine.backward (called from train.py:57)``; None when no such frame is found. ``frame``: the innermost frame
    of the stack to read (default: the caller's; the NCCL watchdog passes the main thread's)."""
    frame = frame if frame is not None else sys._getframe(1)
    stack: list[FrameType] = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    for i in range(len(stack) - 1, -1, -1):  # outermost first
        path = stack[i].f_code.co_filename
        if not path.startswith(f"{_PACKAGE}{os.sep}") or Path(path).relative_to(_PACKAGE).as_posix() in _LAUNCHERS:
            continue
        f = stack[i]
        if f.f_code.co_name == "__call__" and i > 0 and stack[i - 1].f_code.co_filename == path:
            f = stack[i - 1]  # engine(...) -> Engine.forward
        owner = f.f_locals.get("self")
        name = f"{type(owner).__name__}.{f.f_code.co_name}" if owner is not None else f.f_code.co_name
        caller = stack[i + 1] if i + 1 < len(stack) else None
        if caller is None:
            return name
        return f"{name} (called from {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno})"
    return None


def _ranks(items: list[tuple[int, str]]) -> str:
    return ", ".join(f"rank {r} ({w})" for r, w in items)


def explain(s: Survey) -> tuple[bool, str]:
    """(a peer is known to be gone, the sentences that say what is known of the other ranks)."""
    parts: list[str] = []
    lost = False
    if s.store_silent:
        lost = True
        parts.append(f"the rendezvous store does not answer: {s.store_error}")
    elif s.store_error is not None:
        lost = True
        parts.append(
            f"the rendezvous store no longer answers ({s.store_error}), so the process hosting it is gone: "
            f"{store_host()}"
        )
    if s.gone:
        lost = True
        verb = "is" if len(s.gone) == 1 else "are"
        parts.append(
            f"{_ranks(s.gone)} {verb} gone: killed (the OOM killer, SIGKILL) or exited before completing this "
            "collective; its own output, torchrun's summary or the kernel log (dmesg) says which"
        )
    if s.silent:
        parts.append(f"{_ranks(s.silent)} did not answer within {REPORT_WAIT_S:g} s: gone, or hung")
    if s.alive:
        parts.append(
            f"{_ranks(s.alive)} is alive and had not reported a failure {s.waited_s:.2f} s after this one: it is on "
            "another code path, or busy"
        )
    if s.stopped:
        lost = True
        verb = "is" if len(s.stopped) == 1 else "are"
        parts.append(f"{_ranks(s.stopped)} {verb} stopped (SIGSTOP or a debugger): nothing it is part of can go on")
    if s.unknown:
        parts.append(
            f"{_ranks(s.unknown)} still ran when the store went away, so whether it failed too cannot be told here"
        )
    if s.reported:
        parts.append(f"rank(s) {s.reported} failed in the same way")
    first = s.first()
    if first is not None and (len(s.events) > 1 or len(s.gone) > 1):
        rank, how = first
        parts.append(f"by the store's record rank {rank} failed first ({how})")
    return lost, "; ".join(parts)
