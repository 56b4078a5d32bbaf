"""Checkpoint save/load throughput against the raw disk and torch.distributed.checkpoint; consolidation peak RSS.

    .venv/bin/python bench/bench_checkpoint.py [--size-gb 1.0] [--world 2] [--dir out/bench_checkpoint]

The state is ``--size-gb`` of float32 split into 16 logical tensors, each cut into ``--world`` ZeRO fragments (one
per rank). Measured in the same run, on the same directory:

* raw disk: one file of the same size written sequentially in 64 MiB blocks and fsynced, then (after dropping it
  from the page cache with ``posix_fadvise(DONTNEED)``) read back sequentially;
* shardtrain save (collective, fsync, rename, ``latest``) and load (each rank reads its own fragments with checksum
  verification), after dropping the checkpoint's files from the page cache;
* ``torch.distributed.checkpoint.save`` / ``load`` of the same per-rank tensors (``sync_files=True``, its default);
* ``shardtrain checkpoint consolidate`` of the checkpoint in a fresh process: time and peak RSS growth (``VmHWM``
  after resetting it via ``/proc/self/clear_refs``), against twice the largest tensor.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardtrain.checkpoint import FlatSlice, SavePiece, open_checkpoint, save
from shardtrain.comm import Communicator
from shardtrain.testing import run_distributed

N_TENSORS = 16
BLOCK = 64 << 20


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


def raw_disk(path: Path, nbytes: int) -> tuple[float, float]:
    """Sequential write (+fsync) and cold read of one file of ``nbytes``; returns seconds for each."""
    block = os.urandom(BLOCK)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // BLOCK):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    drop_cache(path)
    buf = bytearray(BLOCK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return write_s, read_s


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


def _bench_rank(root: str, world: int, numel_per_tensor: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    comm = Communicator(dist.group.WORLD, 600.0)
    rank, root_path = comm.rank, Path(root)
    pieces = _local_state(rank, world, numel_per_tensor)
    nbytes = sum(p.tensor.numel() * 4 for p in pieces)
    out: dict[str, float] = {"bytes": nbytes}

    comm.barrier(what="bench: before save")
    t0 = time.perf_counter()
    save(root_path / "ours", "step1", comm, pieces)
    out["save_s"] = time.perf_counter() - t0
    comm.barrier(what="bench: after save")
    if rank == 0:
        drop_cache(root_path / "ours")
    comm.barrier(what="bench: before load")
    t0 = time.perf_counter()
    reader = open_checkpoint(root_path / "ours")
    loaded = [reader.read(p.name, (p.slice.start, p.slice.start + p.slice.length)) for p in pieces]
    out["load_s"] = time.perf_counter() - t0
    assert all(torch.equal(a, p.tensor) for a, p in zip(loaded, pieces))
    del loaded
    comm.barrier(what="bench: after load")

    state = {f"layer{i}.weight.r{rank}": p.tensor for i, p in enumerate(pieces)}
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(root_path / "dcp"))
    out["dcp_save_s"] = time.perf_counter() - t0
    comm.barrier(what="bench: after dcp save")
    if rank == 0:
        drop_cache(root_path / "dcp")
    comm.barrier(what="bench: before dcp load")
    target = {k: torch.empty_like(v) for k, v in state.items()}
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=str(root_path / "dcp"))
    out["dcp_load_s"] = time.perf_counter() - t0
    assert all(torch.equal(target[k], state[k]) for k in state)
    return out


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
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    numel_per_tensor = int(args.size_gb * 1e9 / 4 / N_TENSORS) // (args.world * 1024) * (args.world * 1024)
    total = numel_per_tensor * N_TENSORS * 4
    gb = total / 1e9

    raw_w, raw_r = raw_disk(root / "raw.bin", total // BLOCK * BLOCK)
    raw_gb = (total // BLOCK * BLOCK) / 1e9
    ranks = run_distributed(_bench_rank, args.world, str(root), args.world, numel_per_tensor, timeout=1200.0)
    timing, growth, rss_before = (
        float(x)
        for x in subprocess.run(
            [sys.executable, "-c", _CONSOLIDATE, str(root / "ours"), str(root / "hf")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    )
    largest = numel_per_tensor * 4

    def agg(key: str) -> float:
        return gb / max(r[key] for r in ranks)

    rows = [
        ("raw disk (1 writer/reader, fsync)", raw_gb / raw_w, raw_gb / raw_r, None, None),
        (
            "shardtrain",
            agg("save_s"),
            agg("load_s"),
            min(r["bytes"] / 1e9 / r["save_s"] for r in ranks),
            min(r["bytes"] / 1e9 / r["load_s"] for r in ranks),
        ),
        (
            "torch.distributed.checkpoint",
            agg("dcp_save_s"),
            agg("dcp_load_s"),
            min(r["bytes"] / 1e9 / r["dcp_save_s"] for r in ranks),
            min(r["bytes"] / 1e9 / r["dcp_load_s"] for r in ranks),
        ),
    ]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"state: {gb:.2f} GB float32 in {N_TENSORS} tensors, world {args.world}, directory {root.resolve()}\n")
    print("| method | save GB/s (aggregate) | load GB/s (aggregate) | save GB/s (per rank) | load GB/s (per rank) |")
    print("|---|---|---|---|---|")
    for name, s, lo, sr, lr in rows:
        per_rank = " | ".join("-" if v is None else f"{v:.2f}" for v in (sr, lr))
        print(f"| {name} | {s:.2f} | {lo:.2f} | {per_rank} |")
    ours, dcp = rows[1], rows[2]
    print(
        f"\nratios: save/raw write {ours[1] / rows[0][1]:.2f}, load/raw read {ours[2] / rows[0][2]:.2f}, "
        f"save/DCP save {ours[1] / dcp[1]:.2f}, load/DCP load {ours[2] / dcp[2]:.2f}"
    )
    print(
        f"consolidation of {gb:.2f} GB: {timing:.1f} s, peak RSS growth {growth / 1e6:.0f} MB "
        f"(largest tensor {largest / 1e6:.0f} MB, 2x = {2 * largest / 1e6:.0f} MB; "
        f"process RSS before {rss_before / 1e6:.0f} MB)"
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
