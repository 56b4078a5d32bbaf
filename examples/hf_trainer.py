"""Fine-tune with the Hugging Face Trainer on shardtrain: a file to copy and adapt.

    torchrun --nproc_per_node=2 examples/hf_trainer.py --output-dir runs/trainer --steps 20
    torchrun --nproc_per_node=2 examples/hf_trainer.py --output-dir runs/trainer --steps 40 --resume
    torchrun --nproc_per_node=2 examples/hf_trainer.py --model path/to/pretrained --config ds_config.json ...

What it shows: the Trainer unchanged except for ``ShardtrainTrainer`` and its ``shardtrain_config`` (the DeepSpeed
JSON that ``TrainingArguments(deepspeed=...)`` took; here, without ``--config``, ZeRO-3 with every value "auto", as
transformers' documentation writes it); checkpoints every ``--save-steps``; ``--resume`` continues from the newest
checkpoint in ``--output-dir``; ``save_model`` writing ``<output-dir>/final``, which ``from_pretrained`` opens.

Data: a tiny random Llama (``--model`` not given) on generated character data, so that the example needs no
download; with ``--model``, replace ``CharData`` with the model's tokenizer and your dataset.
See docs/migration-hf-trainer.md.
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

from shardtrain.distributed.mesh import pick_device
from shardtrain.integrations.hf_trainer import ShardtrainTrainer

ZERO3_AUTO = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


class CharData(torch.utils.data.Dataset):
    """Windows of a generated English-like text, as character ids; each window is its own labels."""

    def __init__(self, seq_len: int = 32, windows: int = 512, seed: int = 0) -> None:
        rng = random.Random(seed)
        words = ["the cat", "a dog", "sees", "likes", "the river", "a red ball", "the old man", "finds"]
        text = " ".join(rng.choice(words) for _ in range(windows * seq_len // 4))
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text])
        starts = torch.randint(0, len(ids) - seq_len, (windows,), generator=torch.Generator().manual_seed(seed))
        self.rows = [ids[s : s + seq_len] for s in starts.tolist()]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--config", help="DeepSpeed-style JSON (default: ZeRO-3, every value auto)")
    parser.add_argument("--model", help="pretrained directory (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    args = parser.parse_args()

    data = CharData()
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model)
    else:
        torch.manual_seed(0)  # every rank builds the same weights
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(
                vocab_size=len(data.vocab),
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=32,
            )
        )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=5,
        max_steps=args.steps,
        logging_steps=5,
        save_steps=args.save_steps,
        save_total_limit=2,
        report_to="none",
        use_cpu=pick_device().type == "cpu",  # where the engine trains (SHARDTRAIN_DEVICE, then CUDA if any)
    )
    trainer = ShardtrainTrainer(
        model=model,
        args=training_args,
        train_dataset=data,
        shardtrain_config=args.config or ZERO3_AUTO,
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(f"{args.output_dir}/final")  # every rank calls it; rank 0 writes
    if trainer.is_world_process_zero():
        print(f"step {trainer.state.global_step}: model in {args.output_dir}/final", flush=True)


if __name__ == "__main__":
    main()
