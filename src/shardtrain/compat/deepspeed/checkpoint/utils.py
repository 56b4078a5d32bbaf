"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save`` (accelerate's ``get_state_dict`` calls it)."""

from __future__ import annotations

from typing import Any

import torch

from shardtrain.compat.deepspeed.unsupported import not_provided


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """``item`` with every tensor copied to ``device`` (views become tensors of their own size, so ``torch.save``
    writes their elements only); lists, tuples and dicts rebuilt around them, anything else as it is."""
    if torch.is_tensor(item):
        return item.detach().to(device=device, copy=True).clone()
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module 'shardtrain.deepspeed.checkpoint.utils' has no attribute {name!r}")
    raise not_provided(f"deepspeed.checkpoint.utils.{name}", "it names DeepSpeed's checkpoint files")
