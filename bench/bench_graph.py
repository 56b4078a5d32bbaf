"""Graph mode against eager mode at world 2, steps interleaved so ratios survive a noisy machine.

    python bench/bench_graph.py [--variants ddp,stage2,stage2:graph,stage2:inductor] [--steps 8] [--layers 11]

Every rank builds the same GPT (the model of bench/bench_zero.py: vocab 8192, d_model 256, sequence 128, tied
embeddings, micro-batch 8 per rank) once per variant and captures it at its first step; the capture time (first
step minus a later step) is reported separately. Then each iteration runs one training step of each variant in a
rotating order; a step's time is the slowest rank's. Prints the median step time, its ratio to DDP and to eager
ZeRO-2, and the peak RSS per rank measured in a fresh pair of processes per variant.

Variants: ``ddp``; ``stageN`` (eager); ``stageN:graph`` (captured, graphs run as traced); ``stageN:inductor``
(captured and compiled by Inductor).
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
    stage, _, mode = variant.partition(":")
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": int(stage.removeprefix("stage")), "reduce_bucket_size": 25_000_000 // 4},
    }
    if mode:
        config["graph"] = {"enabled": True, "compiler": "inductor" if mode == "inductor" else "aot_eager"}
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))

    def engine_step(x, y):
        engine.backward(engine(x, y))
        engine.step()

    return engine_step, engine


def batch(layers: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cfg = gpt_config(layers)
    x = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def _timed(step, x, y) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step(x, y)
    elapsed = torch.tensor(time.perf_counter() - t0)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
    return float(elapsed)


def timing_body(variants: list[str], steps: int, layers: int) -> dict:
    rank = dist.get_rank()
    runners = {v: build(v, layers) for v in variants}
    first = {v: _timed(runners[v][0], *batch(layers, seed=rank)) for v in variants}  # captures happen here
    second = {v: _timed(runners[v][0], *batch(layers, seed=7 + rank)) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for it in range(steps):
        k = it % len(variants)
        x, y = batch(layers, seed=1000 * it + rank)
        for v in variants[k:] + variants[:k]:  # rotate so no variant always runs first
            times[v].append(_timed(runners[v][0], x, y))
    stats = {v: e.graph_stats() for v, (_, e) in runners.items() if e is not None and e.graph_stats() is not None}
    return {"times": times, "capture": {v: first[v] - second[v] for v in variants}, "graph": stats}


def rss_body(variant: str, steps: int, layers: int) -> int:
    step, _ = build(variant, layers)
    for i in range(steps):
        step(*batch(layers, seed=i))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="ddp,stage2,stage2:graph,stage2:inductor", help="comma-separated")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--no-rss", action="store_true", help="skip the fresh-process peak RSS runs")
    args = parser.parse_args()
    variants = args.variants.split(",")
    n = num_parameters(GPT(gpt_config(args.layers)))
    print(f"# bench_graph: {n / 1e6:.1f}M-parameter GPT, fp32 AdamW, world 2 (gloo, 1 thread/rank), micro-batch 8x128")
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} cores, torch {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}")
    result = run_distributed(timing_body, 2, variants, args.steps, args.layers, timeout=3600, threads=1)[0]
    rss = {}
    if not args.no_rss:
        rss = {v: max(run_distributed(rss_body, 2, v, 3, args.layers, timeout=1800, threads=1)) for v in variants}
    med = {v: statistics.median(t) for v, t in result["times"].items()}
    ref = {name: med[name] for name in ("ddp", "stage2") if name in med}
    cols = "".join(f" {'/ ' + name:>10}" for name in ref)
    print(f"\n{'variant':16} {'median step':>12}{cols} {'capture':>9} {'peak RSS/rank':>14}  captures/reuses")
    for v in variants:
        q1, _, q3 = statistics.quantiles(result["times"][v], n=4)
        ratios = "".join(f" {med[v] / r:9.3f}x" for r in ref.values())
        capture = f"{result['capture'][v]:8.1f}s" if ":" in v else f"{'-':>9}"
        mem = f"{rss[v] / 2**20:10.0f} MiB" if rss else f"{'-':>14}"
        g = result["graph"].get(v)
        counts = f"{g['captures']}/{g['reuses']}" if g else "-"
        print(f"{v:16} {med[v] * 1000:8.0f}ms [{q1 * 1000:.0f}-{q3 * 1000:.0f}]{ratios} {capture} {mem}  {counts}")


if __name__ == "__main__":
    main()
