"""Real DeepSpeed's verdict on a config file, at the world size the file implies (for tests/config/
test_config_corpus.py).

DeepSpeed's own parser (``deepspeed.runtime.config.DeepSpeedConfig``, with ``DS_ACCELERATOR=cpu``) reads the file
as a DeepSpeed job would: ``"auto"`` values filled first as Hugging Face's Trainer fills them (DeepSpeed itself
takes no ``"auto"``), and the data-parallel world size it reads from ``deepspeed.comm`` replaced by the one the
file's batch sizes imply, so no process group is needed.
"""

from __future__ import annotations

import copy
import os
from typing import Any
from unittest import mock

HIDDEN = 1024
"""The model's hidden size, for the bucket sizes the Trainer derives from it."""

TRAINER_VALUES: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "lr": 5e-5,
    "betas": [0.9, 0.999],
    "eps": 1e-8,
    "weight_decay": 0.0,
    "warmup_min_lr": 0,
    "warmup_max_lr": 5e-5,
    "warmup_num_steps": 0,
    "total_num_steps": 100,
    "enabled": False,  # fp16 / bf16 without --fp16 / --bf16
    "reduce_bucket_size": HIDDEN * HIDDEN,
    "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
    "stage3_param_persistence_threshold": 10 * HIDDEN,
    "stage3_gather_16bit_weights_on_model_save": True,
}
"""What Hugging Face's Trainer (``HfTrainerDeepSpeedConfig.trainer_config_process``) writes for each ``"auto"``
with its default arguments; ``train_batch_size`` is micro x accumulation x world."""

_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _given(config: dict, key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def implied_world(config: dict) -> int:
    """The data-parallel world size the batch sizes imply: ``train_batch_size / (micro x accumulation)`` where both
    are given (accumulation 1 when absent); 2 where the file leaves it open (and a given batch allows it), else 1."""
    tb, mb, gas = (_given(config, k) for k in _BATCH)
    if tb is not None and mb is not None:
        per_rank = mb * (gas or 1)
        return tb // per_rank if tb % per_rank == 0 and tb >= per_rank else 1
    if tb is not None:
        return 2 if tb % (2 * (gas or 1)) == 0 else 1
    return 2


def fill_auto(node: Any, world: int) -> Any:
    """``node`` with every ``"auto"`` replaced by the Trainer's value (:data:`TRAINER_VALUES`)."""
    if isinstance(node, dict):
        out = {k: fill_auto(v, world) for k, v in node.items()}
        for k, v in node.items():
            if v == "auto":
                out[k] = TRAINER_VALUES.get(k, v)
        if out.get("train_batch_size") == "auto":
            mb = out.get("train_micro_batch_size_per_gpu", 1)
            out["train_batch_size"] = mb * out.get("gradient_accumulation_steps", 1) * world
        return out
    if isinstance(node, list):
        return [fill_auto(v, world) for v in node]
    return node


class _World:
    """Stands in for ``deepspeed.comm`` inside ``DeepSpeedConfig``: rank 0 of ``size`` ranks."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_rank(self, group: Any = None) -> int:
        return 0

    def get_world_size(self, group: Any = None) -> int:
        return self.size


class _OptimizerChecked(Exception):
    """Raised where DeepSpeed's engine, past its checks of the optimizer section's params, would build the optimizer."""


class _EngineStandIn:
    """The two methods ``DeepSpeedEngine._configure_basic_optimizer`` calls before it builds anything."""

    def __init__(self, params: dict) -> None:
        self.params = params

    def optimizer_params(self) -> dict:
        return self.params

    def optimizer_name(self) -> str:
        raise _OptimizerChecked


def _engine_refusal(config: dict) -> str:
    """DeepSpeed's engine's refusal of the ``optimizer`` section's params (``max_grad_norm``), which its parser
    does not make: its own ``_configure_basic_optimizer``, run up to the point where it would build the optimizer."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    optimizer = config.get("optimizer")
    if not isinstance(optimizer, dict):
        return ""
    try:
        DeepSpeedEngine._configure_basic_optimizer(_EngineStandIn(dict(optimizer.get("params") or {})), [])
    except _OptimizerChecked:
        return ""
    except ValueError as err:
        return f"ValueError: {err}"
    return ""


def deepspeed_verdict(config: dict) -> tuple[int, bool, str]:
    """(implied data-parallel world size, whether DeepSpeed accepts the file there, its error): its parser, then its
    engine's check of the optimizer section (:func:`_engine_refusal`)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.runtime.config as ds_config

    world = implied_world(config)
    filled = fill_auto(copy.deepcopy(config), world)
    sp = filled.get("sequence_parallel_size", 1)
    try:
        # DeepSpeed divides the process count by sequence_parallel_size for the batch sizes
        with mock.patch.object(ds_config, "dist", _World(world * (sp if isinstance(sp, int) else 1))):
            ds_config.DeepSpeedConfig(filled)
    except Exception as err:  # any refusal of DeepSpeed's: its asserts, pydantic, its own errors
        return world, False, f"{type(err).__name__}: {err}".splitlines()[0]
    refusal = _engine_refusal(filled)
    return world, not refusal, refusal.splitlines()[0] if refusal else ""
