"""Live tensor bytes on the CPU, the stand-in for a device allocator's peak (tests and benchmarks).

:class:`LiveBytes`, a ``TorchDispatchMode``, registers the storage of every tensor an operator returns while it is
active (parameters, buffers, flat buffers, shards, values read from files, temporaries) and, before and after every
operator, sums the current size of those still alive (weak references to the storages; a storage resized to 0, as
a released ZeRO-3 unit is, counts 0). Its peak is the most tensor memory the process held at once during the
measured calls. It does not see memory that no operator returns (gloo's internal buffers, the Python heap), which
is not tensor data.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the live tensor storages created while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref] = {}
        self.peak = 0

    def _sample(self) -> int:
        total = 0
        for key, ref in list(self.live.items()):
            storage = ref()
            if storage is None:
                del self.live[key]
            else:
                total += storage.nbytes()
        self.peak = max(self.peak, total)
        return total

    def register(self, t: torch.Tensor) -> None:
        """Count ``t``, made without an operator (safetensors makes tensors over the bytes it read)."""
        storage = t.untyped_storage()
        known = self.live.get(storage._cdata)
        if known is None or known() is None:
            self.live[storage._cdata] = weakref.ref(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self._sample()  # storages resized since the last operator (a unit gathered, released)
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.register(t)
        self._sample()
        return out
