"""What tests/compat/test_hf_trainer.py runs on each rank: a tiny Llama trained by the plain ``transformers.Trainer``
or by ``ShardtrainTrainer`` on the same data, seed and global batch."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import torch

VOCAB, SEQ = 64, 16

# A DeepSpeed config as HF Trainer users write it: every value the Trainer knows is "auto"; optimizer and scheduler
# are the Trainer's own (no sections).
DS_CONFIG: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


# The optimizer and scheduler from the config's sections instead, with "auto" hyperparameters. WarmupDecayLR with a
# linear warm-up is the Trainer's "linear" schedule; the config's AdamW decays every parameter, where the Trainer's
# exempts biases and norms, so the two agree at weight_decay 0.
SECTIONS = {
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
            "warmup_type": "linear",
        },
    },
}


def ds_config(**changes: Any) -> dict[str, Any]:
    config = copy.deepcopy(DS_CONFIG)
    config.update(changes)
    return config


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)  # every rank (and the reference) builds the same weights
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


class TokenData(torch.utils.data.Dataset):
    """Random token rows (no padding), each its own labels."""

    def __init__(self, rows: int = 48, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# What every run here sets, plain or shardtrain, Trainer or TRL
SETTINGS = {
    "learning_rate": 5e-3,
    "warmup_steps": 2,
    "weight_decay": 0.01,
    "max_grad_norm": 0.5,  # small enough to clip on some steps: the engine's clipping is compared too
    "logging_steps": 1,
    "report_to": "none",
    "disable_tqdm": True,
    "seed": 0,
    "use_cpu": True,
    "dataloader_num_workers": 0,
    # optim: the default, adamw_torch_fused (torch's fused AdamW kernel, on the engine's flat fragments)
}


def schedule(out_dir: str, batch: int, gas: int, steps: int, save_steps: int | None = None) -> dict[str, Any]:
    """The training arguments of a run's batches, length and checkpoints (none without ``save_steps``)."""
    return {
        "output_dir": out_dir,
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": gas,
        "max_steps": steps,
        "save_strategy": "steps" if save_steps else "no",
        "save_steps": save_steps or 500,
    }


def make_trainer(
    out_dir: str,
    *,
    shardtrain_config: dict | None,
    batch: int,
    gas: int,
    steps: int,
    save_steps: int | None = None,
    lora: bool = False,
    rows: int = 48,
    deepspeed_scheduler: dict | None = None,
    **arg_changes: Any,
):
    """A Trainer (``shardtrain_config`` None) or a ShardtrainTrainer over a fresh tiny Llama. ``deepspeed_scheduler``
    (the Trainer only): a config's ``scheduler`` section whose schedule DeepSpeed's own class runs, on the Trainer's
    optimizer, instead of the Trainer's ``lr_scheduler_type`` (see :func:`deepspeed_scheduler_trainer`)."""
    from transformers import Trainer, TrainingArguments

    settings = {**SETTINGS, "per_device_eval_batch_size": 2, **arg_changes}
    args = TrainingArguments(**schedule(out_dir, batch, gas, steps, save_steps), **settings)
    model = tiny_llama()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    data = {"train_dataset": TokenData(rows), "eval_dataset": TokenData(8, seed=2)}
    if shardtrain_config is None:
        cls = Trainer if deepspeed_scheduler is None else deepspeed_scheduler_trainer(deepspeed_scheduler)
        return cls(model=model, args=args, **data)
    from shardtrain.integrations.hf_trainer import ShardtrainTrainer

    return ShardtrainTrainer(model=model, args=args, shardtrain_config=shardtrain_config, **data)


