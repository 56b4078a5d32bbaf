"""\"auto\" values are resolved at initialize as Hugging Face's Trainer resolves them, or name what to give."""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardtrain.config.auto import resolve_auto
from shardtrain.config.sections import load_config
from shardtrain.errors import ConfigError
from shardtrain.testing import run_distributed

CORPUS = Path(__file__).parents[1] / "data" / "ds_configs"
BATCH_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


def _model(**config) -> nn.Module:
    m = nn.Linear(2, 2)
    m.config = SimpleNamespace(**config)
    return m


@pytest.mark.parametrize(
    ("keys", "values", "dp", "expected"),
    [
        (
            {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
            {},
            4,
            (24, 2, 3),
        ),
        (
            {"train_batch_size": 24, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 3},
            {},
            4,
            (24, 2, 3),
        ),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4}, {}, 2, (8, 4, None)),
        (BATCH_AUTO, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 3, (12, 2, 2)),
    ],
)
def test_batch_sizes_from_the_others_and_the_world_size(keys, values, dp, expected):
    cfg = resolve_auto(load_config(keys), dp=dp, auto_values=values)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_batch_sizes_not_derivable_name_what_to_give():
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        resolve_auto(load_config(BATCH_AUTO), dp=2)
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_auto(load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": "auto"}), dp=4)


def test_bucket_sizes_from_the_hidden_size():
    zero3 = {
        "zero_optimization": {
            "stage": 3,
            **dict.fromkeys(
                ["reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"], "auto"
            ),
        }
    }
    from transformers import GPT2Config

    hf = nn.Linear(2, 2)
    hf.config = GPT2Config(n_embd=64)  # an HF config: hidden_size maps to n_embd
    z = resolve_auto(load_config(zero3), dp=1, model=hf).zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        4096,
        int(0.9 * 4096),
        640,
    )
    z = resolve_auto(load_config(zero3), dp=1, model=_model(hidden_sizes=[8, 32, 16])).zero_optimization
    assert z.reduce_bucket_size == 1024
    z = resolve_auto(load_config(zero3), dp=1, model=nn.Linear(2, 2), auto_values={"hidden_size": 10}).zero_optimization
    assert z.stage3_param_persistence_threshold == 100
    with pytest.raises(ConfigError, match=r"hidden size.*auto_values=\{'hidden_size'"):
        resolve_auto(load_config(zero3), dp=1, model=nn.Linear(2, 2))


def test_stage3_autos_below_stage_3_take_defaults_without_a_hidden_size():
    cfg = load_config({"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto"}})
    z = resolve_auto(cfg, dp=1, model=nn.Linear(2, 2)).zero_optimization
    assert z.stage3_prefetch_bucket_size == 50_000_000


def test_clipping_optimizer_scheduler_and_precision_from_auto_values():
    cfg = load_config(
        {
            "gradient_clipping": "auto",
            "fp16": {"enabled": "auto"},
            "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": 0.1}},
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "total_num_steps": "auto"},
            },
        }
    )
    values = {"gradient_clipping": 0.5, "lr": 3e-4, "betas": (0.9, 0.95), "total_num_steps": 100, "precision": "bf16"}
    r = resolve_auto(cfg, dp=1, auto_values=values)
    assert r.gradient_clipping == 0.5 and r.bf16.enabled is True and r.fp16.enabled is False
    assert r.optimizer.params == {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
    assert r.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "total_num_steps": 100}
    no_precision = resolve_auto(load_config({"fp16": {"enabled": "auto"}}), dp=1)
    assert no_precision.fp16.enabled is False  # as the Trainer without --fp16
    with pytest.raises(ConfigError, match=r"gradient_clipping: \"auto\".*auto_values=\{'gradient_clipping'"):
        resolve_auto(load_config({"gradient_clipping": "auto"}), dp=1)
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr.*auto_values=\{'lr'"):
        resolve_auto(load_config({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}), dp=1)
    with pytest.raises(ConfigError, match=r"says 0\.1 but"):
        resolve_auto(load_config({"gradient_clipping": 0.1}), dp=1, auto_values={"gradient_clipping": 1.0})
    with pytest.raises(ConfigError, match="did you mean 'lr'"):
        resolve_auto(load_config({}), dp=1, auto_values={"lrr": 1.0})


def _initialize_real_configs() -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    import shardtrain

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("shardtrain").addHandler(handler)
    logging.getLogger("shardtrain").setLevel(logging.INFO)
    out = {}
    x = torch.randint(0, 64, (2, 8))
    # transformers' own test config (its CPU offload section removed: this test is about "auto" values)
    zero2 = json.loads((CORPUS / "transformers__ds_config_zero2.json").read_text())
    del zero2["zero_optimization"]["offload_optimizer"]
    # LLaVA's stage-3 config: bucket sizes "auto" from the model's hidden size
    for name, config in (("zero2", zero2), ("zero3", CORPUS / "llava__zero3.json")):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16))
        values = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
        optimizer = None
        if name == "zero2":
            values |= {
                "gradient_clipping": 1.0,
                "lr": 1e-3,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
                "weight_decay": 0.0,
                "warmup_num_steps": 5,
            }
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = shardtrain.initialize(model, config=config, optimizer=optimizer, auto_values=values)
        loss = engine(x, labels=x).loss
        engine.backward(loss)
        engine.step()
        z = engine.config.zero_optimization
        out[name] = {
            "batch": (engine.config.train_batch_size, engine.train_batch_size),
            "sizes": (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold),
            "loss": float(loss),
            "dump": engine.config.model_dump_json(),
        }
    out["logged"] = [r.getMessage() for r in records if r.getMessage().startswith("shardtrain config:")]
    return out


def test_initialize_with_real_hf_configs_at_world_1():
    (r,) = run_distributed(_initialize_real_configs, 1)
    assert r["zero2"]["batch"] == (2, 2)
    assert r["zero2"]["sizes"][0] == 200_000_000  # a number in the file
    assert r["zero3"]["sizes"] == (32 * 32, int(0.9 * 32 * 32), 320)  # hidden size 32
    for name in ("zero2", "zero3"):
        assert '"auto"' not in r[name]["dump"]  # no value left "auto" (key names such as autotp_size may say it)
        assert r[name]["loss"] == pytest.approx(r[name]["loss"])  # finite
    assert len(r["logged"]) == 2 and '"stage":3' in r["logged"][1]
