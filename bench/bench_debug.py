"""Overhead of the statistics subscriber on the demo-size GPT, steps interleaved so ratios survive a noisy machine.

    python bench/bench_debug.py [--steps 60] [--warmup 5] [--threads N]

Three engines (ZeRO stage 0, one process) train identical copies of the demo's GPT on the same batches:

* ``none``: no subscriber (the reference);
* ``outside``: a StatisticsSubscriber whose window [start_step, end_step) lies beyond the run, i.e. what a
  subscriber costs on every step it does not record;
* ``inside``: a StatisticsSubscriber recording every step (every module output and every gradient).

Each iteration runs one optimizer step of each variant in a rotating order. Prints the median step time of each
variant and its ratio to ``none`` measured in the same run, with the machine and the command.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

import shardtrain
from shardtrain.debug import StatisticsSubscriber, SubscriberManager
from shardtrain.models.gpt import GPT, GPTConfig, num_parameters

VARIANTS = ["none", "outside", "inside"]
MICRO_BATCH = 16
DEMO_GPT = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layer=4, n_head=4, tie_embeddings=True)


def build(variant: str, out_root: str, manager: SubscriberManager):
    torch.manual_seed(0)
    model = GPT(DEMO_GPT)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "zero_optimization": {"stage": 0}}
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    if variant == "outside":
        far = 10**9  # never reached: only the root hooks stay installed
        manager.subscribe(engine, StatisticsSubscriber(os.path.join(out_root, variant), start_step=far))
    elif variant == "inside":
        manager.subscribe(engine, StatisticsSubscriber(os.path.join(out_root, variant)))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.backward(engine(x, y))
        engine.step()

    return step, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    manager = SubscriberManager()
    g = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as out_root:
        built = {v: build(v, out_root, manager) for v in VARIANTS}
        for i in range(args.warmup + args.steps):
            x = torch.randint(0, DEMO_GPT.vocab_size, (MICRO_BATCH, DEMO_GPT.seq_len), generator=g)
            y = torch.roll(x, -1, dims=1)
            order = VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]
            for variant in order:
                start = time.perf_counter()
                built[variant][0](x, y)
                if i >= args.warmup:
                    times[variant].append(time.perf_counter() - start)
        for variant in ("outside", "inside"):
            manager.unsubscribe(built[variant][1])
        recorded = sum(len(files) for _, _, files in os.walk(os.path.join(out_root, "inside")))
    model_params = num_parameters(GPT(DEMO_GPT))
    machine = " ".join(filter(None, (platform.machine(), platform.processor())))
    print(f"# machine: {machine}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}")
    print(f"# model: demo GPT {model_params / 1e6:.2f}M parameters, micro-batch {MICRO_BATCH}, ZeRO stage 0, 1 process")
    print(f"# {args.steps} measured steps per variant after {args.warmup} warm-up; inside wrote {recorded} step files")
    reference = statistics.median(times["none"])
    # the paired ratio compares steps of the same iteration (same batch, neighbouring in time): robust to drift
    print(f"{'variant':<10} {'median step ms':>15} {'ratio of medians':>17} {'median paired ratio':>20}")
    for variant in VARIANTS:
        median = statistics.median(times[variant])
        paired = statistics.median(t / r for t, r in zip(times[variant], times["none"]))
        print(f"{variant:<10} {median * 1e3:>15.2f} {median / reference:>17.3f} {paired:>20.3f}")


if __name__ == "__main__":
    main()
