"""A DeepSpeed config that names almost nothing, trained by real DeepSpeed and by ``shardtrain.compat.deepspeed``.

:func:`train_each` runs, on every rank of ``run_distributed``, the same loop under each module named (``"deepspeed"``
first, then ``"shardtrain.compat.deepspeed"``, in the same processes) at each ZeRO stage: :class:`helpers.ds.DSNet`,
its batches, and a config that names only the micro-batch, the stage and ``{"optimizer": {"type": "AdamW",
"params": {"lr": LR}}}``, so gradient clipping, the weight decay, the reduction and accumulation dtypes and bf16's
overflow skip are each side's defaults. The loss is multiplied by :data:`LOSS_MULTIPLIER` before ``backward`` so that
the gradient norm is above 1.0 at every step and DeepSpeed's default clipping changes every update.

Which optimizer real DeepSpeed builds from that config: ``FusedAdam`` (``torch_adam`` absent), its CPU build under
``DS_ACCELERATOR=cpu`` (a C++ extension JIT-compiled once, cached in the venv: see
:data:`helpers.ds.OPTIMIZERS`). That is DeepSpeed's own default path: FusedAdam's ``weight_decay`` default (0.0) and
the engine's ``gradient_clipping`` default (1.0) are both exercised, not a stand-in.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from typing import Any

import torch
import torch.distributed as dist

from helpers.ds import ROWS, DSNet, batches  # also sets DS_ACCELERATOR=cpu before deepspeed is imported

MODULES = ("deepspeed", "shardtrain.compat.deepspeed")
LR = 1e-2
LOSS_MULTIPLIER = 8.0  # DSNet's cross entropy has a gradient norm near 0.5: x8 puts every step's norm above 1.0
STEPS = 5
NAN_STEP = 2  # bf16: the step whose gradient gets a NaN on the last rank


def minimal_config(stage: int, dtype: str = "fp32") -> dict[str, Any]:
    """What a user writes who relies on DeepSpeed's defaults: no clipping, no weight decay, no dtype keys."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _merge(config: dict, extra: dict) -> dict:
    """``config`` with ``extra`` merged in, one level of sections deep (``{"optimizer": {"params": ...}}``)."""
    out = dict(config)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _full(deepspeed: Any, model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Per trainable parameter name: its whole fp32 master, ``exp_avg`` and ``exp_avg_sq`` (DeepSpeed's collective
    ``safe_get_full_*`` utilities: every rank gets the consolidated tensors of the per-rank partitions)."""
    utils = deepspeed.utils
    out: dict[str, dict[str, torch.Tensor]] = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        out["param"][name] = utils.safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            value = utils.safe_get_full_optimizer_state(p, key)
            if value is not None:
                out[key][name] = value.clone()
    return out


def _run(module_name: str, stage: int, dtype: str, extra: dict, nan_step: int | None) -> dict[str, Any]:
    deepspeed = importlib.import_module(module_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DSNet(seed=0)
    config = _merge(minimal_config(stage, dtype), extra)
    trainable = [p for p in model.parameters() if p.requires_grad]
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    poison = {"on": False}

    def plant_nan(grad: torch.Tensor) -> torch.Tensor:  # one element of one gradient, on the last rank only
        if poison["on"] and rank == world - 1:
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
        return grad

    model.fc.weight.register_hook(plant_nan)
    rows = ROWS // world
    out: dict[str, Any] = {"loss": [], "grad_norm": [], "skipped": []}
    for step, (x, y) in enumerate(batches()[:STEPS]):
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        poison["on"] = step == nan_step
        if step == nan_step:
            out["before_nan"] = _full(deepspeed, model)
        loss = engine(x, y)
        engine.backward(loss * LOSS_MULTIPLIER)
        engine.step()
        if step == nan_step:
            out["after_nan"] = _full(deepspeed, model)
        global_loss = loss.detach().float().reshape(1).to(torch.float64)
        dist.all_reduce(global_loss)
        out["loss"].append(float(global_loss) / world)
        norm = engine.get_global_grad_norm()
        out["grad_norm"].append(None if norm is None else float(norm))
        out["skipped"].append(int(engine.skipped_steps))
    out["final"] = _full(deepspeed, model)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed's ZeRO wraps the one it built
    out["optimizer"] = type(inner).__name__
    out["clipping"] = float(engine.gradient_clipping())
    del engine
    return out


def train_each(
    stages: list[int],
    dtype: str = "fp32",
    shardtrain_extra: dict | None = None,
    nan_step: int | None = None,
    modules: tuple[str, ...] = MODULES,
) -> dict[str, dict[int, dict[str, Any]]]:
    """On every rank: per module of ``modules`` and ZeRO stage of ``stages``, the global loss, gradient norm and
    skipped-step count after each step, and the consolidated parameters and moments at the end (and around
    ``nan_step``, where the last rank's ``fc.weight`` gradient gets a NaN). ``shardtrain_extra`` is merged into the
    shim's config only: the way to emulate shardtrain's defaults before issue 54 and see the comparison fail."""
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for module_name in modules:
        extra = (shardtrain_extra or {}) if module_name != "deepspeed" else {}
        results[module_name] = {stage: _run(module_name, stage, dtype, extra, nan_step) for stage in stages}
    return results
