"""A plain training loop built from the public API, one job per configuration, against torch DDP.

    python bench/bench_public_loop.py                        # ddp, stage1, stage2, stage3 with the defaults
    python bench/bench_public_loop.py --configs ddp,stage1,stage2,stage1:buckets,stage2:buckets --rounds 2
    python bench/bench_public_loop.py --configs ddp,stage2,stage2:torch-adamw,stage2:no-desync-check

What a user writes (no interleaving, no barrier per step, no hand-picked bucket sizes): every configuration runs in
fresh processes of its own (world 2, gloo, one thread per rank) on the ``gpt2-10m`` shape of bench_zero.py (the same
``shardtrain.models.gpt.GPT``, micro-batch 4 x 256), ``shardtrain.initialize(model, config=...)`` with the optimizer
from the config's ``optimizer`` section (AdamW, lr 1e-4) and ``gradient_clipping: 1.0``, then
``loss = engine(x, y); engine.backward(loss); engine.step()``. The step time is rank 0's wall time of one step
(the median over the steps of a job), with its CPU time (rank 0's process, gloo's threads included) and the time the
engine was blocked in collectives (``engine.comm.wait_seconds()``: communication that computation did not hide).
DDP: the same model in ``DistributedDataParallel`` with ``torch.optim.AdamW`` and
``clip_grad_norm_``. Configurations are run in a rotating order, ``--rounds`` times, and each is compared with the
DDP job of its own round (paired). Flags after the stage (``stage2:buckets:no-desync-check``) change one thing at a
time towards bench_zero.py's setup, to find what makes the two benchmarks differ:

* ``buckets``: ``reduce_bucket_size`` 6,250,000 elements (bench_zero's, DDP's 25 MB) instead of the default 5e8,
  which puts the whole model into one bucket;
* ``torch-adamw``: ``torch.optim.AdamW(model.parameters(), lr=1e-4)`` passed to ``initialize`` (bench_zero's) instead of
  the config's section (whose AdamW has ``weight_decay`` 0.01 either way: the same class, the same defaults);
* ``foreach`` / ``fused``: that AdamW implementation (torch's CPU default is the per-tensor loop);
* ``no-desync-check``: ``desync_check: false`` (the phase agreement of every backward and step);
* ``sync``: the all-gathers after a ZeRO-1/2 step waited for at the step ([Note: gathers after the step]).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig, num_parameters
from shardtrain.testing import run_distributed

SHAPE = GPTConfig(vocab_size=8192, seq_len=256, d_model=256, n_layer=8, n_head=8, gelu_approximate="tanh")
MICRO = 4


def _adamw_kwargs(flags: list[str]) -> dict:
    if "fused" in flags:
        return {"fused": True}
    if "foreach" in flags:
        return {"foreach": True}
    return {}


def train(config_name: str, steps: int, warmup: int) -> dict:
    """One job: build, train ``warmup + steps`` steps, return rank 0's step times and the last loss."""
    name, *flags = config_name.split(":")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(SHAPE)
    engine = None
    if name == "ddp":
        wrapped = DistributedDataParallel(model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, **_adamw_kwargs(flags))

        def step(x, y):
            loss = wrapped(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss

    else:
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": int(name[5])},
        }
        optimizer = None
        if "torch-adamw" in flags or _adamw_kwargs(flags):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **_adamw_kwargs(flags))
        else:
            config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
        if "buckets" in flags:
            config["zero_optimization"]["reduce_bucket_size"] = 25_000_000 // 4
        if "no-desync-check" in flags:
            config["desync_check"] = False
        engine = shardtrain.initialize(model, config=config, optimizer=optimizer)
        gathers = getattr(engine._optimizer, "gathers", None)
        if "sync" in flags and gathers is not None:
            gathers.overlap = False

        def step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss

    g = torch.Generator().manual_seed(rank)
    times, cpus, blocked = [], [], []
    loss = None
    for i in range(warmup + steps):
        x = torch.randint(0, SHAPE.vocab_size, (MICRO, SHAPE.seq_len), generator=g)
        if engine is not None:
            engine.comm.reset_wait_seconds()
        start, cpu = time.perf_counter(), time.process_time()
        loss = step(x, torch.roll(x, -1, 1))
        if i >= warmup:
            times.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
            blocked.append(sum(engine.comm.wait_seconds().values()) if engine is not None else 0.0)
    return {"times": times, "cpus": cpus, "blocked": blocked, "loss": float(loss.detach())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="ddp,stage1,stage2,stage3", help="comma-separated; ddp first")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    configs = args.configs.split(",")
    if configs[0] != "ddp":
        raise SystemExit("--configs must start with ddp (the reference)")
    print(
        f"# bench_public_loop: {num_parameters(GPT(SHAPE)) / 1e6:.2f}M-parameter GPT, world 2 (gloo, 1 thread/rank), "
        f"micro-batch {MICRO}x{SHAPE.seq_len}, {args.rounds} rounds x {args.steps} steps (+{args.warmup} warm-up)"
    )
    print(f"# machine: {platform.machine()}, torch {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}")
    medians: dict[str, list[float]] = {c: [] for c in configs}
    cpus: dict[str, list[float]] = {c: [] for c in configs}
    blocked: dict[str, list[float]] = {c: [] for c in configs}
    losses: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for c in order:
            result = run_distributed(train, 2, c, args.steps, args.warmup, timeout=3600, threads=1)[0]
            medians[c].append(statistics.median(result["times"]))
            cpus[c].append(statistics.median(result["cpus"]))
            blocked[c].append(statistics.median(result["blocked"]))
            losses[c].append(result["loss"])
            print(f"round {r} {c:32} median step {medians[c][-1] * 1000:7.0f} ms", flush=True)
    print(
        f"\n{'config':32} {'median step':>11} {'ratio to DDP per round':>24} {'CPU ratio':>9} {'blocked':>8}"
        "  loss (rank 0)"
    )
    for c in configs:
        ratios = [a / b for a, b in zip(medians[c], medians["ddp"])]
        cpu = statistics.median(a / b for a, b in zip(cpus[c], cpus["ddp"]))
        print(
            f"{c:32} {statistics.median(medians[c]) * 1000:9.0f}ms {statistics.median(ratios):6.3f}x "
            f"[{', '.join(f'{x:.3f}' for x in ratios)}] {cpu:8.3f}x {statistics.median(blocked[c]) * 1000:6.0f}ms"
            f"  {losses[c][-1]:.6f}"
        )


if __name__ == "__main__":
    main()
