"""``deepspeed.accelerator``: ``get_accelerator()``, DeepSpeed's view of the device, for CUDA and the CPU.

The device is the one the engine picks ([Note: choosing the device] in :mod:`shardtrain.distributed.mesh`):
``SHARDTRAIN_DEVICE``, else CUDA when available. The methods are the ones DeepSpeed's training scripts and
integrations call, with DeepSpeed's meaning; another raises
:class:`~shardtrain.compat.deepspeed.unsupported.NotProvidedError` naming it.
"""

from __future__ import annotations

from typing import Any

import torch

from shardtrain.compat.deepspeed.unsupported import not_provided
from shardtrain.distributed.mesh import backend_for, pick_device


class Accelerator:
    """DeepSpeed's accelerator object for the device this process trains on."""

    def __init__(self) -> None:
        self._device = pick_device()
        self._name = self._device.type  # "cuda" or "cpu": DeepSpeed's accelerator names

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``, or ``"cuda:<i>"`` with an index; ``"cpu"`` on the CPU (whose accelerator ignores the index)."""
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self._name == "cuda" else "cpu"

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._name == "cuda" else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return backend_for(self._device)

    def manual_seed(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return True

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._name == "cuda" else 0

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._name == "cuda" else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise not_provided(f"get_accelerator().{name}", "use torch.cuda (or torch) directly")


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The accelerator of this process (made once, as DeepSpeed's)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR
