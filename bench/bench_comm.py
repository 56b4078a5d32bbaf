"""Reduce-scatter on gloo: the backend's own against the pairwise exchange of ``Communicator`` (see [Note: bytes
on the wire] in shardtrain.distributed.communicator), with an all-gather and an all-reduce of the same size for scale.

    python bench/bench_comm.py [--worlds 2,3] [--sizes-mib 1,6,24] [--reps 15]

For each world size, one job; for each tensor size (fp32, the full tensor ``S``), every repetition runs each
collective once in a rotating order; a collective's time is the slowest rank's. Prints the median time of each,
the median of the per-repetition ratios pairwise / backend with quartiles, and the loopback bytes per rank
(``/proc/net/dev``, the group's total / N) over the theoretical ``S (N-1)/N``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from shardtrain.distributed.communicator import Communicator
from shardtrain.testing import run_distributed

KINDS = ("rs-backend", "rs-pairwise", "all_gather", "all_reduce")


def _loopback_tx() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])
    return 0


def body(sizes_mib: list[float], reps: int) -> dict:
    n = dist.get_world_size()
    comm = Communicator(dist.group.WORLD, 300.0)
    out: dict = {}
    for mib in sizes_mib:
        numel = int(mib * 2**20 / 4) // n * n
        full, chunk = torch.randn(numel), torch.empty(numel // n)

        def run(kind: str, full: torch.Tensor = full, chunk: torch.Tensor = chunk) -> None:
            if kind == "all_gather":
                comm.all_gather(full, chunk, what="bench")
            elif kind == "all_reduce":
                comm.all_reduce(full, "sum", what="bench")
            else:
                comm.reduce_scatter_impl = kind[3:]
                comm.reduce_scatter(chunk, full, "avg", what="bench")

        times: dict[str, list[float]] = {k: [] for k in KINDS}
        wire: dict[str, list[float]] = {k: [] for k in KINDS}
        for rep in range(reps + 1):
            order = KINDS[rep % len(KINDS) :] + KINDS[: rep % len(KINDS)]
            for kind in order:
                dist.barrier()
                tx0 = _loopback_tx()
                dist.barrier()  # no rank sends before every rank has read the counter
                t0 = time.perf_counter()
                run(kind)
                spans = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(spans, op=dist.ReduceOp.MAX)
                dist.barrier()
                tx = torch.tensor([float(_loopback_tx() - tx0)], dtype=torch.float64)
                dist.broadcast(tx, 0)  # one machine-wide counter: rank 0's reading
                if rep > 0:  # the first repetition sets up connections
                    times[kind].append(float(spans))
                    wire[kind].append(float(tx) / n / (numel * 4 * (n - 1) / n))
        out[mib] = {"times": times, "wire": wire}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,3")
    parser.add_argument("--sizes-mib", default="1,6,24")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    print(f"# bench_comm: gloo over loopback, 1 thread/rank; {platform.machine()}, torch {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}")
    print(
        f"\n{'world':>5} {'MiB':>5} {'rs backend':>11} {'rs pairwise':>12} {'all_gather':>11} {'all_reduce':>11}"
        f" {'pairwise/backend [q1, q3]':>27}  wire bytes / S(N-1)/N: backend, pairwise, all_gather, all_reduce"
    )
    for world in (int(w) for w in args.worlds.split(",")):
        result = run_distributed(body, world, sizes, args.reps, timeout=1800, threads=1)[0]
        for mib in sizes:
            t, w = result[mib]["times"], result[mib]["wire"]
            med = {k: statistics.median(t[k]) * 1000 for k in KINDS}
            ratios = [a / b for a, b in zip(t["rs-pairwise"], t["rs-backend"])]
            q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
            wires = ", ".join(f"{min(w[k]):.2f}" for k in KINDS)  # stray traffic only adds: the minimum
            print(
                f"{world:5d} {mib:5g} {med['rs-backend']:9.1f}ms {med['rs-pairwise']:10.1f}ms"
                f" {med['all_gather']:9.1f}ms {med['all_reduce']:9.1f}ms {q2:15.3f} [{q1:.3f}, {q3:.3f}]  {wires}"
            )


if __name__ == "__main__":
    main()