def deepspeed_scheduler_trainer(section: dict):
    """A Trainer class whose scheduler is DeepSpeed's own (``deepspeed.runtime.lr_schedules``), built from ``section``
    with its "auto" values filled as the Trainer's DeepSpeed integration fills them: what a user of the Trainer with
    DeepSpeed and that config section gets. DeepSpeed's schedulers set the first lr when built and count steps from
    there, one step behind torch's (see [Note: DeepSpeed's step count] in shardtrain.optim.schedulers)."""
    import os

    from transformers import Trainer

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: no GPU probing
    from deepspeed.runtime import lr_schedules

    class DeepSpeedSchedulerTrainer(Trainer):
        def create_scheduler(self, num_training_steps: int, optimizer=None):
            if self.lr_scheduler is None:
                auto = {
                    "warmup_min_lr": 0.0,
                    "warmup_max_lr": self.args.learning_rate,
                    "warmup_num_steps": max(1, self.args.get_warmup_steps(num_training_steps)),
                    "total_num_steps": num_training_steps,
                }
                params = {k: auto[k] if v == "auto" else v for k, v in section["params"].items()}
                cls = getattr(lr_schedules, section["type"])
                self.lr_scheduler = cls(optimizer if optimizer is not None else self.optimizer, **params)
            return self.lr_scheduler

    return DeepSpeedSchedulerTrainer


def step_logs(trainer) -> list[tuple[int, float, float, float]]:
    """(step, loss, grad_norm, learning_rate) of every logged step."""
    return [
        (h["step"], h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h
    ]


def plain_run(out_dir: str, batch: int, gas: int, steps: int, rows: int, **arg_changes: Any) -> dict[str, Any]:
    """The reference: the plain Trainer in one process."""
    trainer = make_trainer(out_dir, shardtrain_config=None, batch=batch, gas=gas, steps=steps, rows=rows, **arg_changes)
    weights = trained_weights(trainer)
    return {"logs": step_logs(trainer), "weights": weights, "eval_loss": trainer.evaluate()["eval_loss"]}


def trained_weights(trainer) -> dict[str, torch.Tensor]:
    """Train a plain trainer (one process) and copy its model's weights."""
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def shardtrain_run(
    out_dir: str,
    batch: int,
    gas: int,
    steps: int,
    save_steps: int,
    final_dir: str,
    rows: int,
    config: dict[str, Any] = DS_CONFIG,
    **arg_changes: Any,
) -> dict[str, Any]:
    """Train ``steps`` steps saving every ``save_steps``, write ``final_dir`` with save_model; then a second trainer
    (fresh model) resumes from the first checkpoint and trains to the same end."""
    import os

    common = {"shardtrain_config": config, "batch": batch, "gas": gas, "steps": steps, "rows": rows, **arg_changes}
    trainer = make_trainer(os.path.join(out_dir, "first"), save_steps=save_steps, **common)
    trainer.train()
    engine = trainer.shardtrain_engine
    trainer.save_model(final_dir)
    weights = engine.full_state_dict()
    state = {
        "stage": engine.stage,
        "global_step": engine.global_step,
        "dp": engine.topology.dp,
        "micro_steps": engine.micro_steps,
    }
    first_logs = step_logs(trainer)
    eval_loss = trainer.evaluate()["eval_loss"]  # through the engine's forward, ZeRO-3 units gathered
    engine.close()
    resumed = resume_first_checkpoint(make_trainer, out_dir, save_steps, common, step_logs)
    return {"logs": first_logs, "weights": weights, "eval_loss": eval_loss, "state": state, **resumed}


def resume_first_checkpoint(make, out_dir: str, save_steps: int, common: dict, logs) -> dict[str, Any]:
    """A second shardtrain trainer, ``make(out_dir/resumed, **common)`` (a fresh model), resumes from the first
    run's checkpoint at ``save_steps`` (in out_dir/first) and trains to the same end: its ``logs(trainer)``, weights
    and the optimizer's step count (one number when every parameter's state agrees)."""
    import os

    resumed = make(os.path.join(out_dir, "resumed"), **common)
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, "first", f"checkpoint-{save_steps}"))
    engine = resumed.shardtrain_engine
    weights = engine.full_state_dict()
    adam_steps = {int(s["step"]) for s in engine.optimizer.state.values()}
    engine.close()
    return {
        "resumed_logs": logs(resumed),
        "resumed_weights": weights,
        "resumed_adam_step": adam_steps.pop() if len(adam_steps) == 1 else adam_steps,
    }


