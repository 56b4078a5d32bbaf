"""The names users import stay the ones they wrote before the package move, and each is the module that does the work
(one module object under both names: a second copy would hold its own registries, such as the engines
``GatheredParameters`` finds, and its own classes)."""

import importlib
import sys

import pytest


@pytest.mark.parametrize(
    ("public", "real"),
    [
        ("shardtrain.deepspeed", "shardtrain.compat.deepspeed"),
        ("shardtrain.deepspeed.zero", "shardtrain.compat.deepspeed.zero"),
        ("shardtrain.deepspeed.engine", "shardtrain.compat.deepspeed.engine"),
        ("shardtrain.deepspeed.unsupported", "shardtrain.compat.deepspeed.unsupported"),
        ("shardtrain.deepspeed.utils.zero_to_fp32", "shardtrain.compat.deepspeed.utils.zero_to_fp32"),
        ("shardtrain.deepspeed.checkpoint.utils", "shardtrain.compat.deepspeed.checkpoint.utils"),
        ("shardtrain.integrations.hf_trainer", "shardtrain.compat.hf_trainer"),
        ("shardtrain.integrations.trl_trainers", "shardtrain.compat.trl_trainers"),
        ("shardtrain.integrations.accelerate", "shardtrain.compat.accelerate"),
        ("shardtrain.deepspeed.runtime.lr_schedules", "shardtrain.compat.deepspeed.runtime.lr_schedules"),
    ],
)
def test_public_name_is_the_real_module(public, real):
    assert importlib.import_module(public) is importlib.import_module(real)
    assert sys.modules[public] is sys.modules[real]


def test_names_from_the_public_modules():
    import shardtrain
    import shardtrain.deepspeed as deepspeed
    from shardtrain.compat.deepspeed.zero import Init as RealInit
    from shardtrain.deepspeed.zero import GatheredParameters, Init
    from shardtrain.integrations.hf_trainer import ShardtrainTrainer

    assert Init is RealInit and deepspeed.zero.Init is RealInit and shardtrain.zero.Init is not None
    assert GatheredParameters is sys.modules["shardtrain.compat.deepspeed.zero"].GatheredParameters
    assert ShardtrainTrainer.__module__ == "shardtrain.compat.hf_trainer"
    assert shardtrain.initialize is shardtrain.engine.initialize
    assert shardtrain.config.Config is shardtrain.config.sections.Config
