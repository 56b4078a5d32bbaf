"""ZeRO stages 0/1/2 against torch DDP at world 2, steps interleaved so ratios survive a noisy machine.

    python bench/bench_zero.py [--steps 10] [--warmup 2] [--layers 11]

Every rank builds the same GPT four times (DDP, stage 0, 1, 2). Each iteration runs one training step of
each variant, in a rotating order; a step's time is the slowest rank's. Prints the median step time of each
variant and its ratio to DDP, communication bytes per step (from engine.comm_stats()) and, from separate
fresh processes per variant, the peak RSS per rank.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig, num_parameters
from shardtrain.testing import run_distributed

VARIANTS = ["ddp", "stage0", "stage1", "stage2"]
MICRO_BATCH = 8


def gpt_config(layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=8192, seq_len=128, d_model=256, n_layer=layers, n_head=8, tie_embeddings=True)


def build(variant: str, layers: int):
    """Returns (step function, engine or None) for one variant."""
    torch.manual_seed(0)
    model = GPT(gpt_config(layers))
    if variant == "ddp":
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

        def ddp_step(x, y):
            ddp(x, y).backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)

        return ddp_step, None
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": 1.0,
        # DDP's default bucket is 25 MB; ours is counted in elements
        "zero_optimization": {"stage": int(variant[-1]), "reduce_bucket_size": 25_000_000 // 4},
    }
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))

    def engine_step(x, y):
        engine.backward(engine(x, y))
        engine.step()

    return engine_step, engine


def batch(layers: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, gpt_config(layers).vocab_size, (MICRO_BATCH, gpt_config(layers).seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def timing_body(steps: int, warmup: int, layers: int) -> dict:
    rank = dist.get_rank()
    runners = {v: build(v, layers) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    comm: dict[str, dict] = {}
    for it in range(warmup + steps):
        order = VARIANTS[it % 4 :] + VARIANTS[: it % 4]  # rotate so no variant always runs first
        x, y = batch(layers, seed=1000 * it + rank)
        for v in order:
            step, engine = runners[v]
            if engine is not None:
                engine.comm_stats(reset=True)
            dist.barrier()
            t0 = time.perf_counter()
            step(x, y)
            elapsed = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
            if it >= warmup:
                times[v].append(float(elapsed))
            if engine is not None:
                comm[v] = engine.comm_stats()
    return {"times": times, "comm": comm}


def rss_body(variant: str, steps: int, layers: int) -> int:
    step, _ = build(variant, layers)
    for i in range(steps):
        step(*batch(layers, seed=i))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=11)
    args = parser.parse_args()
    world = 2
    n = num_parameters(GPT(gpt_config(args.layers)))
    print(
        f"# bench_zero: {n / 1e6:.1f}M-parameter GPT, fp32 AdamW, world {world} (gloo, 1 thread/rank), "
        f"micro-batch {MICRO_BATCH}x{gpt_config(args.layers).seq_len}"
    )
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} cores, torch {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}")
    result = run_distributed(timing_body, world, args.steps, args.warmup, args.layers, timeout=3600, threads=1)[0]
    rss = {v: max(run_distributed(rss_body, world, v, 3, args.layers, timeout=900, threads=1)) for v in VARIANTS}
    ddp = statistics.median(result["times"]["ddp"])
    print(f"\n{'variant':8} {'median step':>12} {'ratio to DDP':>13} {'peak RSS/rank':>14}  bytes/step by kind")
    for v in VARIANTS:
        med = statistics.median(result["times"][v])
        comm = result["comm"].get(v)
        if comm is None:
            comm_text = f"all_reduce {2 * 4 * n * (world - 1) / world / 2**20:.1f} MiB (computed: 2P(N-1)/N)"
        else:
            comm_text = ", ".join(f"{k} {c['bytes'] / 2**20:.1f} MiB in {c['calls']} calls" for k, c in comm.items())
        print(f"{v:8} {med * 1000:10.0f}ms {med / ddp:12.3f}x {rss[v] / 2**20:10.0f} MiB  {comm_text}")


if __name__ == "__main__":
    main()
