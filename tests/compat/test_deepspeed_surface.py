"""The DeepSpeed API real scripts call (``shardtrain.compat.deepspeed.surface.SURFACE``): the table in
docs/migration-deepspeed.md is generated from it, every name listed as working is imported and called here (at
ZeRO-3 on two ranks), and every refused one raises ``NotProvidedError`` saying what to use."""

from __future__ import annotations

import argparse
import re
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardtrain.compat.deepspeed.surface import SURFACE, markdown_table, resolve, status
from shardtrain.testing import run_distributed

DOC = Path(__file__).parents[2] / "docs" / "migration-deepspeed.md"


def _init(c):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,  # save_16bit_model writes at stage 3 only with it
        },
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**6,
    }
    torch.manual_seed(0)
    c.model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    c.engine, c.optimizer, _, _ = c.ds.initialize(model=c.model, model_parameters=c.model.parameters(), config=config)
    return c.engine


def _zero3_state(c):
    state = c.engine._zero3_consolidated_16bit_state_dict()
    assert (state is None) == (c.rank != 0)
    return state is None or set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def _grads(c):
    full = c.ds.utils.safe_get_full_grad(c.model[2].weight)
    return full.shape == (2, 6) and full.dtype == torch.float32


def _gathered(c):
    with c.ds.zero.GatheredParameters(c.model[0].weight, modifier_rank=0):
        return c.model[0].weight.shape == (6, 4)


def _zero_init(c):
    with c.ds.zero.Init(enabled=False):
        return isinstance(nn.Linear(2, 2), nn.Module)


def _set_full(c, which: str):
    w = c.model[2].weight
    if which == "param":
        c.ds.utils.safe_set_full_fp32_param(w, torch.ones(2, 6))
        return torch.equal(c.ds.utils.safe_get_full_fp32_param(w), torch.ones(2, 6))
    c.ds.utils.safe_set_full_optimizer_state(w, torch.zeros(2, 6), "exp_avg")
    return torch.equal(c.ds.utils.safe_get_full_optimizer_state(w, "exp_avg"), torch.zeros(2, 6))


def _zero_to_fp32(c, which: str):
    from shardtrain.deepspeed.utils import zero_to_fp32

    if c.rank != 0:
        return True
    if which == "get":
        return set(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(c.tmp / "ckpt")) == {
            "0.weight", "0.bias", "2.weight", "2.bias"
        }  # fmt: skip
    if which == "convert":
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(c.tmp / "ckpt", c.tmp / "fp32")
        return (c.tmp / "fp32" / "pytorch_model.bin").is_file()
    fresh = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(fresh, c.tmp / "ckpt")
    return model[2].weight.dtype == torch.float32


