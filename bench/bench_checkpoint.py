"""Checkpoint save/load throughput against the raw disk and torch.distributed.checkpoint; consolidation peak RSS.

    .venv/bin/python bench/bench_checkpoint.py [--size-gb 1.0] [--world 2] [--dir out/bench_checkpoint]

The state is ``--size-gb`` of float32 split into 16 logical tensors, each cut into ``--world`` ZeRO fragments (one
per rank). Measured in the same run, on the same directory:

* raw disk: one file of the same size written sequentially by one process in 64 MiB blocks and fsynced, then (after
  dropping it from the page cache with ``posix_fadvise(DONTNEED)``) read back sequentially, into one reused buffer
  and into fresh memory; and the same with every rank writing and reading its share to its own file in parallel;
* shardtrain save (collective, fsync, rename, ``latest``) and load (each rank reads its own fragments with checksum
  verification), after dropping the checkpoint's files from the page cache;
* ``torch.distributed.checkpoint.save`` / ``load`` of the same per-rank tensors (``sync_files=True``, its default);
* every round runs all of these in turn (shardtrain and DCP alternate which goes first); medians are reported;
* ``shardtrain checkpoint consolidate`` of the checkpoint in a fresh process: time and peak RSS growth (``VmHWM``
  after resetting it via ``/proc/self/clear_refs``), against twice the largest tensor;
* time training is blocked by an engine's save, synchronous against ``async_save=True``, in the same run
  (``--blocked-rounds``; ``--blocked-only`` runs this part alone): see :func:`_blocked_rank`;
* ``--load-only``: the load against a raw parallel read of the same files, paired per round (see
  :func:`_load_rank`); the page cache is checked to hold none of the files' pages before every timed read.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

import shardtrain
from shardtrain.checkpoint import FlatSlice, SavePiece, open_checkpoint, save
from shardtrain.distributed.communicator import Communicator
from shardtrain.testing import drop_cache, run_distributed

N_TENSORS = 16
BLOCK = 64 << 20


def resident_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` held in the page cache (``mincore`` over a shared read-only mapping, as
    util-linux's ``fincore`` does): proof that a timed read starts cold."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page, total = mmap.PAGESIZE, 0
    for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        size = f.stat().st_size
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {f} failed")
            try:
                vec = (ctypes.c_ubyte * (-(-size // page)))()
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {f} failed")
                total += sum(b & 1 for b in vec) * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def settle(seconds: float) -> None:
    """Flush dirty pages, then wait: a virtual disk keeps writing back on the host after fsync returns, and without
    a pause whichever method runs second in a round pays for the first one's writes."""
    os.sync()
    time.sleep(seconds)


def raw_disk(path: Path, nbytes: int) -> tuple[float, float, float]:
    """Sequential write (+fsync) and cold reads of one file of ``nbytes``: into one reused buffer (the disk's speed)
    and into freshly allocated memory (what any loader that creates tensors also pays). Returns seconds for each."""
    block = os.urandom(BLOCK)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // BLOCK):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    times = []
    for fresh in (False, True):
        drop_cache(path)
        buf = bytearray(BLOCK)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf if not fresh else bytearray(BLOCK)):
                pass
        times.append(time.perf_counter() - t0)
    path.unlink()
    return write_s, times[0], times[1]


def _local_state(rank: int, world: int, numel_per_tensor: int) -> list[SavePiece]:
    share = numel_per_tensor // world
    g = torch.Generator().manual_seed(rank)
    return [
        SavePiece(
            f"model/layer{i}.weight",
            (numel_per_tensor,),
            FlatSlice(rank * share, share),
            torch.randn(share, generator=g),
        )
        for i in range(N_TENSORS)
    ]


