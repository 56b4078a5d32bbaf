"""Every default that changes numbers or files, against DeepSpeed 0.19.8's own config objects ([Note: DeepSpeed's
defaults] in shardtrain/config/deepspeed_keys.py): a key a config leaves out means here what it means there."""

from __future__ import annotations

import inspect
import os
from typing import Any
from unittest import mock

import pytest
import torch

from shardtrain.config.plan import precision_policy
from shardtrain.config.sections import load_config, optimizer_class_and_kwargs

os.environ.setdefault("DS_ACCELERATOR", "cpu")


class _World:
    """``deepspeed.comm`` inside ``DeepSpeedConfig``: rank 0 of two ranks, no process group."""

    def get_rank(self, group: Any = None) -> int:
        return 0

    def get_world_size(self, group: Any = None) -> int:
        return 2


def _deepspeed(config: dict) -> Any:
    import deepspeed.runtime.config as ds_config

    with mock.patch.object(ds_config, "dist", _World()):
        return ds_config.DeepSpeedConfig({"train_batch_size": 2, **config})


def _ours(config: dict) -> Any:
    return load_config({"train_batch_size": 2, **config})


# (our value, DeepSpeed's value) of a config that leaves the key out
SCALARS = {
    "gradient_clipping": (lambda c: c.gradient_clipping, lambda d: d.gradient_clipping),
    "steps_per_print": (lambda c: c.steps_per_print, lambda d: d.steps_per_print),
    "prescale_gradients": (lambda c: c.prescale_gradients, lambda d: d.prescale_gradients),
    "gradient_predivide_factor": (lambda c: c.gradient_predivide_factor, lambda d: d.gradient_predivide_factor),
    "wall_clock_breakdown": (lambda c: c.wall_clock_breakdown, lambda d: d.wall_clock_breakdown),
    "bf16.check_grad_overflow": (lambda c: c.bf16.check_grad_overflow, lambda d: d.bfloat16_config.check_grad_overflow),
    "fp16.loss_scale": (lambda c: c.fp16.loss_scale, lambda d: d.float16_config.loss_scale),
    "fp16.initial_scale_power": (lambda c: c.fp16.initial_scale_power, lambda d: d.float16_config.initial_scale_power),
    "fp16.loss_scale_window": (lambda c: c.fp16.loss_scale_window, lambda d: d.float16_config.loss_scale_window),
    "fp16.hysteresis": (lambda c: c.fp16.hysteresis, lambda d: d.float16_config.hysteresis),
    "fp16.min_loss_scale": (lambda c: c.fp16.min_loss_scale, lambda d: d.float16_config.min_loss_scale),
    "fp16.auto_cast": (lambda c: c.fp16.auto_cast, lambda d: d.float16_config.auto_cast),
    "zero_optimization.stage": (lambda c: c.zero_optimization.stage, lambda d: d.zero_config.stage),
    "zero_optimization.reduce_bucket_size": (
        lambda c: c.zero_optimization.reduce_bucket_size,
        lambda d: d.zero_config.reduce_bucket_size,
    ),
    "zero_optimization.allgather_bucket_size": (
        lambda c: c.zero_optimization.allgather_bucket_size,
        lambda d: d.zero_config.allgather_bucket_size,
    ),
    "zero_optimization.stage3_param_persistence_threshold": (
        lambda c: c.zero_optimization.stage3_param_persistence_threshold,
        lambda d: d.zero_config.param_persistence_threshold,
    ),
    "zero_optimization.stage3_prefetch_bucket_size": (
        lambda c: c.zero_optimization.stage3_prefetch_bucket_size,
        lambda d: d.zero_config.prefetch_bucket_size,
    ),
    "zero_optimization.sub_group_size": (
        lambda c: c.zero_optimization.sub_group_size,
        lambda d: d.zero_config.sub_group_size,
    ),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        lambda c: c.zero_optimization.stage3_gather_16bit_weights_on_model_save,
        lambda d: d.zero_config.gather_16bit_weights_on_model_save,
    ),
    "zero_optimization.zero_hpz_partition_size": (
        lambda c: c.zero_optimization.zero_hpz_partition_size,
        lambda d: d.zero_config.zero_hpz_partition_size,
    ),
    "tensorboard.output_path": (
        lambda c: c.tensorboard.output_path,
        lambda d: d.monitor_config.tensorboard.output_path,
    ),
    "tensorboard.job_name": (lambda c: c.tensorboard.job_name, lambda d: d.monitor_config.tensorboard.job_name),
    "csv_monitor.output_path": (
        lambda c: c.csv_monitor.output_path,
        lambda d: d.monitor_config.csv_monitor.output_path,
    ),
    "csv_monitor.job_name": (lambda c: c.csv_monitor.job_name, lambda d: d.monitor_config.csv_monitor.job_name),
    "wandb.project": (lambda c: c.wandb.project, lambda d: d.monitor_config.wandb.project),
    "flops_profiler.profile_step": (
        lambda c: c.flops_profiler.profile_step,
        lambda d: d.flops_profiler_config.profile_step,
    ),
    "flops_profiler.module_depth": (
        lambda c: c.flops_profiler.module_depth,
        lambda d: d.flops_profiler_config.module_depth,
    ),
    "flops_profiler.detailed": (lambda c: c.flops_profiler.detailed, lambda d: d.flops_profiler_config.detailed),
}


