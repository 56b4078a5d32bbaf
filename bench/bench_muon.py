"""Distributed Muon (MuonWithAdamW and DeepSpeed's Muon type on owner ranks) and LAMB against AdamW, same ZeRO stage.

    python bench/bench_muon.py [--world 2] [--stage 2] [--steps 8] [--d-model 128] [--layers 4]
                               [--offload none|cpu|nvme] [--sub-group-size N] [--nvme-path DIR]

One job; each rank builds the project's GPT twice (same seed), one engine with AdamW on every parameter and one with
Muon on the blocks' matrices and AdamW on the rest, and times optimizer steps of each in alternation (forward,
backward and step of one micro-batch; the median of the slowest rank's times); likewise DeepSpeed's Muon type
(``DeepSpeedMuon.from_config``, its Gram Newton-Schulz in fp32 on a CPU) and LAMB (``shardtrain.optim.lamb.Lamb``,
its norms summed over the shard group). Bytes per step are the engine's own
counters (``comm_stats``: the bus-bandwidth convention), per collective kind. Prints the ratio Muon / AdamW of both,
and the owners' Newton-Schulz cost per rank (rows x cols x min) over its mean: the load balance. ``--offload``: every
engine with ``offload_optimizer`` (sub-groups of ``--sub-group-size`` elements; Muon's and LAMB's of whole buckets).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.distributed as dist

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.optim.deepspeed_muon import DeepSpeedMuon
from shardtrain.optim.lamb import Lamb
from shardtrain.optim.muon import MuonWithAdamW
from shardtrain.testing import run_distributed

VOCAB, SEQ, ROWS = 256, 64, 4
KINDS = ("adamw", "muon", "ds-muon", "lamb")


def _model(d_model: int, layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=d_model, n_layer=layers, n_head=4))


def _optimizer(model: GPT, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-4)
    if kind == "lamb":
        return Lamb(model.parameters(), lr=1e-3)
    if kind == "ds-muon":
        return DeepSpeedMuon.from_config(model, None, {"muon_lr": 0.02, "adam_lr": 3e-4})
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith("blocks."))]
    return MuonWithAdamW([dict(params=hidden, use_muon=True, lr=0.02), dict(params=rest, use_muon=False, lr=3e-4)])


def body(stage: int, steps: int, d_model: int, layers: int, offload: dict | None = None) -> dict:
    zero = {"stage": stage, **(offload or {})}
    config = {"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": zero, "gradient_clipping": 0}
    engines = {}
    for kind in KINDS:
        model = _model(d_model, layers)
        engines[kind] = shardtrain.initialize(model, config=config, optimizer=_optimizer(model, kind))
    g = torch.Generator().manual_seed(dist.get_rank())
    times: dict[str, list[float]] = {k: [] for k in engines}
    stats: dict[str, dict] = {}
    for step in range(steps + 1):  # the first step of each is warm-up
        for kind, engine in engines.items():
            x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
            engine.comm_stats(reset=True)
            dist.barrier()
            start = time.perf_counter()
            engine.backward(engine(x, torch.roll(x, -1, dims=1)))
            engine.step()
            dist.barrier()
            if step:
                times[kind].append(time.perf_counter() - start)
            stats[kind] = engine.comm_stats()
    owners = engines["muon"].optimizer.whole_matrices
    out = {"times": times, "stats": stats, "load": owners.load if owners is not None else None}
    for engine in engines.values():
        engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--offload", choices=("none", "cpu", "nvme"), default="none")
    parser.add_argument("--sub-group-size", type=int, default=1_000_000_000)
    parser.add_argument("--nvme-path", default="/tmp", help="with --offload nvme: where the swap files go")
    args = parser.parse_args()
    offload = None
    if args.offload != "none":
        device = {"device": args.offload, **({"nvme_path": args.nvme_path} if args.offload == "nvme" else {})}
        offload = {"offload_optimizer": device, "sub_group_size": args.sub_group_size}
    ranks = run_distributed(body, args.world, args.stage, args.steps, args.d_model, args.layers, offload, timeout=1200)
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, gloo, world "
        f"{args.world}, ZeRO stage {args.stage}, GPT d_model {args.d_model} x {args.layers} layers, {ROWS}x{SEQ} rows"
        + (f", offload_optimizer {args.offload}, sub_group_size {args.sub_group_size}" if offload else "")
    )
    median = {}
    for kind in KINDS:
        slowest = [max(r["times"][kind][i] for r in ranks) for i in range(args.steps)]
        median[kind] = statistics.median(slowest)
        total = sum(v["bytes"] for v in ranks[0]["stats"][kind].values())
        kinds = ", ".join(f"{k} {v['bytes'] / 2**20:.2f}" for k, v in ranks[0]["stats"][kind].items())
        print(f"{kind:7s} step {median[kind] * 1e3:8.1f} ms   bytes/step {total / 2**20:7.2f} MiB ({kinds})")
        median[kind + "_bytes"] = total
    for kind in KINDS[1:]:
        time_ratio, bytes_ratio = median[kind] / median["adamw"], median[kind + "_bytes"] / median["adamw_bytes"]
        print(f"{kind} / AdamW: step time {time_ratio:.2f}x, bytes {bytes_ratio:.2f}x")
    load = ranks[0]["load"]
    if load:
        mean = sum(load) / len(load)
        print(f"owners' Newton-Schulz cost per rank / mean: {', '.join(f'{x / mean:.2f}' for x in load)}")


if __name__ == "__main__":
    main()