def _ours(comm: Communicator, path: Path, pieces: list[SavePiece], out: dict[str, float], settle_s: float) -> None:
    settle(settle_s)
    comm.barrier(what="bench: before save")
    t0 = time.perf_counter()
    save(path, "step1", comm, pieces)
    out["save_s"] = time.perf_counter() - t0
    comm.barrier(what="bench: after save")
    if comm.rank == 0:
        drop_cache(path)
    comm.barrier(what="bench: before load")
    t0 = time.perf_counter()
    reader = open_checkpoint(path)
    loaded = [reader.read(p.name, (p.slice.start, p.slice.start + p.slice.length)) for p in pieces]
    out["load_s"] = time.perf_counter() - t0
    assert all(torch.equal(a, p.tensor) for a, p in zip(loaded, pieces))
    del loaded
    # the same files read raw, in parallel (each rank its own file, as the load above): into one reused buffer and
    # into fresh memory
    mine = path / "step1" / f"rank{comm.rank:05d}.safetensors"
    for key, fresh in (("same_raw_s", False), ("same_fresh_s", True)):
        comm.barrier(what="bench: before raw read of the same files")
        if comm.rank == 0:
            drop_cache(path)
        comm.barrier(what="bench: cache dropped")
        t0 = time.perf_counter()
        buf = bytearray(BLOCK)
        with open(mine, "rb", buffering=0) as f:
            while f.readinto(buf if not fresh else bytearray(BLOCK)):
                pass
        out[key] = time.perf_counter() - t0