def lora_run(out_dir: str, adapter_dir: str) -> dict[str, Any]:
    """A peft LoRA model trained by ShardtrainTrainer at ZeRO-3, optimizer and scheduler from the config's sections;
    the adapter saved with save_model."""
    config = ds_config(**SECTIONS)
    trainer = make_trainer(out_dir, shardtrain_config=config, batch=2, gas=1, steps=3, lora=True)
    trainer.train()
    trainer.save_model(adapter_dir)
    engine = trainer.shardtrain_engine
    weights = engine.full_state_dict()
    resolved = engine.config.model_dump(exclude_unset=True)
    engine.close()
    return {"weights": weights, "config": resolved, "optimizer": type(engine.optimizer).__name__}


def refusals(out_dir: str) -> dict[str, str]:
    """The messages of what ShardtrainTrainer refuses, by case (one process)."""
    import os

    from shardtrain.errors import ShardtrainError

    messages = {}

    def caught(name: str, fn) -> None:
        try:
            fn()
        except ShardtrainError as err:
            messages[name] = str(err)
        else:
            raise AssertionError(f"{name}: nothing was refused")

    common = {"batch": 2, "gas": 2, "steps": 1, "rows": 8}
    caught(
        "torch_compile",
        lambda: make_trainer(out_dir, shardtrain_config=DS_CONFIG, torch_compile=True, **common),
    )
    mismatched = ds_config(gradient_accumulation_steps=4)
    caught("gas_mismatch", lambda: make_trainer(out_dir, shardtrain_config=mismatched, **common).train())
    bf16 = ds_config(bf16={"enabled": True})
    caught("bf16_mismatch", lambda: make_trainer(out_dir, shardtrain_config=bf16, **common).train())
    plain = os.path.join(out_dir, "plain")
    make_trainer(plain, shardtrain_config=None, save_steps=1, **common).train()
    checkpoint = os.path.join(plain, "checkpoint-1")
    caught(
        "plain_checkpoint",
        lambda: make_trainer(out_dir, shardtrain_config=DS_CONFIG, **common).train(resume_from_checkpoint=checkpoint),
    )
    return messages


def best_model_run(out_dir: str) -> dict[str, Any]:
    """load_best_model_at_end: the engine ends with the best checkpoint's weights."""
    from safetensors.torch import load_file

    trainer = make_trainer(
        out_dir,
        shardtrain_config=DS_CONFIG,
        batch=2,
        gas=1,
        steps=3,
        rows=8,
        save_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        # fitting random rows raises the loss on other random rows: the lowest is the first checkpoint, not the last
        greater_is_better=False,
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    weights = trainer.shardtrain_engine.full_state_dict()
    trainer.shardtrain_engine.close()
    import os

    saved = {
        name: load_file(os.path.join(out_dir, f"checkpoint-{s}", "model.safetensors"))
        for name, s in (("best", best.rsplit("-", 1)[1]), ("last", 3))
    }
    return {
        "best": os.path.basename(best),
        "equals_best": all(torch.equal(weights[k], v) for k, v in saved["best"].items()),
        "equals_last": all(torch.equal(weights[k], v) for k, v in saved["last"].items()),
    }


def single_rank_checks(out_dir: str) -> dict[str, Any]:
    import os

    return {
        "messages": refusals(os.path.join(out_dir, "refusals")),
        "best": best_model_run(os.path.join(out_dir, "best")),
    }


# -- TRL (tests/compat/test_trl.py): SFTTrainer and DPOTrainer on a word-level tokenizer and text made here ------------


def word_tokenizer():
    """A word-level tokenizer over the tiny Llama's vocabulary ("w2" ... "w63"; 0 pads, 1 ends), built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _words(g: torch.Generator, lo: int, hi: int) -> str:
    n = int(torch.randint(lo, hi, (1,), generator=g))
    return " ".join(f"w{int(i)}" for i in torch.randint(2, VOCAB, (n,), generator=g))


def sft_data(rows: int, seed: int = 1):
    """Texts of 3 to 14 words: SFTTrainer tokenizes them, adds the end token and pads each batch (so the ranks'
    micro-batches hold different numbers of tokens, which the loss must weigh as one process does)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"text": [_words(g, 3, 15) for _ in range(rows)]})


