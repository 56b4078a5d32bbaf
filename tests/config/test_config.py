"""Each class of config mistake gives an error naming the key path, the value and what is allowed."""

import json

import pytest
import torch

from shardtrain.config.sections import Config, ZeroConfig, load_config, resolve_batch_sizes
from shardtrain.errors import ConfigError


def test_loads_dict_json_yaml_and_object(tmp_path):
    data = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text(
        "train_batch_size: 8\nzero_optimization:\n  stage: 2\n  reduce_bucket_size: 5.0e+7\n"
    )
    loaded = [load_config(data), load_config(tmp_path / "c.json"), load_config(str(tmp_path / "c.yaml"))]
    for cfg in loaded:
        assert cfg.zero_optimization.stage == 2
        assert cfg.zero_optimization.reduce_bucket_size == 50_000_000  # 5e7 accepted as a whole number
        assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)
    obj = Config(zero_optimization=ZeroConfig(stage=1))
    assert load_config(obj) is obj


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"zero_optimization": {"stgae": 1}}, ["zero_optimization.stgae", "unknown key", "did you mean 'stage'"]),
        ({"train_batch_sise": 4}, ["train_batch_sise", "did you mean 'train_batch_size'"]),
        ({"zero_optimization": {"stage": 7}}, ["zero_optimization.stage", "0, 1, 2 or 3", "got 7"]),
        (
            {"zero_optimization": {"stage": 3, "stage3_unit_classes": "Block"}},
            ["zero_optimization.stage3_unit_classes", "valid list", "got 'Block'"],
        ),
        ({"gradient_clipping": "1.0"}, ["gradient_clipping", "valid number", "got '1.0'"]),
        ({"gradient_clipping": -1}, ["gradient_clipping", "greater than or equal to 0", "got -1"]),
        ({"train_batch_size": 1.5}, ["train_batch_size", "valid integer", "got 1.5"]),
        ({"train_batch_size": 0}, ["train_batch_size", "greater than or equal to 1"]),
        ({"zero_optimization": {"overlap_comm": "yes"}}, ["zero_optimization.overlap_comm", "got 'yes'"]),
        ({"zero_optimization": {"allgather_partitions": False}}, ["zero_optimization.allgather_partitions"]),
        ({"zero_optimization": 2}, ["zero_optimization", "got 2"]),
        ({"amp": {"enabled": True}}, ["amp: enabled: true is not supported", "`bf16` or `fp16`"]),
        ({"fp16": {"enabled": True, "loss_scale": -1}}, ["fp16.loss_scale", "greater than or equal to 0"]),
        ({"bf16": {"enabled": "yes"}}, ["bf16.enabled", "valid boolean", "got 'yes'"]),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "disk"}}},
            ["zero_optimization.offload_optimizer.device", "'none', 'cpu' or 'nvme'", "got 'disk'"],
        ),
        ({"optimizer": {"type": "Lamb"}}, ["optimizer.type", "'Lamb'", "Adam, AdamW, SGD"]),
        ({"optimizer": {"type": "AdamW", "params": {"lrr": 1}}}, ["optimizer.params.lrr", "did you mean 'lr'"]),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, ["optimizer.params", "Invalid learning rate"]),
        ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": 1}}}, ["optimizer.params.adam_w_mode"]),
        (
            {"scheduler": {"type": "CosineAnnealingLR"}},
            ["scheduler.type", "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"],
        ),
        (
            {"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1}}},
            ["scheduler.params.cycle_min_lr", "required"],
        ),
        ({"scheduler": {"type": "WarmupCosineLR", "params": {}}}, ["scheduler.params.total_num_steps", "required"]),
        (
            {"optimizer": {"type": "Adam", "params": {"bias_correction": "false"}}},
            ["optimizer.params.bias_correction: expected true or false", "got 'false'"],
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}, "gradient_clipping": 0.5},
            ["optimizer.params.max_grad_norm: refused, as DeepSpeed refuses it", "top-level `gradient_clipping`"],
        ),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, ["scheduler.params.total_num_steps", "required"]),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_typ": "log"}}}, ["scheduler.params.warmup_typ"]),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}}, ["'log' or 'linear'", "cos"]),
    ],
)
def test_config_mistakes_name_path_value_and_allowed(config, expected):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    for fragment in expected:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top"):
        load_config(listy)
    with pytest.raises(ConfigError, match="must be a dict"):
        load_config(42)


