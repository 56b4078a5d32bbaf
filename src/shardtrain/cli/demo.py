"""``make demo``: train a small GPT on generated data with ZeRO on local processes.

Run under a launcher: ``torchrun --standalone --nproc_per_node=2 -m shardtrain.cli.demo [--stage 2]``.
Rank 0 shows a progress bar with the loss and ends with a summary: loss first -> last, and each rank's
memory by category next to what unsharded (stage 0, DDP-like) training holds.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig, num_parameters
from shardtrain.models.markov import MarkovCorpus


def _mib(n: int) -> str:
    return f"{n / 2**20:7.2f} MiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="compute dtype")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    gpt = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layer=4, n_head=4, tie_embeddings=True)
    model = GPT(gpt)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 20}},
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 200_000},
        "steps_per_print": 10**9,  # the progress bar reports instead
    }
    if args.dtype != "fp32":
        config[args.dtype] = {"enabled": True}
    engine = shardtrain.initialize(model, config=config)
    rank, world = engine.topology.rank, engine.topology.world_size
    corpus = MarkovCorpus(gpt.vocab_size, seed=args.seed)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank reads different sequences

    losses = []
    start = time.perf_counter()
    bar = tqdm(range(args.steps), disable=rank != 0, desc=f"ZeRO-{args.stage} x{world}", unit="step")
    for _ in bar:
        x, y = corpus.batch(args.micro_batch, gpt.seq_len, data)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        shown = {"loss": f"{losses[-1]:.3f}", "grad_norm": f"{engine.get_global_grad_norm():.2f}"}
        if args.dtype == "fp16":  # overflow steps are skipped; the bar says how many and at which scale
            shown.update(skipped=engine.skipped_steps, scale=f"{engine.loss_scale:g}")
        bar.set_postfix(shown)
    elapsed = time.perf_counter() - start

    per_rank = engine.comm.all_gather_object(engine.state_bytes(), what="demo memory summary")
    if rank != 0:
        return
    n = num_parameters(model)
    tensors = len(list(model.parameters()))
    if args.dtype == "fp32":
        unsharded = {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * tensors}
    else:  # compute-dtype parameters, fp32 gradient accumulation, fp32 masters + moments
        unsharded = {"params": 2 * n, "grads": 4 * n, "optimizer": 12 * n + 4 * tensors}
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    skipped = f", {engine.skipped_steps} skipped (fp16 overflow)" if args.dtype == "fp16" else ""
    print(
        f"\n{n / 1e6:.2f}M parameters, {world} ranks, ZeRO stage {args.stage}, {args.dtype}, "
        f"{args.steps} steps{skipped} in {elapsed:.1f}s"
    )
    uniform, entropy = corpus.uniform_loss(gpt.vocab_size), corpus.entropy()
    print(f"loss (mean of 10 steps): {first:.3f} -> {last:.3f}   (uniform guess {uniform:.3f}, entropy {entropy:.3f})")
    print(f"\nmemory per rank          {'params':>11} {'grads':>11} {'optimizer':>11} {'total':>11}")
    rows = [(f"rank {r} (sharded)", b) for r, b in enumerate(per_rank)] + [("unsharded (stage 0)", unsharded)]
    for label, b in rows:
        print(f"  {label:21}{_mib(b['params'])} {_mib(b['grads'])} {_mib(b['optimizer'])} {_mib(sum(b.values()))}")


if __name__ == "__main__":
    main()
