"""Run a function on several local processes (gloo, free port), for tests and benchmarks.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, each of which joins a process
group and calls ``fn(*args)``; it returns the per-rank return values. If any rank raises, the call raises
:class:`DistributedFailure` with every failing rank's traceback; if the ranks do not all finish within
``timeout`` seconds, all are killed and the failure names the ranks still running. The suite never hangs.

In pytest, parametrize over world sizes and call it from the test::

    @pytest.mark.parametrize("world_size", [1, 2, 3])
    def test_something(world_size):
        results = run_distributed(_body, world_size, arg)

``fn`` must be importable (defined at module level) because processes are started fresh. Each rank has the
environment its caller had when it started the ranks.

Failure tests (a rank killed, a disk full) use :func:`run_ranks` instead: it never raises for a rank's failure,
waits until every process has exited on its own, and returns each rank's :class:`RankOutcome` (return value or
traceback, exit code, exit time, whether the harness had to kill it).

[Note: the caller's deadline]
A test runner that stops a test after a time of its own (pytest-timeout) would stop it before a longer
``timeout`` given here could fire, without the message that names the ranks still running. So a runner may
publish its deadline in ``SHARDTRAIN_TEST_DEADLINE`` (seconds since the epoch; the suite's ``conftest.py`` sets it
for each test, a few seconds before pytest-timeout's): both functions then wait at most until then, whatever
``timeout`` says, and say which limit ended the wait.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_CTX = mp.get_context("forkserver")
_PRELOADED = ["torch", "torch.distributed", "torch._dynamo", "shardtrain"]
_CTX.set_forkserver_preload(_PRELOADED)


def preload(*modules: str) -> None:
    """Import ``modules`` once in the server the ranks are forked from, besides torch and shardtrain, so that no
    rank imports them again: a suite whose ranks build Hugging Face models saves the import of transformers and of
    each model's module (seconds per rank on a small machine). Call it before the first rank starts (a test suite's
    ``conftest.py``); later calls do not reach a server already running. A module that fails to import there is
    skipped by multiprocessing, and imported by the rank that needs it as before, so the list changes no result.
    Module-level settings read at import (environment variables) are those of the moment the server starts."""
    _CTX.set_forkserver_preload(_PRELOADED + [m for m in modules if m not in _PRELOADED])


class DistributedFailure(AssertionError):
    """One or more ranks failed or timed out."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    kwargs: dict,
    results,
    threads: int,
    init_pg: bool,
    environ: dict[str, str],
) -> None:
    import torch
    import torch.distributed as dist

    # The caller's environment when it started this rank. A rank is forked from a server started once, whose
    # environment is the one of that moment: a setting made since (a test's device, DS_ACCELERATOR) would be lost.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if init_pg:  # the group is gloo's: the engine must train on the CPU, on a machine with a GPU too
        os.environ.setdefault("SHARDTRAIN_DEVICE", "cpu")
    torch.set_num_threads(threads)
    try:
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
        value = fn(*args, **kwargs)
        # plain pickle copies tensor data: torch's queue reducer would share memory with a process about to exit
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _start(fn: Callable, world_size: int, args: tuple, kwargs: dict, threads: int | None, init_pg: bool):
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    results = _CTX.Queue()
    port = _free_port()
    environ = dict(os.environ)  # one for every rank
    procs = [
        _CTX.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, kwargs, results, threads, init_pg, environ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs, results


DEADLINE_ENV = "SHARDTRAIN_TEST_DEADLINE"


def _bounded(timeout: float) -> tuple[float, str]:
    """``timeout``, or less when the caller's deadline comes first (see [Note: the caller's deadline]), and how to
    name it in a message."""
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline is None:
        return timeout, f"{timeout:g}s"
    left = max(float(deadline) - time.time(), 1.0)
    if left >= timeout:
        return timeout, f"{timeout:g}s"
    return left, f"{left:.0f}s (the test's deadline, before its own timeout of {timeout:g}s)"


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240.0,
    threads: int | None = None,
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results ordered by rank.

    With ``init_process_group=False`` only the torchrun-style environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) is set and ``fn`` (e.g. ``shardtrain.initialize``) creates the group.
    """
    timeout, limit = _bounded(timeout)
    procs, results = _start(fn, world_size, args, kwargs, threads, init_process_group)
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
                outcome[rank] = (status, value)
                if status == "error":  # give the others a moment to report, then stop waiting
                    deadline = min(deadline, time.monotonic() + 10)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode not in (None, 0)]
                for r in dead:
                    outcome[r] = ("error", f"process exited with code {procs[r].exitcode} without a result")
                if dead:
                    deadline = min(deadline, time.monotonic() + 10)
    finally:
        for p in procs:
            p.join(timeout=5 if len(outcome) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(outcome.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in outcome]
    if errors or missing:
        head = f"{fn.__name__} on {world_size} rank(s): "
        if missing:
            head += f"rank(s) {missing} did not finish within {limit} (killed). "
        raise DistributedFailure(head + "\n" + "\n".join(errors))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]


@dataclass(frozen=True)
class RankOutcome:
    """How one rank of :func:`run_ranks` ended."""

    rank: int
    value: Any = None
    """``fn``'s return value, when it returned."""
    error: str | None = None
    """The traceback, when ``fn`` raised."""
    exitcode: int | None = None
    """The process's exit status; ``-9`` when it was killed with SIGKILL; None when the harness had to kill it."""
    exited_after: float | None = None
    """Seconds from the start of :func:`run_ranks` until the process was seen gone (within 50 ms)."""

    @property
    def killed_by_harness(self) -> bool:
        return self.exitcode is None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int | None = None,
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[RankOutcome]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and report how each ended, for failure tests.

    Never raises for a rank's failure. Waits until every process has exited on its own; a process still running
    ``timeout`` seconds after the start is killed and reported with ``exitcode=None``, so a test can assert that no
    process was left behind (or at the caller's deadline, [Note: the caller's deadline])."""
    timeout, _ = _bounded(timeout)
    start = time.monotonic()
    procs, results = _start(fn, world_size, args, kwargs, threads, init_process_group)
    reported: dict[int, tuple[str, Any]] = {}
    exited: dict[int, float] = {}

    def drain(wait: float) -> None:
        try:
            while True:
                rank, status, value = results.get(timeout=wait)
                reported[rank] = (status, value)
        except queue.Empty:
            pass

    try:
        while len(exited) < world_size and time.monotonic() - start < timeout:
            drain(0.05)
            for r, p in enumerate(procs):
                if r not in exited and p.exitcode is not None:
                    exited[r] = time.monotonic() - start
        drain(0.2)  # a result put just before its process exited
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    outcomes = []
    for r, p in enumerate(procs):
        status, value = reported.get(r, (None, None))
        outcomes.append(
            RankOutcome(
                rank=r,
                value=pickle.loads(value) if status == "ok" else None,
                error=value if status == "error" else None,
                exitcode=p.exitcode if r in exited else None,
                exited_after=exited.get(r),
            )
        )
    return outcomes


def drop_cache(path: Path) -> None:
    """Evict a file (or every file under a directory) from the page cache; its pages are clean after fsync."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
