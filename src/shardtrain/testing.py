"""Run a function on several local processes (gloo, free port), for tests and benchmarks.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, each of which joins a process
group and calls ``fn(*args)``; it returns the per-rank return values. If any rank raises, the call raises
:class:`DistributedFailure` with every failing rank's traceback; if the ranks do not all finish within
``timeout`` seconds, all are killed and the failure names the ranks still running. The suite never hangs.

In pytest, parametrize over world sizes and call it from the test::

    @pytest.mark.parametrize("world_size", [1, 2, 3])
    def test_something(world_size):
        results = run_distributed(_body, world_size, arg)

``fn`` must be importable (defined at module level) because processes are started fresh.
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
from typing import Any

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "shardtrain"])


class DistributedFailure(AssertionError):
    """One or more ranks failed or timed out."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict, results, threads: int, init_pg: bool
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
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
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    results = _CTX.Queue()
    port = _free_port()
    procs = [
        _CTX.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, kwargs, results, threads, init_process_group),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
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
            head += f"rank(s) {missing} did not finish within {timeout:g}s (killed). "
        raise DistributedFailure(head + "\n" + "\n".join(errors))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]
