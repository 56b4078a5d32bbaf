"""Fine-tune a Hugging Face causal LM with shardtrain: a file to copy and adapt.

    torchrun --nproc_per_node=2 examples/finetune_hf.py --config examples/ds_config_zero3.json \\
        --model path/to/pretrained_dir --output-dir runs/ft --steps 200 --save-every 50
    torchrun --nproc_per_node=2 examples/finetune_hf.py --config examples/ds_config_zero3.json \\
        --tiny --output-dir runs/tiny --steps 20 --save-every 10      # a tiny random Llama, nothing needed

What it shows: a DeepSpeed-style JSON config; the model built sharded (``shardtrain.from_pretrained`` for a
pretrained directory, ``shardtrain.zero.Init`` + ``initialize`` for a config); the optimizer and scheduler from the
config's sections; gradient accumulation; a progress bar on rank 0; a checkpoint every ``--save-every`` steps;
resuming from ``<output-dir>/checkpoints/latest`` when it exists (run the same command again with more ``--steps``);
and a consolidated Hugging Face directory ``<output-dir>/final`` (``AutoModelForCausalLM.from_pretrained`` opens it).

Data: a generated text corpus with a character-level vocabulary (``vocab.json`` is written next to the output), so
that the example needs no download. With a real model, replace ``CharData`` with its tokenizer
(``AutoTokenizer.from_pretrained(args.model)``) and your dataset; the rest stays as it is.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import shardtrain
from shardtrain.checkpoint import open_checkpoint
from shardtrain.checkpoint.consolidate import consolidate


class CharData:
    """A generated English-like corpus, its character vocabulary and reproducible batches."""

    def __init__(self, seed: int = 0, sentences: int = 2000) -> None:
        rng = random.Random(seed)
        subjects = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
        verbs = ["sees", "likes", "finds", "follows", "draws", "remembers"]
        objects = ["the river", "a red ball", "the long road", "an open door", "the quiet garden", "a blue cup"]
        text = " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(sentences))
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.long)

    def batch(self, size: int, seq_len: int, step: int, micro: int, rank: int, seed: int) -> torch.Tensor:
        """Windows of the corpus chosen by (seed, step, micro-step, rank): a resumed run continues the same stream."""
        g = torch.Generator().manual_seed(hash((seed, step, micro, rank)) % 2**63)
        starts = torch.randint(0, len(self.ids) - seq_len, (size,), generator=g)
        return torch.stack([self.ids[s : s + seq_len] for s in starts.tolist()])


def build_engine(args: argparse.Namespace, vocab_size: int) -> shardtrain.Engine:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.model:  # built under zero.Init at stage 3; each rank reads only its rows of the safetensors files
        engine = shardtrain.from_pretrained(AutoModelForCausalLM, args.model, config=args.config)
        if engine.module.config.vocab_size < vocab_size:
            raise SystemExit(f"the model's vocabulary ({engine.module.config.vocab_size}) is smaller than the data's")
        return engine
    config = shardtrain.load_config(args.config)
    hf_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
    )
    torch.manual_seed(args.seed)  # every rank builds the same initial weights (required under zero.Init)
    if config.zero_optimization.stage == 3:
        with shardtrain.zero.Init():
            model = AutoModelForCausalLM.from_config(hf_config)
    else:
        model = AutoModelForCausalLM.from_config(hf_config)
    return shardtrain.initialize(model, config=config)  # optimizer and scheduler: the config's sections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="DeepSpeed-style JSON (e.g. examples/ds_config_zero3.json)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="pretrained directory (save_pretrained output: config.json + safetensors)")
    source.add_argument("--tiny", action="store_true", help="a tiny random Llama built from a config instead")
    parser.add_argument("--output-dir", required=True, help="checkpoints/, final/ and vocab.json go here")
    parser.add_argument("--steps", type=int, default=100, help="train until this many optimizer steps in total")
    parser.add_argument("--save-every", type=int, default=50, help="checkpoint every N optimizer steps")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    data = CharData(args.seed)
    engine = build_engine(args, len(data.vocab))
    rank = dist.get_rank()
    out = Path(args.output_dir)
    ckpt_dir = out / "checkpoints"
    if (ckpt_dir / "latest").exists():  # resume: weights, optimizer, scheduler, counters, RNG
        engine.load_checkpoint(ckpt_dir)
        if rank == 0:
            print(f"resumed from {ckpt_dir} at step {engine.global_step}", flush=True)
    saved_at = engine.global_step if (ckpt_dir / "latest").exists() else None

    bar = tqdm(total=args.steps, initial=engine.global_step, desc="train", disable=rank != 0)
    loss = float("nan")
    while engine.global_step < args.steps:
        step = engine.global_step
        for micro in range(engine.gradient_accumulation_steps):
            x = data.batch(engine.micro_batch_size, args.seq_len, step, micro, rank, args.seed).to(engine.device)
            output = engine(input_ids=x, labels=x)  # HF shifts the labels itself
            engine.backward(output.loss)
            engine.step()  # the optimizer steps after the last micro-step
        loss = output.loss.item()
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{engine.get_lr()[0]:.2e}", refresh=False)
        bar.update(1)
        if engine.global_step % args.save_every == 0:
            engine.save_checkpoint(ckpt_dir)  # collective; crash-safe; ckpt_dir/latest names it
            saved_at = engine.global_step
    bar.close()
    if saved_at != engine.global_step:
        engine.save_checkpoint(ckpt_dir)
    engine.close()  # flush monitors (tensorboard/csv sections of the config)

    if rank == 0:  # one process merges the shards: model.safetensors + config.json + generation_config.json
        consolidate(open_checkpoint(ckpt_dir), out / "final", progress=False)
        (out / "final" / "vocab.json").write_text(json.dumps(data.vocab))
        print(f"step {engine.global_step}: loss {loss:.4f}; Hugging Face model in {out / 'final'}", flush=True)


if __name__ == "__main__":
    main()