@pytest.mark.parametrize("key", sorted(SCALARS))
def test_default_is_deepspeeds(key):
    ours, theirs = SCALARS[key]
    assert ours(_ours({})) == theirs(_deepspeed({})), key


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_defaults_are_deepspeeds(device):
    zero = {"stage": 2, "offload_optimizer": {"device": device, "nvme_path": "/tmp"}}
    ours = _ours({"zero_optimization": zero}).zero_optimization.offload_optimizer
    theirs = _deepspeed({"zero_optimization": zero}).zero_config.offload_optimizer
    assert (ours.pin_memory, ours.buffer_count, ours.ratio) == (theirs.pin_memory, theirs.buffer_count, theirs.ratio)
    zero = {"stage": 3, "offload_param": {"device": device, "nvme_path": "/tmp"}}
    ours = _ours({"zero_optimization": zero}).zero_optimization.offload_param
    theirs = _deepspeed({"zero_optimization": zero}).zero_config.offload_param
    assert (ours.pin_memory, ours.buffer_count) == (theirs.pin_memory, theirs.buffer_count)


def test_flops_profiler_turns_the_wall_clock_breakdown_on_as_in_deepspeed():
    from shardtrain.engine.monitor import TrainingMonitor

    config = {"flops_profiler": {"enabled": True}}
    assert _deepspeed(config).wall_clock_breakdown is True
    assert TrainingMonitor(_ours(config), 0, torch.device("cpu"), 1).breakdown is True


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16), (None, None)])
def test_reduction_and_accumulation_dtypes_are_the_models_as_in_deepspeed(precision, dtype):
    """DeepSpeed reduces in ``communication_data_type`` (None: the gradients' own dtype, the model's) and accumulates
    in ``grad_accum_dtype`` (None: the model's dtype, ``DeepSpeedEngine.get_data_types``)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    config = {precision: {"enabled": True}} if precision else {}
    theirs = _deepspeed(config)
    assert theirs.communication_data_type is None and theirs.grad_accum_dtype is None
    stand_in = mock.Mock(_config=theirs)
    stand_in.fp16_enabled.return_value = precision == "fp16"
    stand_in.bfloat16_enabled.return_value = precision == "bf16"
    model_dtype, accum_dtype = DeepSpeedEngine.get_data_types(stand_in)
    policy = precision_policy(_ours(config))
    assert policy.compute_dtype == model_dtype == (dtype or torch.float32)
    assert policy.accum_dtype == accum_dtype
    assert policy.reduce_dtype == model_dtype  # None there: each gradient's dtype, the model's
    # shardtrain's exact choice, by name
    exact = precision_policy(
        _ours({**config, "communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}})
    )
    assert exact.reduce_dtype == exact.accum_dtype == torch.float32


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_adam_weight_decay_is_deepspeeds_fused_and_cpu_adams(kind):
    """Without ``weight_decay`` DeepSpeed builds its FusedAdam (CPUAdam with offload); with ``torch_adam: true``,
    torch's class with its own default."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    fused = inspect.signature(FusedAdam).parameters
    cpu = inspect.signature(DeepSpeedCPUAdam).parameters
    _, kwargs = optimizer_class_and_kwargs(_ours({"optimizer": {"type": kind, "params": {"lr": 1e-3}}}).optimizer)
    assert kwargs["weight_decay"] == fused["weight_decay"].default == cpu["weight_decay"].default == 0.0
    cls, kwargs = optimizer_class_and_kwargs(
        _ours({"optimizer": {"type": kind, "params": {"lr": 1e-3, "torch_adam": True}}}).optimizer
    )
    assert "weight_decay" not in kwargs  # torch's own default (0.01 for AdamW), as DeepSpeed's torch_adam path
    for name in ("betas", "eps"):
        assert inspect.signature(cls).parameters[name].default == fused[name].default


def test_what_deepspeed_refuses_is_refused():
    """DeepSpeed's engine refuses ``max_grad_norm`` among the optimizer's params, and its parser a dynamic fp16
    scale's floor at 0; both are refused here, with DeepSpeed's reason."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from shardtrain.errors import ConfigError

    stand_in = mock.Mock()
    stand_in.optimizer_params.return_value = {"lr": 1e-3, "max_grad_norm": 1.0}
    with pytest.raises(ValueError, match="max_grad_norm"):
        DeepSpeedEngine._configure_basic_optimizer(stand_in, [])
    with pytest.raises(ConfigError, match="max_grad_norm: refused, as DeepSpeed refuses it"):
        _ours({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}})
    fp16 = {"fp16": {"enabled": True, "loss_scale": 0, "min_loss_scale": 0}}
    with pytest.raises(Exception, match="min_loss_scale"):
        _deepspeed(fp16)
    with pytest.raises(ConfigError, match="min_loss_scale 0 with dynamic loss scaling"):
        _ours(fp16)


def test_no_batch_size_is_refused_by_the_deepspeed_shim_as_by_deepspeed():
    import shardtrain.compat.deepspeed as deepspeed
    from shardtrain.errors import ConfigError

    with pytest.raises(AssertionError, match="train_batch_size or train_micro_batch_size_per_gpu"):
        import deepspeed.runtime.config as ds_config

        with mock.patch.object(ds_config, "dist", _World()):
            ds_config.DeepSpeedConfig({})
    with pytest.raises(ConfigError, match="neither train_batch_size nor train_micro_batch_size_per_gpu"):
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config={"optimizer": {"type": "SGD", "params": {"lr": 1}}})
