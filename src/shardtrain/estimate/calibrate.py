"""``shardtrain calibrate``: measure this machine and write a profile ``--cluster`` reads.

What it measures, each the way the time model uses it ([Note: the roofline], [Note: the alpha-beta model] in
:mod:`.timing`):

* matmuls of a few shapes in fp32 and bf16: the best rate is the peak (``fp32_tflops``, ``bf16_tflops``), each
  shape's rate over it the efficiency at its FLOPs (``matmul_efficiency``, a curve);
* attention (``scaled_dot_product_attention``, FLOPs by ``torch.utils.flop_counter``'s ``sdpa_flop_count``): its
  rate over the fp32 peak;
* memory bandwidth: a copy of a tensor larger than the caches (bytes read and written per second, ``hbm_tb_s``,
  efficiency 1: what was measured is what an operator gets); on a CPU the host's memory is that same memory, so it
  is also ``host_gb_s``, the rate of an offloaded optimizer's host step (on a GPU machine the profile's default is
  the GPU validation's host step, :class:`~shardtrain.estimate.cluster.Cluster`);
* the host's time per operator (``op_overhead_us``): an eager operator on a one-element tensor that needs a
  gradient, as a training step issues hundreds;
* at ``--world`` ranks every figure is measured on all ranks at once (on a CPU they share its cores); and
  collectives at that world (``--world``, gloo on this machine, through the project's
  :class:`~shardtrain.distributed.communicator.Communicator`): the latency of a small all-reduce per algorithm step,
  the bus bandwidth of a large one (``intra_node_gb_s``; the ranks are one node), and how much of an all-reduce
  hides behind a matmul running at the same time (``overlap``; on a CPU both compete for the same cores).

Each local measurement is the median of three windows of a quarter second each (:data:`WINDOW_S`), each collective
one the median of a few calls, after a warm-up. The machine may be shared: a profile made on
a loaded machine predicts that load, so calibrate where the runs will be (the benchmark makes its own in the same
run, ``bench/bench_planner_time.py``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MATMUL_SHAPES = ((128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 512, 512))


WINDOW_S = 0.25
"""Each local measurement runs its operation over windows of at least this long: a shared machine's scheduler gives a
process its share of the cores over time slices, and a burst shorter than one slice would miss the waits a training
step has."""


def _windowed_s(fn: Callable[[], Any], windows: int = 3) -> float:
    """Seconds per call of ``fn``: the median over ``windows`` windows of :data:`WINDOW_S` of the mean call (local
    measurements only: a collective's calls must be the same count on every rank)."""
    fn()  # warm-up
    means = []
    for _ in range(windows):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < WINDOW_S or not calls:
            fn()
            calls += 1
        means.append(elapsed / calls)
    return statistics.median(means)


def _median_s(fn: Callable[[], Any], repeats: int = 5, inner: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def measure_matmuls(dtype: torch.dtype) -> list[tuple[float, float]]:
    """(FLOPs, FLOP/s) of one matmul of each of :data:`MATMUL_SHAPES`."""
    out = []
    for m, k, n in MATMUL_SHAPES:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        flops = 2 * m * k * n
        out.append((float(flops), flops / _windowed_s(lambda a=a, b=b: a @ b)))
    return out


def measure_attention() -> float:
    """FLOP/s of a causal fp32 attention (batch 2, 4 heads, 256 tokens, head dimension 64)."""
    from torch.utils.flop_counter import sdpa_flop_count

    q = torch.randn(2, 4, 256, 64)
    flops = sdpa_flop_count(q.shape, q.shape, q.shape)
    seconds = _windowed_s(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    return flops / seconds


def measure_memory_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Bytes per second a copy reads and writes."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _windowed_s(lambda: dst.copy_(src))


def measure_op_overhead(ops: int = 2000) -> float:
    """Seconds per eager operator on a one-element tensor that needs a gradient."""
    x = torch.ones(1, requires_grad=True)

    def run() -> None:
        y = x
        for _ in range(ops):
            y = y * 1.0

    return _windowed_s(run) / ops


def _collectives(sizes: tuple[int, int]) -> dict[str, float]:
    """On every rank: (latency per step, bus GB/s, overlap) of all-reduces over the world (gloo)."""
    import torch.distributed as dist

    from shardtrain.distributed.communicator import Communicator

    comm = Communicator(dist.group.WORLD, timeout_s=120.0)
    n = comm.size
    small, large = (torch.ones(s // 4) for s in sizes)

    def reduce(t: torch.Tensor) -> None:
        comm.all_reduce(t, what="calibrate")

    steps = 2 * (n - 1)
    latency = _median_s(lambda: reduce(small), repeats=7, inner=5) / steps
    large_s = _median_s(lambda: reduce(large), repeats=5, inner=1)
    bus_gb_s = 2 * sizes[1] * (n - 1) / n / (large_s - steps * latency) / 1e9
    a = torch.randn(512, 512)

    def matmuls() -> None:
        for _ in range(8):
            a @ a

    alone = _median_s(matmuls, repeats=5, inner=1)

    def both() -> None:
        handle = comm.all_reduce(large, what="calibrate (overlap)", async_op=True)
        matmuls()
        handle.wait()

    together = _median_s(both, repeats=5, inner=1)
    hidden = alone + large_s - together
    overlap = min(max(hidden / min(alone, large_s), 0.0), 1.0)
    return {"latency_us": latency * 1e6, "intra_node_gb_s": bus_gb_s, "overlap": overlap}


def _measure(world: int, threads: int | None) -> dict[str, Any]:
    """Every measurement on this process; at ``world > 1`` run on each rank at once, so that the rates are what each
    of ``world`` processes gets while the others run too (on a CPU they share its cores)."""
    if threads is not None:
        torch.set_num_threads(threads)
    fp32 = measure_matmuls(torch.float32)
    bf16 = measure_matmuls(torch.bfloat16)
    peak = max(rate for _, rate in fp32)
    memory = measure_memory_bandwidth()
    out: dict[str, Any] = {
        "fp32_tflops": peak / 1e12,
        "bf16_tflops": max(rate for _, rate in bf16) / 1e12,
        "matmul_efficiency": [[flops, min(rate / peak, 1.0)] for flops, rate in fp32],
        "attention_efficiency": min(measure_attention() / peak, 1.0),
        "hbm_tb_s": memory / 1e12,
        "host_gb_s": memory / 1e9,
        "op_overhead_us": measure_op_overhead() * 1e6,
    }
    if world > 1:
        out.update(_collectives((4096, 16 * 2**20)))
    else:
        out.update({"intra_node_gb_s": out["hbm_tb_s"] * 1e3, "overlap": 0.0, "latency_us": 0.0})
    return out


def calibrate(world: int = 2, threads: int | None = None) -> dict[str, Any]:
    """The profile of this machine (a dict ``--cluster`` reads): ``gpu: "cpu"``, ``gpus_per_node`` the world
    measured; each figure the median over the ranks (the efficiency curve rank 0's)."""
    if world > 1:
        from shardtrain.testing import run_distributed

        per_rank = run_distributed(_measure, world, world, threads, threads=threads)
    else:
        per_rank = [_measure(1, threads)]
    merged = {k: statistics.median(r[k] for r in per_rank) for k in per_rank[0] if k != "matmul_efficiency"}
    return {
        "gpu": "cpu",
        "gpus_per_node": world,
        "nodes": 1,
        **merged,
        "matmul_efficiency": per_rank[0]["matmul_efficiency"],
        "memory_efficiency": 1.0,
        "link_efficiency": 1.0,
        "source": f"shardtrain calibrate on this machine, world {world}, torch threads {torch.get_num_threads()}",
    }


def write_profile(profile: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile, indent=1) + "\n")
