"""One rank of the run that aborted at exit (issue 37 item 4): ``ShardtrainTrainer`` trains a tiny GPT-2 or Llama
(from a config, nothing downloaded) for a few steps, saves a checkpoint and the model, and the script ends without
``trainer.end()`` or ``destroy_process_group``, as most scripts do. Run by tests/compat/test_hf_trainer_exit.py under
torchrun-style variables, one process per rank::

    python tests/helpers/trainer_exit_script.py gpt2 OUTPUT_DIR [end]

With ``end`` the script ends with ``trainer.end()``, as transformers documents.
"""

from __future__ import annotations

import atexit
import sys
import weakref

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, TrainingArguments

from shardtrain.compat.hf_trainer import ShardtrainTrainer

VOCAB, SEQ = 64, 16


class TokenRows(torch.utils.data.Dataset):
    def __init__(self, rows: int = 24) -> None:
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model_config(kind: str):
    if kind == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )


ENGINE_GROUPS: list[weakref.ref] = []
"""The process groups the engine created, weakly: each must be freed by the time the interpreter finalizes."""


def report_at_exit() -> None:
    """Registered before shardtrain's engine-closing hooks (those are registered when the Trainer is built), so it
    runs after them: what they left. A group still alive
    here keeps gloo worker threads into the interpreter's finalization, where they abort the process ([Note: gloo
    workers that outlive the engine] in shardtrain/distributed/gloo_threads.py)."""
    import gc

    from shardtrain.distributed.gloo_threads import gloo_workers
    from shardtrain.engine import shutdown

    gc.collect()
    alive = sum(ref() is not None for ref in ENGINE_GROUPS)
    print(f"at exit: open engines {len(shutdown._open)}, process group {dist.is_initialized()}", flush=True)
    print(f"at exit: engine groups alive {alive} of {len(ENGINE_GROUPS)}, gloo workers {len(gloo_workers())}")


def main(kind: str, out: str, end: bool = False) -> None:
    atexit.register(report_at_exit)
    torch.manual_seed(0)  # every rank builds the same weights
    model = AutoModelForCausalLM.from_config(model_config(kind))
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=3,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        # persistence threshold 0: every block is a ZeRO-3 unit, so gathers, prefetches and their checks run
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    trainer = ShardtrainTrainer(model=model, args=args, train_dataset=TokenRows(), shardtrain_config=config)
    trainer.train()
    trainer.save_model(f"{out}/final")  # the last collective, moments before the interpreter exits
    if trainer.is_world_process_zero():
        print(f"trained {trainer.state.global_step} steps", flush=True)
    ENGINE_GROUPS.extend(weakref.ref(g) for g in trainer.shardtrain_engine.topology.own_groups)
    if end:
        trainer.end()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], end=sys.argv[3:] == ["end"])
