"""ZeRO stages against torch DDP (and FSDP2) at world 2, steps interleaved so ratios survive a noisy machine.

    python bench/bench_zero.py [--variants ddp,stage0,stage1,stage2] [--steps 10] [--warmup 2] [--layers 11]
    python bench/bench_zero.py --variants ddp,stage0,stage3,fsdp2
    python bench/bench_zero.py --memory-scaling          # stage 3 at world 1, 2, 4 on a ~50M-parameter GPT
    python bench/bench_zero.py --variants ddp,stage2,stage2:bf16,stage3,stage3:bf16 --layers 2 --steps 3

Every rank builds the same GPT once per variant. Each iteration runs one training step of each variant, in
a rotating order; a step's time is the slowest rank's. Prints the median step time of each variant and its
ratio to DDP, communication bytes per step (from engine.comm_stats()) and, from separate fresh processes
per variant, the peak RSS per rank.
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
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def fsdp_step(x, y):
            model(x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

        return fsdp_step, None
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": 1.0,
        # DDP's default bucket is 25 MB; ours is counted in elements
        "zero_optimization": {"stage": int(variant[5]), "reduce_bucket_size": 25_000_000 // 4},
    }
    if variant.endswith(":bf16"):  # e.g. stage3:bf16 (on this AVX2 CPU bf16 matmuls are ~16x slower)
        config["bf16"] = {"enabled": True}
    if variant == "stage3-nocheck":  # what the unit-order check costs
        config["zero_optimization"]["stage3_gather_check"] = False
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))

    def engine_step(x, y):
        engine.backward(engine(x, y))
        engine.step()

    return engine_step, engine


def batch(layers: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, gpt_config(layers).vocab_size, (MICRO_BATCH, gpt_config(layers).seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def timing_body(variants: list[str], steps: int, warmup: int, layers: int) -> dict:
    rank = dist.get_rank()
    runners = {v: build(v, layers) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    comm: dict[str, dict] = {}
    for it in range(warmup + steps):
        k = it % len(variants)
        order = variants[k:] + variants[:k]  # rotate so no variant always runs first
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
    states = {v: e.state_bytes() for v, (_, e) in runners.items() if e is not None}
    return {"times": times, "comm": comm, "states": states}


def rss_body(variant: str, steps: int, layers: int) -> int:
    step, _ = build(variant, layers)
    for i in range(steps):
        step(*batch(layers, seed=i))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def scaling_body(layers: int, steps: int) -> dict:
    cfg = GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layer=layers, n_head=8, tie_embeddings=True)
    with shardtrain.zero.Init():  # no rank ever holds the whole model
        model = GPT(cfg)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
        engine.backward(engine(x, torch.roll(x, -1, 1)))
        engine.step()
    return {"state": engine.state_bytes(), "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def memory_scaling(layers: int = 14) -> None:
    cfg = GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layer=layers, n_head=8, tie_embeddings=True)
    n = num_parameters(GPT(cfg))
    print(f"# memory scaling: ZeRO-3, {n / 1e6:.1f}M-parameter GPT built under shardtrain.zero.Init, fp32 AdamW")
    print(f"# command: python {' '.join(sys.argv)}")
    print(f"\n{'world':>5} {'state bytes/rank':>17} {'bytes/param':>12} {'peak RSS/rank':>14}")
    for world in (1, 2, 4):
        results = run_distributed(scaling_body, world, layers, 2, timeout=1800, threads=max(1, 2 // world))
        state = max(sum(r["state"].values()) for r in results)
        rss = max(r["rss"] for r in results)
        print(f"{world:5d} {state / 2**20:13.1f} MiB {state / n:12.2f} {rss / 2**20:10.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="ddp,stage0,stage1,stage2", help="comma-separated; ddp first")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--memory-scaling", action="store_true")
    args = parser.parse_args()
    if args.memory_scaling:
        memory_scaling()
        return
    variants = args.variants.split(",")
    world = 2
    n = num_parameters(GPT(gpt_config(args.layers)))
    print(
        f"# bench_zero: {n / 1e6:.1f}M-parameter GPT, fp32 AdamW, world {world} (gloo, 1 thread/rank), "
        f"micro-batch {MICRO_BATCH}x{gpt_config(args.layers).seq_len}"
    )
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} cores, torch {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}")
    result = run_distributed(
        timing_body, world, variants, args.steps, args.warmup, args.layers, timeout=3600, threads=1
    )[0]
    rss = {v: max(run_distributed(rss_body, world, v, 3, args.layers, timeout=900, threads=1)) for v in variants}
    ddp = statistics.median(result["times"]["ddp"])
    header = f"{'variant':14} {'median step':>12} {'ratio to DDP':>13} {'peak RSS/rank':>14} {'state/rank':>11}"
    print(f"\n{header}  bytes/step")
    for v in variants:
        med = statistics.median(result["times"][v])
        comm = result["comm"].get(v)
        if v == "fsdp2":
            comm_text = f"~{3 * 4 * n * (world - 1) / world / 2**20:.1f} MiB (computed: 3P(N-1)/N)"
        elif comm is None:
            comm_text = f"all_reduce {2 * 4 * n * (world - 1) / world / 2**20:.1f} MiB (computed: 2P(N-1)/N)"
        else:
            comm_text = ", ".join(f"{k} {c['bytes'] / 2**20:.1f} MiB in {c['calls']} calls" for k, c in comm.items())
        state = result["states"].get(v)
        state_text = f"{sum(state.values()) / 2**20:7.1f} MiB" if state else f"{16 * n / 2**20:7.1f} MiB"
        print(f"{v:14} {med * 1000:10.0f}ms {med / ddp:12.3f}x {rss[v] / 2**20:10.0f} MiB {state_text}  {comm_text}")


if __name__ == "__main__":
    main()
