"""``deepspeed.runtime``: :mod:`.lr_schedules` (accelerate reads its ``VALID_LR_SCHEDULES``) and :mod:`.pipe`
(``PipelineModule``, ``PipelineEngine``); every other name of
DeepSpeed's internals is refused by name, saying what to use."""

from __future__ import annotations

from typing import Any

from shardtrain.compat.deepspeed.runtime import pipe  # noqa: F401  deepspeed.runtime.pipe
from shardtrain.compat.deepspeed.unsupported import not_provided

_INSTEAD = {
    "engine": "the engine class is deepspeed.DeepSpeedEngine",
    "zero": "the ZeRO-3 state of a parameter is shardtrain's own: gather with deepspeed.zero.GatheredParameters",
    "sequence_parallel": "Ulysses is the config's sequence_parallel_size (docs/sequence-parallel.md), with "
    "shardtrain.initialize; accelerate's ParallelismConfig(sp_backend='deepspeed') is not supported",
}


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module 'shardtrain.deepspeed.runtime' has no attribute {name!r}")
    raise not_provided(
        f"deepspeed.runtime.{name}",
        _INSTEAD.get(
            name,
            "DeepSpeed's internals are not provided: the engine is deepspeed.DeepSpeedEngine, the schedulers are "
            "deepspeed.runtime.lr_schedules', the ZeRO-3 state of a parameter is shardtrain's own (gather with "
            "deepspeed.zero.GatheredParameters)",
        ),
    )
