"""Convergence of stall-free offload (``zero_optimization.zenflow``) against synchronous CPU offload: a small
Hugging Face Llama built from a config (random weights, nothing downloaded) fine-tuned on the project's Markov corpus.

    python bench/bench_zenflow.py                       # 300 steps, both runs, ~10 min on 2 busy cores
    python bench/bench_zenflow.py --steps 60 --layers 1  # a quick look

Both runs: world 1, ZeRO-2, ``offload_optimizer: {device: cpu}``, AdamW lr 3e-3, clipping 1.0, the same
initial weights and batches. The ZenFlow run adds DeepSpeed's example section (topk_ratio 0.1, update_interval 4,
overlap_step true) with ``select_strategy "step"``, ``select_interval`` 100 and ``full_warm_up_rounds`` 10.
Prints the mean loss of the last ``--tail`` steps of each run, their gap (absolute and relative to the
synchronous run's drop from the first loss), the corpus's entropy (the floor) and the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def train(zenflow: dict | None, steps: int, layers: int, seed: int) -> tuple[list[float], float]:
    """The per-step losses of one run and its seconds per step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardtrain
    from shardtrain.models.markov import MarkovCorpus

    torch.manual_seed(seed)
    vocab, seq, batch = 128, 64, 8
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq,
    )
    model = LlamaForCausalLM(cfg)
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    if zenflow is not None:
        zero["zenflow"] = zenflow
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }
    engine = shardtrain.initialize(model, config=config)
    corpus, g = MarkovCorpus(vocab, seed=seed), torch.Generator().manual_seed(seed + 1)
    losses, started = [], time.perf_counter()
    for _ in range(steps):
        x, y = corpus.batch(batch, seq, g)
        logits = engine(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    elapsed = (time.perf_counter() - started) / steps
    engine.close()
    return losses, elapsed


ZENFLOW = {
    "topk_ratio": 0.1,
    "update_interval": 4,
    "overlap_step": True,
    "select_strategy": "step",
    "select_interval": 100,
    "full_warm_up_rounds": 10,
}


def compare(steps: int, layers: int, tail: int, seed: int = 0, update_interval: int | str = 4) -> dict:
    """Both runs; the tail means, the gap and the corpus entropy. ``update_interval``: ZenFlow's (``"auto"``:
    DeepSpeed's adaptive interval)."""
    from shardtrain.models.markov import MarkovCorpus

    sync, sync_s = train(None, steps, layers, seed)
    zen, zen_s = train({**ZENFLOW, "update_interval": update_interval}, steps, layers, seed)
    tail = min(tail, steps)
    sync_tail, zen_tail = statistics.mean(sync[-tail:]), statistics.mean(zen[-tail:])
    drop = sync[0] - sync_tail
    return {
        "first": sync[0],
        "sync": sync_tail,
        "zenflow": zen_tail,
        "gap": zen_tail - sync_tail,
        "gap_of_drop": (zen_tail - sync_tail) / drop if drop else float("nan"),
        "entropy": MarkovCorpus(128, seed=seed).entropy(),
        "sync_s": sync_s,
        "zenflow_s": zen_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tail", type=int, default=50, help="steps averaged at the end of each run")
    parser.add_argument("--update-interval", default="4", help='ZenFlow\'s update_interval: steps, or "auto"')
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    update = args.update_interval if args.update_interval == "auto" else int(args.update_interval)
    r = compare(args.steps, args.layers, args.tail, update_interval=update)
    print(f"steps {args.steps}, layers {args.layers}, loss mean of the last {args.tail} steps")
    print("| run | final loss | s/step |\n|---|---|---|")
    print(f"| synchronous CPU offload | {r['sync']:.4f} | {r['sync_s']:.3f} |")
    print(f"| zenflow (topk 0.1, update {update}, overlap) | {r['zenflow']:.4f} | {r['zenflow_s']:.3f} |")
    print(f"first loss {r['first']:.4f}, corpus entropy {r['entropy']:.4f}")
    print(f"gap zenflow - sync: {r['gap']:+.4f} ({100 * r['gap_of_drop']:+.1f}% of the synchronous run's drop)")
    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


if __name__ == "__main__":
    main()
