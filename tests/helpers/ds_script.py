"""A training script written against DeepSpeed's API only; ``run(module_name, ...)`` imports ``deepspeed`` or
``shardtrain.deepspeed`` under the name ``deepspeed`` and runs it unchanged (tests/compat/test_deepspeed_shim.py runs it
both ways, on 2 or 3 ranks).

Per ZeRO stage it: builds the model (under ``zero.Init`` at stage 3), changes one weight at the last rank inside
``GatheredParameters(modifier_rank=last)``, calls ``initialize`` with two param groups, the config's optimizer and
scheduler and a dataset, trains 12 micro-steps (saving a checkpoint after the 8th), gathers the parameters, then
builds everything again, resumes from the checkpoint and trains the last 4 micro-steps again. It returns what a
person would compare: every micro-step's loss and learning rates, counters, and the gathered parameters.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

MICRO_STEPS, SAVE_AFTER = 12, 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return nn.functional.mse_loss(self.head(h), y)


class Points(Dataset):
    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 6, generator=g)
        self.y = torch.randn(n, 3, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def config_for(stage: int) -> dict:
    """Each stage another optimizer / scheduler pair, so that the four runs cover what DeepSpeed builds."""
    optimizer = {
        0: {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True, "adam_w_mode": False}},
        1: {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.8, 0.99], "weight_decay": 0.1, "torch_adam": True}},
        2: {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.1, "torch_adam": True}},
        3: {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1, "torch_adam": True}},
    }[stage]
    scheduler = {
        0: {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_num_steps": 4}},
        1: {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_max_lr": 0.03, "warmup_num_steps": 3}},
        2: {"type": "OneCycle", "params": {"cycle_min_lr": 0.005, "cycle_max_lr": 0.03, "cycle_first_step_size": 2}},
        3: {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2}},
    }[stage]
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }


def _build(deepspeed, args, stage: int, config_path: str):
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config_path, enabled=stage == 3):
        model = Net()
    last = dist.get_world_size() - 1
    # the canonical use: change a weight at one rank before training (at stage 3 the change reaches every rank's
    # shard; at stages 0-2 nothing is gathered and initialize broadcasts rank 0's model, so it is dropped)
    with deepspeed.zero.GatheredParameters(model.fc1.weight, modifier_rank=last):
        if dist.get_rank() == last:
            with torch.no_grad():
                model.fc1.weight.mul_(1.5)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return deepspeed.initialize(args=args, model=model, model_parameters=groups, training_data=Points())


def _train(deepspeed, engine, loader, first: int, last: int, save_dir: str | None) -> dict:
    out = {"loss": [], "lr": [], "boundary": [], "global_steps": [], "global_samples": [], "grad_norm": []}
    for i, (x, y) in enumerate(loader):
        if i < first:
            continue
        if i == last:
            break
        x, y = x.to(engine.device), y.to(engine.device)
        loss = engine(x, y)
        engine.backward(loss)
        out["lr"].append(engine.get_lr())
        out["boundary"].append(engine.is_gradient_accumulation_boundary())
        engine.step()
        out["loss"].append(loss.item())
        out["global_steps"].append(engine.global_steps)
        out["global_samples"].append(engine.global_samples)
        norm = engine.get_global_grad_norm()
        out["grad_norm"].append(None if norm is None else float(norm))
        if save_dir is not None and i + 1 == SAVE_AFTER:
            engine.save_checkpoint(save_dir, client_state={"seen": i + 1})
    out["lr_after"] = engine.get_lr()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        out["params"] = {n: p.detach().clone().cpu() for n, p in engine.module.named_parameters()}
    return out


def run(module_name: str, stages: list[int], workdir: str) -> dict:
    """Every rank: the script at each of ``stages``; returns per stage the first run and the resumed one."""
    deepspeed = importlib.import_module(module_name)
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for stage in stages:
        base = Path(workdir) / module_name / f"stage{stage}"
        base.mkdir(parents=True, exist_ok=True)
        config_path = str(base / "ds_config.json")
        if dist.get_rank() == 0:
            Path(config_path).write_text(json.dumps(config_for(stage)))
        dist.barrier()
        args = parser.parse_args(["--deepspeed", "--deepspeed_config", config_path])
        engine, optimizer, loader, scheduler = _build(deepspeed, args, stage, config_path)
        first = _train(deepspeed, engine, loader, 0, MICRO_STEPS, str(base / "ckpt"))
        first["sizes"] = (
            engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        )  # fmt: skip
        first["optimizer_lrs"] = [g["lr"] for g in optimizer.param_groups]
        first["scheduler_lrs"] = scheduler.get_last_lr()
        engine, optimizer, loader, scheduler = _build(deepspeed, args, stage, config_path)
        path, client_state = engine.load_checkpoint(str(base / "ckpt"))
        resumed = _train(deepspeed, engine, loader, SAVE_AFTER, MICRO_STEPS, None)
        resumed["client_state"] = client_state
        resumed["path"] = None if path is None else os.path.relpath(os.path.dirname(path) if path.endswith(".pt")
                                                                    else path, base)  # fmt: skip
        missing = engine.load_checkpoint(str(base / "no-such-dir"))
        resumed["missing"] = missing
        results[stage] = {"first": first, "resumed": resumed}
    return results


def run_in_test_worker(module_names: list[str], stages: list[int], workdir: str) -> dict:
    """:func:`run` with each module in turn, in one process of ``shardtrain.testing.run_distributed`` (one start of
    the processes for both). Those processes are daemonic, and DeepSpeed's data loader starts two worker processes,
    which a daemonic process may not: the flag is lifted (the harness still kills the process at the end). The
    workers are forked: the harness's forkserver would spend seconds importing for each."""
    import multiprocessing

    multiprocessing.current_process()._config["daemon"] = False
    multiprocessing.set_start_method("fork", force=True)
    return {name: run(name, stages, workdir) for name in module_names}