def _load_rank(root: str, world: int, numel_per_tensor: int, rounds: int, settle_s: float) -> list[dict[str, float]]:
    """One checkpoint saved once; per round, five timed reads of it by every rank at once, in an order that
    rotates and reverses from round to round: the shardtrain load of this rank's fragments (``reader.read``,
    checksums verified) into fresh result tensors and into tensors allocated before the rounds, and the raw read of
    this rank's file of the same checkpoint (sequential ``readinto`` of 64 MiB blocks: the reference) into one
    reused buffer and into freshly allocated memory; and, shown beside the reference, the same file read with the
    page cache bypassed (O_DIRECT, two threads: how the load read new results up to stop 30).

    Before each timed read every rank's files are evicted from the page cache (``fsync`` then
    ``posix_fadvise(DONTNEED)``, which needs no privileges) and ``resident_bytes`` checks that none of their pages
    is left; so every method starts from the same cold cache. Each records its wall and CPU (user + system) time."""
    comm = Communicator(dist.group.WORLD, 600.0)
    rank, path = comm.rank, Path(root) / "load"
    pieces = _local_state(rank, world, numel_per_tensor)
    save(path, "step1", comm, pieces)
    ckpt = path / "step1"
    mine = ckpt / f"rank{rank:05d}.safetensors"

    loaded: list[torch.Tensor] = []
    # where an engine's weights already are: read into them in place (allocated and touched once, outside timing)
    places = [torch.zeros(p.slice.length, dtype=p.tensor.dtype) for p in pieces]

    def load() -> None:
        reader = open_checkpoint(path)
        loaded[:] = [reader.read(p.name, (p.slice.start, p.slice.start + p.slice.length)) for p in pieces]

    def load_into() -> None:
        reader = open_checkpoint(path)
        for p, place in zip(pieces, places):
            reader.read(p.name, (p.slice.start, p.slice.start + p.slice.length), out=place)
        loaded[:] = places

    def raw(fresh: bool) -> None:
        buf = bytearray(BLOCK)
        with open(mine, "rb", buffering=0) as f:
            while f.readinto(buf if not fresh else bytearray(BLOCK)):
                pass

    def raw_direct() -> None:
        """Not the goal's reference, shown beside it: the file read around the page cache (O_DIRECT, two reader
        threads, 16 MiB requests), each thread into its own reused block-aligned buffer."""
        fd = os.open(mine, os.O_RDONLY | os.O_DIRECT)
        size, chunk = mine.stat().st_size, 16 << 20
        try:
            with ThreadPoolExecutor(2) as pool:
                halves = [(chunk * i, mmap.mmap(-1, chunk)) for i in range(2)]

                def reader(first: int, buf: mmap.mmap) -> None:
                    for pos in range(first, size // 4096 * 4096, 2 * chunk):
                        os.preadv(fd, [memoryview(buf)[: min(chunk, size // 4096 * 4096 - pos)]], pos)

                for f in [pool.submit(reader, first, buf) for first, buf in halves]:
                    f.result()
        finally:
            os.close(fd)

    methods = {
        "load": load,
        "load_into": load_into,
        "raw": lambda: raw(False),
        "raw_fresh": lambda: raw(True),
        "raw_direct": raw_direct,
    }
    names = list(methods)
    results = []
    for k in range(rounds):
        order = names[k % len(names) :] + names[: k % len(names)]
        order = order[::-1] if (k // len(names)) % 2 else order
        out: dict[str, float] = {"bytes": mine.stat().st_size, "round": k}
        for name in order:
            settle(settle_s)
            comm.barrier(what="bench: before dropping the cache")
            if rank == 0:
                drop_cache(path)
            comm.barrier(what="bench: cache dropped")
            out[f"{name}_resident"] = resident_bytes(ckpt)  # every rank's files: all must be cold
            comm.barrier(what="bench: before timed read")
            t0, c0 = time.perf_counter(), time.process_time()
            methods[name]()
            out[f"{name}_s"], out[f"{name}_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
            if loaded:  # the load is right (checked outside the timed region), and its tensors are freed
                assert all(torch.equal(a, p.tensor) for a, p in zip(loaded, pieces))
                loaded.clear()
                for place in places:  # the next in-place load must write every value again
                    place.zero_()
        results.append(out)
    comm.barrier(what="bench: load rounds done")
    return results


def _report_load(per_rank: list[list[dict[str, float]]], world: int, gb: float) -> None:
    rounds = len(per_rank[0])
    med = statistics.median

    def agg(key: str, k: int) -> float:  # all ranks' bytes over the slowest rank's time
        return gb / max(r[k][f"{key}_s"] for r in per_rank)

    methods = ("load", "load_into", "raw", "raw_fresh", "raw_direct")
    resident = max(r[k][f"{m}_resident"] for r in per_rank for k in range(rounds) for m in methods)
    print(
        f"\nload against a raw parallel read of the same files ({gb:.2f} GB, world {world}, each rank its own file; "
        f"aggregate = all bytes / slowest rank; median of {rounds} rounds; page-cache bytes of the checkpoint's "
        f"files before any timed read, at most: {resident})"
    )
    print(
        "| method | load GB/s (aggregate) | CPU s per rank (median) | shardtrain load / this, paired per round "
        "| in-place load / this, paired per round |"
    )
    print("|---|---|---|---|---|")
    for key, name in (
        ("load", "shardtrain load (fresh tensors, checksums verified)"),
        ("load_into", "shardtrain load into existing tensors (as the engine loads weights)"),
        ("raw", "raw read of the same files, into one reused buffer"),
        ("raw_fresh", "raw read of the same files, into fresh memory"),
        ("raw_direct", "(not the reference) the same files read around the page cache: O_DIRECT, 2 threads"),
    ):
        rate = med(agg(key, k) for k in range(rounds))
        cpu = med(r[k][f"{key}_cpu_s"] for r in per_rank for k in range(rounds))
        cells = []
        for loader in ("load", "load_into"):
            paired = [agg(loader, k) / agg(key, k) for k in range(rounds)]
            q = statistics.quantiles(paired, n=4) if rounds > 1 else [paired[0]] * 3
            cells.append("-" if key == loader else f"**{med(paired):.2f}** [{q[0]:.2f}, {q[2]:.2f}]")
        print(f"| {name} | {rate:.2f} | {cpu:.3f} | {cells[0]} | {cells[1]} |")
    print(
        "per round, aggregate GB/s load / in place / raw / raw fresh / raw O_DIRECT: "
        + "; ".join("/".join(f"{agg(m, k):.2f}" for m in methods) for k in range(rounds))
    )


def _dcp(
    comm: Communicator, path: Path, state: dict[str, torch.Tensor], out: dict[str, float], settle_s: float
) -> None:
    import torch.distributed.checkpoint as dcp

    settle(settle_s)
    comm.barrier(what="bench: before dcp save")
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(path))
    out["dcp_save_s"] = time.perf_counter() - t0
    comm.barrier(what="bench: after dcp save")
    if comm.rank == 0:
        drop_cache(path)
    comm.barrier(what="bench: before dcp load")
    target = {k: torch.empty_like(v) for k, v in state.items()}  # like ours, pages are touched during the load
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=str(path))
    out["dcp_load_s"] = time.perf_counter() - t0
    assert all(torch.equal(target[k], state[k]) for k in state)


def _bench_rank(root: str, world: int, numel_per_tensor: int, rounds: int, settle_s: float) -> list[dict[str, float]]:
    """Per round: raw disk (rank 0 alone, then every rank its share in parallel), shardtrain and DCP (alternating
    which goes first), so that all of them see the same disk conditions."""
    comm = Communicator(dist.group.WORLD, 600.0)
    rank, root_path = comm.rank, Path(root)
    pieces = _local_state(rank, world, numel_per_tensor)
    nbytes = sum(p.tensor.numel() * 4 for p in pieces)
    state = {f"layer{i}.weight.r{rank}": p.tensor for i, p in enumerate(pieces)}
    results = []
    for k in range(rounds):
        out: dict[str, float] = {"bytes": nbytes}
        settle(settle_s)
        comm.barrier(what="bench: before raw")
        if rank == 0:
            total = max(BLOCK, nbytes * world // BLOCK * BLOCK)
            out["raw_bytes"] = total
            out["raw_write_s"], out["raw_read_s"], out["raw_fresh_s"] = raw_disk(root_path / "raw.bin", total)
        settle(settle_s)
        comm.barrier(what="bench: before parallel raw")
        out["par_bytes"] = max(BLOCK, nbytes // BLOCK * BLOCK)
        w, r, _ = raw_disk(root_path / f"raw{rank}.bin", int(out["par_bytes"]))
        out["par_write_s"], out["par_read_s"] = w, r
        comm.barrier(what="bench: after parallel raw")
        ours, theirs = root_path / f"ours{k}", root_path / f"dcp{k}"
        if k % 2 == 0:
            _ours(comm, ours, pieces, out, settle_s)
            _dcp(comm, theirs, state, out, settle_s)
        else:
            _dcp(comm, theirs, state, out, settle_s)
            _ours(comm, ours, pieces, out, settle_s)
        comm.barrier(what="bench: round done")
        if rank == 0 and k < rounds - 1:
            shutil.rmtree(theirs)
            if k > 0:
                shutil.rmtree(root_path / f"ours{k - 1}")
        results.append(out)
    return results


def _blocked_rank(root: str, params_mb: float, rounds: int, steps: int, settle_s: float) -> list[dict[str, float]]:
    """An engine (ZeRO stage 1, AdamW, fp32) trains a stack of linear layers of ``params_mb`` MB of parameters; per
    round, alternating which goes first:

    * ``sync_s``: the duration of ``save_checkpoint`` (training is blocked all of it);
    * ``async_call_s``: the duration of ``save_checkpoint(async_save=True)`` (the snapshot and the plan);
    * ``steps_base_s`` / ``steps_during_s``: ``steps`` training steps with no save in flight / right after the
      asynchronous save returned, while its files are written (on a machine with few cores the write competes with
      training for them: the difference is time lost to the save too);
    * ``wait_s``: what the next save would still wait for after those steps (``AsyncSaver.wait``).

    Time blocked by an asynchronous save = ``async_call_s + max(0, steps_during_s - steps_base_s) + wait_s``."""
    rank = dist.get_rank()
    dim = 1024
    layers = max(1, round(params_mb * 1e6 / 4 / (dim * dim + dim)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(layers)))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(4, dim, generator=torch.Generator().manual_seed(rank))

    def train(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            engine.backward(engine(x).square().mean())
            engine.step()
        dist.barrier()
        return time.perf_counter() - t0

    def timed(call) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    train(2)  # warm-up: optimizer state exists, so the checkpoint holds parameters and both Adam moments
    # the first asynchronous save also creates the checkpoint process group (once per engine): timed apart
    first_call = timed(lambda: engine.save_checkpoint(root, tag="first", async_save=True))
    engine._async_saver.wait()
    results = []
    for k in range(rounds):
        out: dict[str, float] = {"layers": layers, "first_call_s": first_call}
        for mode in ("sync", "async") if k % 2 == 0 else ("async", "sync"):
            settle(settle_s)
            tag = f"{mode}{k}"
            if mode == "sync":
                out["steps_base_s"] = train(steps)  # nothing in flight
                out["sync_s"] = timed(lambda: engine.save_checkpoint(root, tag=tag))  # noqa: B023
            else:
                out["async_call_s"] = timed(lambda: engine.save_checkpoint(root, tag=tag, async_save=True))  # noqa: B023
                out["steps_during_s"] = train(steps)
                out["wait_s"] = timed(engine._async_saver.wait)
        if rank == 0:
            for mode in ("sync", "async"):
                shutil.rmtree(Path(root) / f"{mode}{k}")
        results.append(out)
    saved = sum(p.numel() for p in model.parameters()) * 4 * 3  # parameters and two moments
    for out in results:
        out["bytes"] = saved
    engine.close()
    return results


def _report_blocked(per_rank: list[list[dict[str, float]]], world: int) -> None:
    rounds = len(per_rank[0])

    def slowest(key: str, k: int) -> float:
        return max(r[k][key] for r in per_rank)

    sync = [slowest("sync_s", k) for k in range(rounds)]
    call = [slowest("async_call_s", k) for k in range(rounds)]
    slower = [max(0.0, slowest("steps_during_s", k) - slowest("steps_base_s", k)) for k in range(rounds)]
    wait = [slowest("wait_s", k) for k in range(rounds)]
    blocked = [c + s + w for c, s, w in zip(call, slower, wait)]
    med = statistics.median
    saved = per_rank[0][0]["bytes"]
    print(
        f"\nblocked time of an engine save (ZeRO-1, AdamW, {saved / 1e9:.2f} GB of parameters and moments, world "
        f"{world}, {int(per_rank[0][0]['layers'])} layers; slowest rank, median of {rounds} rounds):"
    )
    print("| | seconds |\n|---|---|")
    print(f"| synchronous save_checkpoint | {med(sync):.3f} |")
    print(f"| async_save=True: call returns | {med(call):.3f} |")
    print(f"| async: training steps slowed while the files are written | {med(slower):.3f} |")
    print(f"| async: left to wait at the next save | {med(wait):.3f} |")
    print(f"| async: blocked in all | {med(blocked):.3f} |")
    print(f"| (an engine's first async call, which creates the checkpoint group) | {slowest('first_call_s', 0):.3f} |")
    print(
        f"ratios: async call / sync save {med(call) / med(sync):.3f}; async blocked in all / sync save "
        f"{med(blocked) / med(sync):.3f}"
    )
    print(
        "per round (sync / async call / slowed / wait): "
        + "; ".join(f"{s:.2f}/{c:.3f}/{d:.2f}/{w:.2f}" for s, c, d, w in zip(sync, call, slower, wait))
    )


_CONSOLIDATE = textwrap.dedent(
    """
    import sys, time
    from shardtrain.checkpoint import open_checkpoint
    from shardtrain.checkpoint.consolidate import consolidate

    def status(key):
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

    reader = open_checkpoint(sys.argv[1])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before, t0 = status("VmRSS:"), time.perf_counter()
    consolidate(reader, sys.argv[2], progress=False)
    print(time.perf_counter() - t0, status("VmHWM:") - before, before)
    """
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="total state size in GB (default 1.0)")
    ap.add_argument("--world", type=int, default=2, help="number of ranks (default 2)")
    ap.add_argument("--dir", default="out/bench_checkpoint", help="scratch directory on the disk to measure")
    ap.add_argument("--rounds", type=int, default=8, help="repetitions; medians are reported (default 8)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to wait after os.sync() (default 2)")
    ap.add_argument("--blocked-mb", type=float, default=256.0, help="engine parameters in MB (default 256)")
    ap.add_argument("--blocked-rounds", type=int, default=4, help="rounds of the blocked-time part (default 4)")
    ap.add_argument("--blocked-steps", type=int, default=3, help="steps timed after each save (default 3)")
    ap.add_argument("--blocked-only", action="store_true", help="run only the blocked-time part")
    ap.add_argument("--load-only", action="store_true", help="run only the load against a raw read of the same files")
    ap.add_argument("--load-rounds", type=int, default=12, help="rounds of the --load-only part (default 12)")
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    numel_per_tensor = int(args.size_gb * 1e9 / 4 / N_TENSORS) // (args.world * 1024) * (args.world * 1024)
    total = numel_per_tensor * N_TENSORS * 4
    gb = total / 1e9
    if args.load_only:
        load_args = (args.world, numel_per_tensor, args.load_rounds, args.settle)
        _report_load(run_distributed(_load_rank, args.world, str(root), *load_args, timeout=3000.0), args.world, gb)
        shutil.rmtree(root, ignore_errors=True)
        return
    blocked_args = (args.blocked_mb, args.blocked_rounds, args.blocked_steps, args.settle)
    blocked = run_distributed(_blocked_rank, args.world, str(root / "engine"), *blocked_args, timeout=3000.0)
    _report_blocked(blocked, args.world)
    if args.blocked_only:
        shutil.rmtree(root, ignore_errors=True)
        return
    per_round = run_distributed(
        _bench_rank, args.world, str(root), args.world, numel_per_tensor, args.rounds, args.settle, timeout=3000.0
    )
    timing, growth, rss_before = (
        float(x)
        for x in subprocess.run(
            [sys.executable, "-c", _CONSOLIDATE, str(root / f"ours{args.rounds - 1}"), str(root / "hf")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    )
    largest = numel_per_tensor * 4

    def agg(key: str) -> float:  # all ranks' bytes over the slowest rank's time, median over rounds
        return statistics.median(gb / max(ranks[k][key] for ranks in per_round) for k in range(args.rounds))

    def rank_rate(key: str) -> float:  # one rank's bytes over its own time, median over rounds and ranks
        return statistics.median(r[k]["bytes"] / 1e9 / r[k][key] for r in per_round for k in range(args.rounds))

    def med(values) -> float:
        return statistics.median(list(values))

    r0 = per_round[0]
    raw_gb = r0[0]["raw_bytes"] / 1e9
    par_gb = sum(ranks[0]["par_bytes"] for ranks in per_round) / 1e9
    par_w = med(par_gb / max(ranks[k]["par_write_s"] for ranks in per_round) for k in range(args.rounds))
    par_r = med(par_gb / max(ranks[k]["par_read_s"] for ranks in per_round) for k in range(args.rounds))
    rows = [
        (
            "raw disk: 1 process, write + fsync / read",
            med(raw_gb / x["raw_write_s"] for x in r0),
            med(raw_gb / x["raw_read_s"] for x in r0),
            None,
            None,
        ),
        ("raw disk: 1 process, read into fresh memory", None, med(raw_gb / x["raw_fresh_s"] for x in r0), None, None),
        (f"raw disk: {args.world} processes in parallel, one file each", par_w, par_r, None, None),
        ("shardtrain", agg("save_s"), agg("load_s"), rank_rate("save_s"), rank_rate("load_s")),
        (
            "torch.distributed.checkpoint",
            agg("dcp_save_s"),
            agg("dcp_load_s"),
            rank_rate("dcp_save_s"),
            rank_rate("dcp_load_s"),
        ),
    ]
    print(
        f"\nstate: {gb:.2f} GB float32 in {N_TENSORS} tensors, world {args.world}, directory {root.resolve()}, "
        f"median of {args.rounds} rounds\n"
    )
    print("| method | save GB/s (aggregate) | load GB/s (aggregate) | save GB/s (per rank) | load GB/s (per rank) |")
    print("|---|---|---|---|---|")
    for name, s, lo, sr, lr in rows:
        cells = " | ".join("-" if v is None else f"{v:.2f}" for v in (s, lo, sr, lr))
        print(f"| {name} | {cells} |")
    raw1, fresh, par, ours, dcp = rows
    same_raw, same_fresh = agg("same_raw_s"), agg("same_fresh_s")
    print(
        f"\nload against a raw parallel read of the same files (each rank its own, slowest rank, median): into one "
        f"reused buffer {same_raw:.2f} GB/s, ratio {ours[2] / same_raw:.2f}; into fresh memory {same_fresh:.2f} "
        f"GB/s, ratio {ours[2] / same_fresh:.2f}"
    )
    print(
        f"\nratios: save / raw write {ours[1] / raw1[1]:.2f} (parallel raw {ours[1] / par[1]:.2f}), "
        f"load / raw read {ours[2] / raw1[2]:.2f} (into fresh memory {ours[2] / fresh[2]:.2f}, "
        f"parallel raw {ours[2] / par[2]:.2f}), save / DCP save {ours[1] / dcp[1]:.2f}, "
        f"load / DCP load {ours[2] / dcp[2]:.2f}"
    )

    def rate(k: int, key: str) -> float:
        return gb / max(x[k][key] for x in per_round)

    rounds_text = "; ".join(
        f"raw {raw_gb / r0[k]['raw_write_s']:.2f}/{raw_gb / r0[k]['raw_read_s']:.2f}, "
        f"shardtrain {rate(k, 'save_s'):.2f}/{rate(k, 'load_s'):.2f}, "
        f"DCP {rate(k, 'dcp_save_s'):.2f}/{rate(k, 'dcp_load_s'):.2f}"
        for k in range(args.rounds)
    )
    print(f"\nper round, aggregate GB/s save/load: {rounds_text}")
    print(
        f"consolidation of {gb:.2f} GB: {timing:.1f} s, peak RSS growth {growth / 1e6:.0f} MB "
        f"(largest tensor {largest / 1e6:.0f} MB, 2x = {2 * largest / 1e6:.0f} MB; "
        f"process RSS before {rss_before / 1e6:.0f} MB)"
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
