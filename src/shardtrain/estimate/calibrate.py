"""``shardtrain calibrate``: measure this machine and write a profile ``--cluster`` reads.

What it measures, each the way the time model uses it ([Note: the roofline], [Note: the alpha-beta model] in
:mod:`.timing`):

* matmuls of a few shapes in fp32 and bf16: the best rate is the peak (``fp32_tflops``, ``bf16_tflops``), each
  shape's rate over it the efficiency at its FLOPs (``matmul_efficiency``, a curve); in fp32 each shape in the three
  layouts a linear layer runs (``x @ W.T`` forward, ``dy @ W`` and ``dy.T @ x`` backward), its rate their mean: on
  this CPU a layout alone is 0.7-1.0x another at the same FLOPs;
* attention (``scaled_dot_product_attention``, FLOPs by ``torch.utils.flop_counter``'s ``sdpa_flop_count``): its
  rate over the fp32 peak;
* memory bandwidth: a copy of a tensor larger than the caches (bytes read and written per second, ``hbm_tb_s``,
  efficiency 1: what was measured is what an operator gets); on a CPU the host's memory is that same memory, so it
  is also ``host_gb_s``, the rate of an offloaded optimizer's host step (on a GPU machine the profile's default is
  the GPU validation's host step, :class:`~shardtrain.estimate.cluster.Cluster`);
* the host's time per operator (``op_overhead_us``): an eager operator on a one-element tensor that needs a
  gradient, as a training step issues hundreds;
* the optimizer's host loop (``optimizer_us_per_tensor``, [Note: the optimizer's host loop] in :mod:`.timing`) and
  the arithmetic of the element-wise operators of :data:`ELEMENTWISE_OPERATORS` (``elementwise_ns_per_element``,
  [Note: arithmetic-bound operators]);
* at ``--world`` ranks every figure is measured on all ranks at once (on a CPU they share its cores); and
  collectives at that world (``--world``, gloo on this machine, through the project's
  :class:`~shardtrain.distributed.communicator.Communicator`): the latency of a small all-reduce per algorithm step,
  the bus bandwidth of a large one after a block of compute (``intra_node_gb_s``; the ranks are one node), how much
  a block of compute stretches when the ranks meet after it (``sync_skew``, [Note: a collective after compute]),
  and how much of an all-reduce hides behind a matmul running at the same time (``overlap``; on a CPU both compete
  for the same cores).

[Note: cold operands]
A kernel timed over the same operands again and again reads them from the CPU's caches; in a training step an
operator reads activations and weights that the operators between pushed out (a small model's step touches more than
the 32 MiB last-level cache of this machine). So each kernel is timed over operand sets that add up to
:data:`COLD_BYTES`, taken in turn: on this machine that made a matmul of a small model's shapes 10-15% slower and an
``add`` of 1 MiB tensors 2.4x slower than over one set, as the step sees them; the first profiles, timed hot, put
the benchmark's GPT step at 0.68x its measured time.

[Note: a collective after compute]
Ranks that meet at a collective move at the pace of the slowest, and on a CPU shared by more ranks than cores (or by
other jobs) a peer may first have to be scheduled. Measured here (two cores): a 4 KiB all-reduce alone took 2.7 ms
at world 2, but added 5.2 ms to a 14 ms block of matmuls before it; at world 3 it added 16.5 ms to 20 ms, at world 4
19 ms to 28 ms. What it adds beyond its own time grows with the compute before it (the ranks drift apart while they
compute), so it is a stretch of compute, not a latency: ``sync_skew`` is that excess over the block's time, and the
time model stretches a multi-rank step's compute by it ([Note: ranks that meet] in :mod:`.timing`); the latency
stays the collective's own, timed alone. Each is timed in a loop of its own, as a training loop runs: blocks timed
each from a meeting of the ranks measured a stretch of 0.09 at world 3 against the loop's 0.68-1.16 (a rank late
out of the meeting starts its own clock late). Without it every multi-rank layout of the benchmark's GPT was predicted
0.53-0.71x its measured step; charged as a latency of every collective instead, a tensor-parallel layout (a
collective every millisecond of compute) came out 2-3x its measured step.

Each local measurement is the median of three windows of a quarter second each (:data:`WINDOW_S`), each collective
one the median of a few calls, after a warm-up. The machine may be shared: a profile made on
a loaded machine predicts that load, so calibrate where the runs will be (the benchmark makes its own in the same
run, ``bench/bench_planner_time.py``).
"""

from __future__ import annotations

import itertools
import json
import math
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


def _windowed_s(fn: Callable[[], Any], windows: int = 3, window_s: float | None = None) -> float:
    """Seconds per call of ``fn``: the median over ``windows`` windows of :data:`WINDOW_S` of the mean call (local
    measurements only: a collective's calls must be the same count on every rank)."""
    fn()  # warm-up
    means = []
    for _ in range(windows):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < (window_s or WINDOW_S) or not calls:
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


COLD_BYTES = 96 * 2**20
"""The operand sets a kernel is timed over add up to this ([Note: cold operands])."""