def _scheduler(name: str, c) -> bool:
    """DeepSpeed's scheduler class by its name: built on an optimizer, it steps (its arguments: DeepSpeed's)."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    cls = getattr(c.ds.runtime.lr_schedules, name)
    kwargs = {"total_num_steps": 10} if name in ("WarmupDecayLR", "WarmupCosineLR") else {}
    if name == "OneCycle":
        kwargs = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}
    scheduler = cls(optimizer, **kwargs)
    scheduler.step()
    return type(scheduler).__name__ in c.ds.runtime.lr_schedules.VALID_LR_SCHEDULES


# Each name listed as working, called in this order (the engine is built first, destroyed last).
CALLS = {
    "deepspeed.__version__": lambda c: isinstance(c.ds.__version__, str),
    "deepspeed.add_config_arguments": lambda c: (
        c.ds.add_config_arguments(argparse.ArgumentParser())
        .parse_args(["--deepspeed", "--deepspeed_config", "x.json"])
        .deepspeed_config
        == "x.json"
    ),
    "deepspeed.init_distributed": lambda c: c.ds.init_distributed() is None,
    "deepspeed.comm.init_distributed": lambda c: c.ds.comm.init_distributed(dist_backend="gloo") is None,
    "deepspeed.comm.is_initialized": lambda c: c.ds.comm.is_initialized(),
    "deepspeed.comm.get_rank": lambda c: c.ds.comm.get_rank() == c.rank,
    "deepspeed.comm.get_world_size": lambda c: c.ds.comm.get_world_size() == 2,
    "deepspeed.comm.get_local_rank": lambda c: c.ds.comm.get_local_rank() == c.rank,
    "deepspeed.comm.barrier": lambda c: c.ds.comm.barrier() is None,
    "deepspeed.comm.new_group": lambda c: c.ds.comm.new_group([0, 1]) is not None,
    "deepspeed.comm.broadcast": lambda c: c.ds.comm.broadcast(torch.zeros(1), 0) is None,
    "deepspeed.comm.all_reduce": lambda c: c.ds.comm.all_reduce(torch.ones(1)) is None,
    "deepspeed.comm.reduce": lambda c: c.ds.comm.reduce(torch.ones(1), 0) is None,
    "deepspeed.comm.gather": lambda c: (
        c.ds.comm.gather(torch.ones(1), [torch.zeros(1), torch.zeros(1)] if c.rank == 0 else None, 0) is None
    ),
    "deepspeed.get_accelerator": lambda c: c.ds.get_accelerator() is c.ds.accelerator.get_accelerator(),
    "deepspeed.accelerator.get_accelerator": lambda c: c.ds.accelerator.get_accelerator().device_name() == "cpu",
    "get_accelerator().device_name": lambda c: c.ds.get_accelerator().device_name(0) == "cpu",
    "get_accelerator().current_device_name": lambda c: c.ds.get_accelerator().current_device_name() == "cpu",
    "get_accelerator().set_device": lambda c: c.ds.get_accelerator().set_device(0) is None,
    "get_accelerator().device_count": lambda c: c.ds.get_accelerator().device_count() == 1,
    "get_accelerator().is_available": lambda c: c.ds.get_accelerator().is_available(),
    "get_accelerator().memory_allocated": lambda c: c.ds.get_accelerator().memory_allocated() >= 0,
    "get_accelerator().max_memory_allocated": lambda c: c.ds.get_accelerator().max_memory_allocated() >= 0,
    "get_accelerator().memory_reserved": lambda c: c.ds.get_accelerator().memory_reserved() >= 0,
    "get_accelerator().max_memory_reserved": lambda c: c.ds.get_accelerator().max_memory_reserved() >= 0,
    "get_accelerator().reset_peak_memory_stats": lambda c: c.ds.get_accelerator().reset_peak_memory_stats() is None,
    "deepspeed.zero.Init": _zero_init,
    # a PipelineModule's own engine is tested in tests/compat/test_deepspeed_pipe.py; here: the names import
    "deepspeed.pipe": lambda c: c.ds.pipe.PipelineModule is c.ds.PipelineModule and callable(c.ds.pipe.LayerSpec),
    "deepspeed.zero.register_external_parameter": lambda c: (
        c.ds.zero.register_external_parameter(nn.Linear(1, 1), nn.Parameter(torch.zeros(1))) is None
    ),
    "deepspeed.utils.logger": lambda c: c.ds.utils.logger.isEnabledFor(40),
    "deepspeed.utils.RepeatingLoader": lambda c: (
        [x for _, x in zip(range(3), c.ds.utils.RepeatingLoader([7]))] == [7, 7, 7]
    ),
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save": lambda c: torch.equal(
        c.ds.checkpoint.utils.clone_tensors_for_torch_save({"a": torch.ones(2)})["a"], torch.ones(2)
    ),
    "deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES": lambda c: (
        c.ds.runtime.lr_schedules.VALID_LR_SCHEDULES
        == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    ),
    **{
        f"deepspeed.runtime.lr_schedules.{name}": partial(_scheduler, name)
        for name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
    },
    "deepspeed.initialize": _init,
    "deepspeed.DeepSpeedEngine": lambda c: isinstance(c.engine, c.ds.DeepSpeedEngine),
    "engine.train": lambda c: c.engine.train() is c.engine,
    "engine.module": lambda c: c.engine.module is c.model,
    "engine.optimizer": lambda c: c.engine.optimizer is c.optimizer,
    "engine.lr_scheduler": lambda c: c.engine.lr_scheduler is None,
    "engine.config": lambda c: c.engine.config["bf16"] == {"enabled": True},
    "engine.device": lambda c: c.engine.device == torch.device("cpu"),
    "engine.local_rank": lambda c: c.engine.local_rank == c.rank,
    "engine.is_gradient_accumulation_boundary": lambda c: c.engine.is_gradient_accumulation_boundary(),
    "engine.set_gradient_accumulation_boundary": lambda c: c.engine.set_gradient_accumulation_boundary(True) is None,
    "engine.forward": lambda c: (
        setattr(c, "loss", c.engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().square().mean()) is None
    ),
    "engine.backward": lambda c: c.engine.backward(c.loss) is c.loss,
    "deepspeed.utils.safe_get_full_grad": _grads,
    "engine.step": lambda c: c.engine.step() is None,
    "engine.was_step_applied": lambda c: c.engine.was_step_applied(),
    "engine.global_steps": lambda c: c.engine.global_steps == 1,
    "engine.get_global_grad_norm": lambda c: c.engine.get_global_grad_norm() > 0,
    "engine.get_lr": lambda c: c.engine.get_lr() == [1e-2],
    "engine.zero_grad": lambda c: c.engine.zero_grad() is None,
    "engine.gradient_accumulation_steps": lambda c: c.engine.gradient_accumulation_steps() == 1,
    "engine.train_micro_batch_size_per_gpu": lambda c: c.engine.train_micro_batch_size_per_gpu() == 2,
    "engine.train_batch_size": lambda c: c.engine.train_batch_size() == 4,
    "engine.fp16_enabled": lambda c: c.engine.fp16_enabled() is False,
    "engine.bfloat16_enabled": lambda c: c.engine.bfloat16_enabled() is True,
    "engine.zero_optimization": lambda c: c.engine.zero_optimization() is True,
    "engine.zero_optimization_stage": lambda c: c.engine.zero_optimization_stage() == 3,
    "engine.loss_scale": lambda c: c.engine.loss_scale() == 0.0,
    "engine.wall_clock_breakdown": lambda c: c.engine.wall_clock_breakdown() is False,
    "deepspeed.utils.safe_get_full_fp32_param": lambda c: (
        c.ds.utils.safe_get_full_fp32_param(c.model[0].weight).shape == (6, 4)
    ),
    "deepspeed.utils.safe_get_full_optimizer_state": lambda c: (
        c.ds.utils.safe_get_full_optimizer_state(c.model[0].weight, "exp_avg_sq").shape == (6, 4)
    ),
    "deepspeed.utils.safe_set_full_fp32_param": lambda c: _set_full(c, "param"),
    "deepspeed.utils.safe_set_full_optimizer_state": lambda c: _set_full(c, "state"),
    "deepspeed.zero.GatheredParameters": _gathered,
    "engine.eval": lambda c: c.engine.eval() is c.engine,
    "engine.zero_gather_16bit_weights_on_model_save": lambda c: c.engine.zero_gather_16bit_weights_on_model_save(),
    "engine._zero3_consolidated_16bit_state_dict": _zero3_state,
    "engine.save_16bit_model": lambda c: c.engine.save_16bit_model(c.tmp / "weights"),
    "engine.save_checkpoint": lambda c: c.engine.save_checkpoint(c.tmp / "ckpt", client_state={"k": 1}),
    "engine.load_checkpoint": lambda c: c.engine.load_checkpoint(c.tmp / "ckpt")[1] == {"k": 1},
    "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint": lambda c: _zero_to_fp32(c, "get"),
    "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict": lambda c: _zero_to_fp32(c, "convert"),
    "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint": lambda c: _zero_to_fp32(c, "load"),
    "engine.destroy": lambda c: c.engine.destroy() is None,
}


def _call_all(workdir: str) -> dict[str, bool]:
    import torch.distributed as dist

    import shardtrain.deepspeed as deepspeed

    c = SimpleNamespace(ds=deepspeed, rank=dist.get_rank(), tmp=Path(workdir))
    results = {}
    for name, call in CALLS.items():
        results[name] = bool(call(c))
        dist.barrier()  # rank 0's file checks see the files every rank wrote
    return results


def test_docs_table_is_generated_from_the_list():
    doc = DOC.read_text()
    table = re.search(r"<!-- api-surface:start -->\n(.*?)\n<!-- api-surface:end -->", doc, re.S)
    assert table is not None, "docs/migration-deepspeed.md lost its api-surface markers"
    assert table.group(1) == markdown_table(), "regenerate with: python -m shardtrain.compat.deepspeed.surface"
    working = sum(status(row.name) is None for row in SURFACE)
    counts = f"{len(SURFACE)} names, {working} work with DeepSpeed's meaning, {len(SURFACE) - working} are refused"
    assert counts in " ".join(doc.split()), f"the counts above the table should read: {counts}"


def test_list_has_each_name_once_and_every_working_name_is_called():
    names = [row.name for row in SURFACE]
    assert len(names) == len(set(names))
    working = {n for n in names if status(n) is None}
    assert working == set(CALLS), working ^ set(CALLS)


@pytest.mark.parametrize("name", [row.name for row in SURFACE if status(row.name) is not None])
def test_refused_names_say_what_to_use(name):
    import shardtrain.deepspeed as deepspeed

    with pytest.raises(deepspeed.NotProvidedError) as refused:
        resolve(name)
    assert "migration-deepspeed.md" in str(refused.value)
    assert refused.value.instead, f"{name} is refused without saying what to use instead"


@pytest.mark.parametrize(
    ("statement", "instead"),
    [
        ("from shardtrain.deepspeed.ops.adam import DeepSpeedCPUAdam", "fused kernels"),
        ("from shardtrain.deepspeed.utils import groups", "topology"),
        ("from shardtrain.deepspeed import DeepSpeedConfig", "load_config"),
        ("from shardtrain.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus", "GatheredParameters"),
        ("import shardtrain.deepspeed.moe", "expert_parallel_size"),
    ],
)
def test_importing_a_refused_name_says_what_to_use(statement, instead):
    """Python's own messages ("No module named", "cannot import name") would drop the hint: an ImportError that keeps
    it, so that `except ImportError` fallbacks in scripts still work."""
    with pytest.raises(ModuleNotFoundError, match=r"is not provided by shardtrain\.deepspeed") as refused:
        exec(statement)
    assert instead in str(refused.value)
    exec("from shardtrain.deepspeed.utils import logger, zero_to_fp32")  # real names import as before


def test_every_working_name_is_called_at_zero3(tmp_path):
    results = run_distributed(_call_all, 2, str(tmp_path))
    for rank, r in enumerate(results):
        failed = [name for name, ok in r.items() if not ok]
        assert not failed, (rank, failed)
