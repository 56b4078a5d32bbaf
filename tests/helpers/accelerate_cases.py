"""What tests/compat/test_accelerate.py runs on each rank: one plain accelerate loop with a ``DeepSpeedPlugin``, on
real DeepSpeed (CPU accelerator, gloo) or, after ``use_shardtrain_for_deepspeed()``, on shardtrain.

The loop is what accelerate's DeepSpeed examples write: ``prepare(model, optimizer, loader, scheduler)``, then per
batch ``with accelerator.accumulate(model)``, ``backward``, ``optimizer.step()``, ``scheduler.step()``,
``optimizer.zero_grad()``. Each rank's loader has 5 micro-batches an epoch, so with 2 micro-batches accumulated the
third step of each epoch has one (accelerate ends it at the end of the loader). After the first epoch
``save_state``; the second epoch goes on; then a fresh model from another seed ``load_state``s and trains the second
epoch again. ``get_state_dict`` gives the full weights at the end (rank 0).
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere in this process

import torch
import torch.nn.functional as F
from torch import nn

ROWS, MICRO, GAS, EPOCHS = 20, 2, 2, 2  # 10 rows a rank at world 2: 5 micro-batches an epoch, steps of 2, 2, 1
LR, WD, CLIP = 1e-2, 0.01, 0.5  # named in the configs: the comparison does not rest on either side's defaults

# How the loop gets its optimizer and scheduler, as accelerate's users write it:
#   torch_scheduler: torch's AdamW and a LambdaLR warm-up, which accelerate steps (AcceleratedScheduler);
#   deepspeed_scheduler: torch's AdamW and DeepSpeed's WarmupDecayLR (deepspeed.runtime.lr_schedules), which
#     accelerate hands to deepspeed.initialize: the engine steps it;
#   config_sections: accelerate's DummyOptim/DummyScheduler, the config's optimizer and scheduler sections with "auto"
#     values accelerate fills.
VARIANTS = ("torch_scheduler", "deepspeed_scheduler", "config_sections")


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inner = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inner(x)))))


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g))


def ds_config(stage: int, variant: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": "auto",
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
    }
    if variant == "config_sections":
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True},
        }
        config["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        }
    return config


def _parts(model: nn.Module, variant: str) -> tuple[Any, Any]:
    from accelerate.utils import DummyOptim, DummyScheduler

    if variant == "config_sections":
        optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=WD)
        return optimizer, DummyScheduler(optimizer, warmup_num_steps=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    if variant == "torch_scheduler":
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    from deepspeed.runtime.lr_schedules import WarmupDecayLR  # the shim's under shardtrain

    return optimizer, WarmupDecayLR(
        optimizer, warmup_min_lr=0.0, warmup_max_lr=LR, warmup_num_steps=2, total_num_steps=8, warmup_type="linear"
    )


def _accelerator(stage: int, variant: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    AcceleratorState._reset_state(reset_partial_state=False)  # a second Accelerator in this process: the resume
    GradientState._reset_state()
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(stage, variant))
    # gloo: on a machine without a GPU, accelerate joins torchrun's processes only with a backend named
    return Accelerator(
        deepspeed_plugin=plugin,
        gradient_accumulation_steps=GAS,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
    )


def _epoch(accelerator, model, optimizer, loader, scheduler) -> list[float]:
    losses = []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _prepared(stage: int, variant: str, seed: int):
    accelerator = _accelerator(stage, variant)
    model = Net(seed)
    optimizer, scheduler = _parts(model, variant)
    loader = torch.utils.data.DataLoader(_data(), batch_size=MICRO, shuffle=False)
    return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler)


def _lr(optimizer) -> float:
    return optimizer.param_groups[0]["lr"]


def run(on_shardtrain: bool, stages: list[int], variant: str, workdir: str) -> dict[int, dict[str, Any]]:
    """Per stage: losses of every micro-batch (this rank's), learning rates after each epoch, the weights at the end
    (rank 0, ``get_state_dict``), and the second epoch after ``load_state`` from a fresh model."""
    if on_shardtrain:
        from shardtrain.integrations.accelerate import use_shardtrain_for_deepspeed

        use_shardtrain_for_deepspeed()
    import deepspeed

    results = {}
    for stage in stages:
        save_dir = os.path.join(workdir, f"state-{stage}-{variant}")
        accelerator, model, optimizer, loader, scheduler = _prepared(stage, variant, seed=0)
        parts = (accelerator, model, optimizer, loader, scheduler)
        losses, lrs = _epoch(*parts), [_lr(optimizer)]
        accelerator.save_state(save_dir)
        losses += _epoch(*parts)
        lrs.append(_lr(optimizer))
        weights = accelerator.get_state_dict(model)
        engine_type = type(model).__module__ + "." + type(model).__name__
        model.destroy()

        accelerator, model, optimizer, loader, scheduler = _prepared(stage, variant, seed=1)
        accelerator.load_state(save_dir)
        resumed = _epoch(accelerator, model, optimizer, loader, scheduler)
        resumed_weights = accelerator.get_state_dict(model)
        results[stage] = {
            "losses": losses,
            "lrs": lrs,
            "resumed": resumed,
            "resumed_lr": _lr(optimizer),
            "weights": {k: v.float().clone() for k, v in weights.items()} if weights else None,
            "resumed_weights": {k: v.float().clone() for k, v in resumed_weights.items()} if resumed_weights else None,
            "engine": engine_type,
            "deepspeed": deepspeed.__name__,
            "num_processes": accelerator.num_processes,
        }
        model.destroy()
    return results


def trainer_without_use_cpu(out_dir: str) -> str:
    """The message ShardtrainTrainer gives under torchrun on a machine without a GPU when use_cpu=True is missing."""
    from transformers import TrainingArguments

    from shardtrain.errors import ConfigError
    from shardtrain.integrations.hf_trainer import ShardtrainTrainer

    from helpers.hf_trainer_cases import DS_CONFIG, TokenData, tiny_llama

    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=1, report_to="none")
    try:
        ShardtrainTrainer(tiny_llama(), args=args, train_dataset=TokenData(8), shardtrain_config=DS_CONFIG)
    except ConfigError as err:
        return str(err)
    return "nothing refused"


def accelerator_without_a_backend_on_cpu() -> str:
    """Under torchrun on a machine without a GPU, with no backend named (accelerate then counts one process where
    torchrun started the world; deepspeed.comm joined it): what the Accelerator's prepare says."""
    from shardtrain.integrations.accelerate import use_shardtrain_for_deepspeed

    use_shardtrain_for_deepspeed()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from shardtrain.errors import ConfigError

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(2, "torch_scheduler")))
    model = Net(0)
    optimizer, scheduler = _parts(model, "torch_scheduler")
    loader = torch.utils.data.DataLoader(_data(), batch_size=MICRO)
    try:
        accelerator.prepare(model, optimizer, loader, scheduler)
    except ConfigError as err:
        return str(err)
    return "nothing refused"
