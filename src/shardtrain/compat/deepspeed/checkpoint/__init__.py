"""``deepspeed.checkpoint``: the one helper integrations import from it (:mod:`.utils`)."""

from __future__ import annotations

from typing import Any

from shardtrain.compat.deepspeed.unsupported import not_provided


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module 'shardtrain.deepspeed.checkpoint' has no attribute {name!r}")
    raise not_provided(
        f"deepspeed.checkpoint.{name}",
        "DeepSpeed's checkpoint reshaping is not needed: shardtrain's checkpoints load at any world size and stage, "
        "and DeepSpeed's are read by engine.load_checkpoint",
    )