def _rotating(make: Callable[[], Any], set_bytes: int) -> Callable[[], Any]:
    """A function returning the next of ``COLD_BYTES / set_bytes`` operand sets from ``make``, round and round
    ([Note: cold operands])."""
    sets = [make() for _ in range(max(2, COLD_BYTES // max(set_bytes, 1)))]
    turn = itertools.cycle(sets)
    return lambda: next(turn)


LINEAR_MATMULS = (lambda x, w, dy: x @ w.T, lambda x, w, dy: dy @ w, lambda x, w, dy: dy.T @ x)
"""A linear layer's matmuls: forward, input gradient, weight gradient."""


def measure_matmuls(dtype: torch.dtype, layouts: bool = False) -> list[tuple[float, float]]:
    """(FLOPs, FLOP/s) of one matmul of each of :data:`MATMUL_SHAPES`; ``layouts``: the mean time of the three
    matmuls of a linear layer of that shape (tokens ``m``, in ``k``, out ``n``). Operands cold ([Note: cold
    operands])."""
    out = []
    for m, k, n in MATMUL_SHAPES:
        shapes = ((m, k), (n, k), (m, n))
        nbytes = sum(a * b for a, b in shapes) * dtype.itemsize
        operands = _rotating(lambda shapes=shapes: tuple(torch.randn(*s, dtype=dtype) for s in shapes), nbytes)
        flops = 2 * m * k * n
        runs = LINEAR_MATMULS if layouts else LINEAR_MATMULS[:1]
        seconds = statistics.mean(_windowed_s(lambda mm=mm, operands=operands: mm(*operands())) for mm in runs)
        out.append((float(flops), flops / seconds))
    return out


def measure_attention() -> float:
    """FLOP/s of a causal fp32 attention (batch 2, 4 heads, 256 tokens, head dimension 64), operands cold."""
    from torch.utils.flop_counter import sdpa_flop_count

    shape = (2, 4, 256, 64)
    flops = sdpa_flop_count(shape, shape, shape)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qkv = _rotating(lambda: tuple(torch.randn(shape) for _ in range(3)), 3 * math.prod(shape) * 4)
    return flops / _windowed_s(lambda: sdpa(*qkv(), is_causal=True))


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


def _elementwise_cases() -> dict[str, Callable[[], torch.Tensor]]:
    """Each of :data:`ELEMENTWISE_OPERATORS` on 1 MiB fp32 tensors (256 rows of 1,024, a small model's activations),
    operands cold ([Note: cold operands])."""
    aten = torch.ops.aten
    weight, bias = torch.ones(1024), torch.zeros(1024)

    def operands() -> dict[str, torch.Tensor]:
        x = torch.randn(256, 1024)
        _, mean, rstd = aten.native_layer_norm(x, [1024], weight, bias, 1e-5)
        return {"x": x, "g": torch.randn(256, 1024), "soft": x.softmax(-1), "log_soft": x.log_softmax(-1),
                "mean": mean, "rstd": rstd}  # fmt: skip

    sets = _rotating(operands, 4 * 2**20)
    cases: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
        "gelu": lambda o: aten.gelu(o["x"]),
        "gelu:tanh": lambda o: aten.gelu(o["x"], approximate="tanh"),
        "gelu_backward": lambda o: aten.gelu_backward(o["g"], o["x"]),
        "gelu_backward:tanh": lambda o: aten.gelu_backward(o["g"], o["x"], approximate="tanh"),
        "silu": lambda o: aten.silu(o["x"]),
        "silu_backward": lambda o: aten.silu_backward(o["g"], o["x"]),
        "tanh": lambda o: aten.tanh(o["x"]),
        "tanh_backward": lambda o: aten.tanh_backward(o["g"], o["x"]),
        "sigmoid": lambda o: aten.sigmoid(o["x"]),
        "exp": lambda o: aten.exp(o["x"]),
        "rsqrt": lambda o: aten.rsqrt(o["x"]),
        "sin": lambda o: aten.sin(o["x"]),
        "cos": lambda o: aten.cos(o["x"]),
        "_softmax": lambda o: aten._softmax(o["x"], -1, False),
        "_softmax_backward_data": lambda o: aten._softmax_backward_data(o["g"], o["soft"], -1, torch.float32),
        "_log_softmax": lambda o: aten._log_softmax(o["x"], -1, False),
        "_log_softmax_backward_data": lambda o: aten._log_softmax_backward_data(
            o["g"], o["log_soft"], -1, torch.float32
        ),
        "native_layer_norm": lambda o: aten.native_layer_norm(o["x"], [1024], weight, bias, 1e-5)[0],
        "native_layer_norm_backward": lambda o: aten.native_layer_norm_backward(
            o["g"], o["x"], [1024], o["mean"], o["rstd"], weight, bias, [True, True, True]
        )[0],
    }
    return {name: (lambda case=case: case(sets())) for name, case in cases.items()}


ELEMENTWISE_OPERATORS = (
    *("gelu", "gelu:tanh", "gelu_backward", "gelu_backward:tanh", "silu", "silu_backward", "tanh", "tanh_backward"),
    *("sigmoid", "exp", "rsqrt", "sin", "cos", "_softmax", "_softmax_backward_data", "_log_softmax"),
    *("_log_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward"),
)
"""The operators whose arithmetic may bound them on a CPU ([Note: arithmetic-bound operators] in :mod:`.timing`):
the activations, softmaxes and norms of the transformers the planner times, by aten name (``gelu``'s with its form)."""


def measure_elementwise() -> dict[str, float]:
    """Nanoseconds per output element of each of :data:`ELEMENTWISE_OPERATORS` (windows of a fifth of the others':
    19 operators)."""
    out = {}
    for name, run in _elementwise_cases().items():
        out[name] = _windowed_s(run, window_s=WINDOW_S / 5) / run().numel() * 1e9
    return out


def measure_optimizer_loop(tensors: int = 64) -> float:
    """Seconds per tensor of an AdamW step with gradient clipping over ``tensors`` tensors of 64 elements (their
    bytes negligible): the optimizer's host loop ([Note: the optimizer's host loop] in :mod:`.timing`)."""
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(64)
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return _windowed_s(step) / tensors


def _collectives(sizes: tuple[int, int]) -> dict[str, float]:
    """On every rank: latency per step, bus GB/s, overlap and the stretch of compute that ends in a collective
    ([Note: a collective after compute]), from all-reduces over the world (gloo)."""
    import torch.distributed as dist

    from shardtrain.distributed.communicator import Communicator
    from shardtrain.estimate.timing import collective_steps

    comm = Communicator(dist.group.WORLD, timeout_s=120.0)
    n = comm.size
    small, large = (torch.ones(s // 4) for s in sizes)
    a = torch.randn(512, 512)

    def matmuls() -> None:
        for _ in range(8):
            a @ a

    def after_compute(t: torch.Tensor) -> None:
        matmuls()
        comm.all_reduce(t, what="calibrate")

    def both() -> None:
        handle = comm.all_reduce(large, what="calibrate (overlap)", async_op=True)
        matmuls()
        handle.wait()

    small_alone = _median_s(lambda: comm.all_reduce(small, what="calibrate"), repeats=7, inner=5)
    # each in a loop of its own, as a training loop runs: the ranks leave one meeting together and drift until the next
    block_s = _median_s(matmuls, repeats=11, inner=1)
    with_small = _median_s(lambda: after_compute(small), repeats=11, inner=1)
    large_block_s = _median_s(lambda: after_compute(large), repeats=11, inner=1)
    together = _median_s(both, repeats=9, inner=1)
    latency = small_alone / collective_steps("all_reduce", n)
    skew = max(with_small - block_s - small_alone, 0.0) / block_s
    bus_gb_s = 2 * sizes[1] * (n - 1) / n / max(large_block_s - with_small, 1e-6) / 1e9
    large_s = max(large_block_s - block_s, 1e-6)
    overlap = min(max((large_block_s - together) / min(block_s, large_s), 0.0), 1.0)
    return {"latency_us": latency * 1e6, "intra_node_gb_s": bus_gb_s, "overlap": overlap, "sync_skew": skew}


def _measure(world: int, threads: int | None) -> dict[str, Any]:
    """Every measurement on this process; at ``world > 1`` run on each rank at once, so that the rates are what each
    of ``world`` processes gets while the others run too (on a CPU they share its cores)."""
    if threads is not None:
        torch.set_num_threads(threads)
    fp32 = measure_matmuls(torch.float32, layouts=True)
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
        "optimizer_us_per_tensor": measure_optimizer_loop() * 1e6,
        "elementwise_ns_per_element": measure_elementwise(),
    }
    if world > 1:
        out.update(_collectives((4096, 16 * 2**20)))
    else:
        out.update({"intra_node_gb_s": out["hbm_tb_s"] * 1e3, "overlap": 0.0, "latency_us": 0.0})
    return out


def median_profile(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One set of figures from several measurements (ranks, or repeated runs): each number's median, each table's
    entry by entry; the rest (the matmul curve) the first run's."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in runs)
        elif isinstance(value, dict):
            out[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
    return out


def calibrate(world: int = 2, threads: int | None = None) -> dict[str, Any]:
    """The profile of this machine (a dict ``--cluster`` reads): ``gpu: "cpu"``, ``gpus_per_node`` the world
    measured; each figure the median over the ranks (the efficiency curve rank 0's)."""
    if world > 1:
        from shardtrain.testing import run_distributed

        per_rank = run_distributed(_measure, world, world, threads, threads=threads)
    else:
        per_rank = [_measure(1, threads)]
    return {
        "gpu": "cpu",
        "gpus_per_node": world,
        "nodes": 1,
        **median_profile(per_rank),
        "memory_efficiency": 1.0,
        "link_efficiency": 1.0,
        "source": f"shardtrain calibrate on this machine, world {world}, torch threads {torch.get_num_threads()}",
    }


def write_profile(profile: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile, indent=1) + "\n")
