"""What the desync check costs: the benchmark GPT of bench_zero.py at world 2, each stage with and without it,
steps interleaved so that the ratio survives a noisy machine.

    python bench/bench_desync.py [--stages 0,2,3] [--steps 10] [--warmup 2] [--layers 11] [--gas 1]

Every rank builds the same GPT once per variant (``stageN`` with ``desync_check: true``, the default, and
``stageN-off``). Each iteration runs one optimizer step of each variant in a rotating order; a step's time is the
slowest rank's. Prints per stage the median step time with and without the check, the median of the per-iteration
ratios (with / without, both measured in the same iteration), the checks per step, and what those checks cost by
themselves: the latency of one check, timed over 500 back-to-back checks, times the checks per step, over the step.
The ratio includes what a check point costs beyond its latency (every rank waits there for the slowest one); on an
oversubscribed machine that wait, a descheduled rank, dominates.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

import shardtrain
from bench_zero import Shape, batch, make_shape
from shardtrain.models.gpt import GPT, num_parameters
from shardtrain.testing import run_distributed

CHECKS = 500


def build(stage: int, check: bool, shape: Shape, gas: int):
    torch.manual_seed(0)
    model = GPT(shape.gpt)
    config = {
        "train_micro_batch_size_per_gpu": shape.micro_batch,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 25_000_000 // 4},
        "desync_check": check,
    }
    return shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))


def timing_body(stages: list[int], steps: int, warmup: int, shape: Shape, gas: int) -> dict:
    rank = dist.get_rank()
    variants = [(s, c) for s in stages for c in (True, False)]
    engines = {v: build(*v, shape, gas) for v in variants}
    times: dict[tuple[int, bool], list[float]] = {v: [] for v in variants}
    checks = {}
    for it in range(warmup + steps):
        k = it % len(variants)
        for v in variants[k:] + variants[:k]:  # rotate so that no variant always runs first
            engine = engines[v]
            if engine._phase_check.comm is not None:
                engine._phase_check.comm.reset_stats()
            dist.barrier()
            t0 = time.perf_counter()
            for m in range(gas):
                x, y = batch(shape, seed=1000 * it + 10 * m + rank)
                engine.backward(engine(x, y))
                engine.step()
            elapsed = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
            if it >= warmup:
                times[v].append(float(elapsed))
            if engine._phase_check.comm is not None:
                checks[v[0]] = engine._phase_check.comm.stats()
    # the check alone, back to back: what one costs when no rank waits for another's compute
    check = engines[variants[0]]._phase_check
    for _ in range(20):
        check("backward", 0, 0)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(CHECKS):
        check("backward", 0, 0)
    latency = torch.tensor((time.perf_counter() - t0) / CHECKS)
    dist.all_reduce(latency, op=dist.ReduceOp.MAX)
    return {"times": times, "checks": checks, "latency": float(latency)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="0,2,3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--gas", type=int, default=1, help="micro-steps per optimizer step")
    args = parser.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    world = 2
    shape = make_shape("bench", args.layers)
    n = num_parameters(GPT(shape.gpt))
    print(
        f"# bench_desync: {n / 1e6:.1f}M-parameter GPT, fp32 AdamW, world {world} (gloo, 1 thread/rank), "
        f"micro-batch {shape.micro_batch}x{shape.gpt.seq_len}, {args.gas} micro-step(s) per step"
    )
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} cores, torch {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}")
    ranks = run_distributed(
        timing_body, world, stages, args.steps, args.warmup, shape, args.gas, timeout=3600, threads=1
    )
    r = ranks[0]
    lat = r["latency"]
    print(f"\none check alone: {lat * 1e6:.0f} us (mean of {CHECKS} back to back, slowest rank)")
    print(
        f"\n{'stage':>5} {'with check':>11} {'without':>9} {'ratio (median of pairs)':>24} {'checks/step':>12} "
        f"{'their latency / step':>21}"
    )
    for s in stages:
        on, off = r["times"][(s, True)], r["times"][(s, False)]
        ratio = statistics.median(a / b for a, b in zip(on, off))
        calls = r["checks"].get(s, {}).get("desync_check", {"calls": 0})["calls"]
        print(
            f"{s:5d} {statistics.median(on) * 1000:9.0f}ms {statistics.median(off) * 1000:7.0f}ms {ratio:23.3f}x "
            f"{calls:12d} {100 * calls * lat / statistics.median(off):20.3f}%"
        )


if __name__ == "__main__":
    main()