def dpo_data(rows: int, seed: int = 1):
    """Preference rows: a prompt, a chosen and a rejected completion of different lengths (completions start with a
    space: TRL joins prompt and completion as text)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    data: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(rows):
        data["prompt"].append(_words(g, 2, 6))
        data["chosen"].append(" " + _words(g, 2, 8))
        data["rejected"].append(" " + _words(g, 2, 8))
    return Dataset.from_dict(data)


# TRL's configs default to bf16=True; shardtrain's bf16 is DeepSpeed's (parameters cast, fp32 masters), the plain
# trainer's is autocast: fp32 is where the two must agree to rounding
TRL_SETTINGS = {**SETTINGS, "bf16": False}

# what TRL logs per step besides the loss, compared between the runs
SFT_METRICS = ("num_tokens", "mean_token_accuracy", "entropy")
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def make_trl_trainer(
    kind: str,
    out_dir: str,
    *,
    shardtrain_config: dict | None,
    batch: int,
    gas: int,
    steps: int,
    rows: int,
    save_steps: int | None = None,
    lora: bool = False,
    **arg_changes: Any,
):
    """trl.SFTTrainer (``kind`` "sft") or trl.DPOTrainer ("dpo"), with ``shardtrain_config`` None, else its shardtrain
    subclass, over a fresh tiny Llama; ``lora``: a LoRA adapter (peft_config). DPO has a separate reference model that
    differs from it (another seed), so the reference's log-probabilities weigh from step 1, except with ``lora`` (TRL
    disables the adapter for the reference)."""
    import trl

    schedule_args = schedule(out_dir, batch, gas, steps, save_steps)
    if kind == "sft":
        name, data = "SFTTrainer", sft_data(rows)
        args = trl.SFTConfig(**schedule_args, max_length=SEQ, **{**TRL_SETTINGS, **arg_changes})
    else:
        name, data = "DPOTrainer", dpo_data(rows)
        args = trl.DPOConfig(**schedule_args, **{**TRL_SETTINGS, **arg_changes})
    kwargs: dict[str, Any] = {
        "model": tiny_llama(),
        "args": args,
        "train_dataset": data,
        "processing_class": word_tokenizer(),
    }
    if lora:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    elif kind == "dpo":
        kwargs["ref_model"] = tiny_llama(seed=1)
    if shardtrain_config is None:
        return getattr(trl, name)(**kwargs)
    from shardtrain.integrations import trl_trainers

    return getattr(trl_trainers, f"Shardtrain{name}")(**kwargs, shardtrain_config=shardtrain_config)


def trl_logs(trainer, metrics: tuple[str, ...]) -> list[tuple]:
    """(step, loss, grad_norm, learning_rate, *metrics) of every logged step."""
    return [
        (h["step"], h["loss"], h["grad_norm"], h["learning_rate"], *(h[m] for m in metrics))
        for h in trainer.state.log_history
        if "loss" in h
    ]


def plain_sft_run(out_dir: str, batch: int, gas: int, steps: int, rows: int) -> dict[str, Any]:
    """The reference: trl.SFTTrainer in one process."""
    trainer = make_trl_trainer("sft", out_dir, shardtrain_config=None, batch=batch, gas=gas, steps=steps, rows=rows)
    return {"weights": trained_weights(trainer), "logs": trl_logs(trainer, SFT_METRICS)}


def shardtrain_sft_run(
    out_dir: str, batch: int, gas: int, steps: int, rows: int, save_steps: int, final_dir: str, adapter_dir: str
) -> dict[str, Any]:
    """ShardtrainSFTTrainer at ZeRO-3: train saving every ``save_steps``, save_model to ``final_dir``; a second
    trainer (fresh model) resumes from the first checkpoint; a LoRA run (peft_config) saves its adapter."""
    import os

    common = {"shardtrain_config": DS_CONFIG, "batch": batch, "gas": gas, "steps": steps, "rows": rows}
    make = partial(make_trl_trainer, "sft")
    trainer = make(os.path.join(out_dir, "first"), save_steps=save_steps, **common)
    trainer.train()
    engine = trainer.shardtrain_engine
    trainer.save_model(final_dir)
    weights = engine.full_state_dict()
    stage = engine.stage
    engine.close()
    resumed = resume_first_checkpoint(make, out_dir, save_steps, common, partial(trl_logs, metrics=SFT_METRICS))

    lora = make(os.path.join(out_dir, "lora"), lora=True, **{**common, "steps": 2})
    lora.train()
    lora.save_model(adapter_dir)
    lora_state = lora.shardtrain_engine.full_state_dict()  # rank 0's; None on the others
    lora_weights = {k: v for k, v in (lora_state or {}).items() if "lora_" in k}
    lora.shardtrain_engine.close()
    return {
        "logs": trl_logs(trainer, SFT_METRICS),
        "weights": weights,
        "stage": stage,
        **resumed,
        "lora_weights": lora_weights,
    }


def plain_dpo_run(out_dir: str, batch: int, gas: int, steps: int, rows: int, lora: bool = False) -> dict[str, Any]:
    """The reference: trl.DPOTrainer in one process."""
    common = {"shardtrain_config": None, "batch": batch, "gas": gas, "steps": steps, "rows": rows, "lora": lora}
    trainer = make_trl_trainer("dpo", out_dir, **common)
    return {"weights": trained_weights(trainer), "logs": trl_logs(trainer, DPO_METRICS)}


def shardtrain_dpo_run(out_dir: str, batch: int, gas: int, steps: int, rows: int, lora: bool = False) -> dict[str, Any]:
    """ShardtrainDPOTrainer at ZeRO-3 with a separate reference model; what this rank holds of the reference; the
    refusal of sync_ref_model at stage 3. ``lora``: with a LoRA adapter and no reference model instead."""
    import os

    from shardtrain.errors import ConfigError

    common = {"shardtrain_config": DS_CONFIG, "batch": batch, "gas": gas, "steps": steps, "rows": rows}
    trainer = make_trl_trainer("dpo", os.path.join(out_dir, "dpo"), lora=lora, **common)
    if lora:  # nothing to prepare: the reference is the model with its adapter disabled
        assert trainer.ref_model is None and trainer.shardtrain_frozen_models == []
        trainer.train()
        weights = trainer.shardtrain_engine.full_state_dict()
        trainer.shardtrain_engine.close()
        return {"logs": trl_logs(trainer, DPO_METRICS), "weights": weights}
    ((ref, units),) = trainer.shardtrain_frozen_models
    assert ref is trainer.ref_model
    trainer.train()
    weights = trainer.shardtrain_engine.full_state_dict()
    trainer.shardtrain_engine.close()
    reference = {
        "numel": sum(p.numel() for p in ref.parameters()),
        "held": sum(b.shard.numel() for u in units.units for b in u.buckets),
        "gathers": [u.gathers for u in units.units],
        "states": {u.state.value for u in units.units},
        "requires_grad": any(p.requires_grad for p in ref.parameters()),
    }
    # below stage 3 the reference model stays whole on every rank (DeepSpeed gives it stage 0), frozen, in eval mode
    stage2 = make_trl_trainer(
        "dpo",
        os.path.join(out_dir, "stage2"),
        **{**common, "shardtrain_config": ds_config(zero_optimization={"stage": 2})},
    )
    ((ref2, units2),) = stage2.shardtrain_frozen_models
    reference["stage2"] = {
        "units": units2,
        "types": {type(p).__name__ for p in ref2.parameters()},
        "requires_grad": any(p.requires_grad for p in ref2.parameters()),
        "training": ref2.training,
        "equal": all(
            torch.equal(a, b) for a, b in zip(ref2.state_dict().values(), tiny_llama(seed=1).state_dict().values())
        ),
    }
    try:
        make_trl_trainer("dpo", os.path.join(out_dir, "sync"), sync_ref_model=True, **common)
    except ConfigError as err:
        sync_refused = str(err)
    else:
        raise AssertionError("sync_ref_model=True at ZeRO-3 was not refused")
    return {
        "logs": trl_logs(trainer, DPO_METRICS),
        "weights": weights,
        "reference": reference,
        "sync_refused": sync_refused,
    }