@pytest.mark.parametrize(
    ("keys", "dp", "expected"),
    [
        (
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
            2,
            (16, 2, 4),
        ),
        ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2}, 3, (12, 2, 2)),
        ({"train_batch_size": 12, "gradient_accumulation_steps": 2}, 3, (12, 2, 2)),
        ({"train_batch_size": 12}, 3, (12, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 2, (12, 3, 2)),
        ({}, 4, (4, 1, 1)),
    ],
)
def test_batch_sizes_resolve_like_deepspeed(keys, dp, expected):
    assert resolve_batch_sizes(load_config(keys), dp) == expected


@pytest.mark.parametrize(
    ("keys", "dp", "message"),
    [
        (
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
            3,
            "must equal train_micro_batch_size_per_gpu (2) x gradient_accumulation_steps (2) x data-parallel size (3)",
        ),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2}, 3, "not divisible"),
        ({"train_batch_size": 10, "gradient_accumulation_steps": 2}, 3, "not divisible"),
        ({"train_batch_size": 10}, 4, "not divisible by the data-parallel size (4)"),
    ],
)
def test_inconsistent_batch_sizes(keys, dp, message):
    with pytest.raises(ConfigError) as err:
        resolve_batch_sizes(load_config(keys), dp)
    assert message in str(err.value)


def test_fp16_auto_cast_casts_floating_tensors_as_deepspeed_does():
    from collections import namedtuple

    from shardtrain.config.sections import cast_inputs_half

    assert load_config({"fp16": {"enabled": True, "auto_cast": True}}).fp16.auto_cast is True
    Pair = namedtuple("Pair", "a b")
    ids, x = torch.arange(4), torch.randn(2, 3, dtype=torch.float64)
    out = cast_inputs_half((x, [ids, {"mask": torch.ones(2), "n": 3}], Pair(x, "s"), None))
    assert out[0].dtype == torch.float16 and torch.equal(out[0], x.half())
    assert out[1][0] is ids  # integers are left as they are
    assert out[1][1]["mask"].dtype == torch.float16 and out[1][1]["n"] == 3
    assert isinstance(out[2], Pair) and out[2].a.dtype == torch.float16 and out[2].b == "s"
    assert out[3] is None and isinstance(out, tuple) and isinstance(out[1], list)


def test_optimizer_keys_of_deepspeed_sections():
    from shardtrain.config.sections import optimizer_class_and_kwargs

    def built(params: dict, kind: str = "AdamW"):
        return optimizer_class_and_kwargs(load_config({"optimizer": {"type": kind, "params": params}}).optimizer)

    # DeepSpeed reads adam_w_mode for AdamW too, and ignores it there (accelerate's templates write it); its fused
    # Adam's weight_decay default, 0.0, is written in ([Note: DeepSpeed's defaults])
    assert built({"lr": 1e-3, "adam_w_mode": False}) == (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.0})
    assert built({"lr": 1e-3, "adam_w_mode": False}, "Adam") == (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.0})
    # bias_correction: true leaves the torch optimizer as it is; torch_adam: true keeps torch's defaults
    assert built({"lr": 1e-3, "torch_adam": False, "bias_correction": True}, "Adam") == (
        torch.optim.AdamW,
        {"lr": 1e-3, "weight_decay": 0.0},
    )
    assert built({"lr": 1e-3, "torch_adam": True}) == (torch.optim.AdamW, {"lr": 1e-3})
    assert built({"lr": 1e-3, "weight_decay": 0.1}) == (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1})
    assert built({"lr": 0.1}, "SGD") == (torch.optim.SGD, {"lr": 0.1})
    # DeepSpeed's engine refuses max_grad_norm among the optimizer's params (it clips with gradient_clipping)
    for given in ({}, {"gradient_clipping": 0.5}, {"gradient_clipping": "auto"}):
        with pytest.raises(ConfigError, match="max_grad_norm: refused, as DeepSpeed refuses it"):
            load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "max_grad_norm": 0.5}}, **given})
