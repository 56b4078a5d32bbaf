"""Counting the host synchronizations of a block of code, and naming where each was asked for.

[Note: counting host synchronizations]
A synchronization is the host waiting for the device: reading a device value (``.item()``, ``float(t)``, ``if t:``),
a data-dependent output size (``nonzero``, ``unique``), a copy to pageable host memory, an explicit ``synchronize``.
``count_host_syncs(device)`` counts them while its block runs:

- **On the CPU** nothing waits, so a dispatch mode counts the operations that *would* wait on a GPU (``SYNCING``).
  Numpy reads of host memory (:class:`~shardtrain.host_read.HostRead`'s pinned copies) are not among them;
  copies to the host cannot be told apart on the CPU: only the GPU run counts them.
- **On CUDA** it counts what CUDA reports (``torch.cuda.set_sync_debug_mode("warn")``) plus explicit ``synchronize``
  calls. Backward runs on the calling thread meanwhile (autograd's device threads would report only at the end of
  backward, under the wrong operation), and a dispatch mode names the operation running at each warning.

Each is recorded as ``"<operation> at <file>:<line>"``, the innermost frame outside torch and the ``skip`` files.
"""

from __future__ import annotations

import collections
import os
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = frozenset(
    {
        "aten::_local_scalar_dense",  # .item(), float(t), int(t), bool(t) of a one-element tensor
        "aten::is_nonzero",  # `if t:`
        "aten::equal",
        "aten::nonzero",
        "aten::_unique2",
        "aten::unique_consecutive",
        "aten::unique_dim",
        "aten::masked_select",
    }
)
"""Operations that wait for the device on a GPU: they read a value on the host or size their output by the data."""


@dataclass
class SyncCount:
    sites: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def describe(self) -> str:
        return "; ".join(f"{site} (x{n})" for site, n in sorted(self.sites.items())) or "none"


def caller(skip: tuple[str, ...] = ()) -> str:
    """The innermost frame of the stack outside torch, this file and ``skip``: the code that asked."""
    own = (os.path.abspath(__file__), *(os.path.abspath(s) for s in skip))
    for frame in reversed(traceback.extract_stack()):
        if f"{os.sep}torch{os.sep}" not in frame.filename and os.path.abspath(frame.filename) not in own:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


class _Operations(TorchDispatchMode):
    """On the CPU: counts ``SYNCING`` operations. On CUDA: names the operation during which CUDA warned."""

    def __init__(self, count: SyncCount, skip: tuple[str, ...], caught: list | None) -> None:
        super().__init__()
        self.count, self.skip, self.caught = count, skip, caught

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._schema.name
        if self.caught is None:
            if name in SYNCING:
                self.count.sites[f"{name} at {caller(self.skip)}"] += 1
            return func(*args, **(kwargs or {}))
        before = len(self.caught)
        out = func(*args, **(kwargs or {}))
        for w in self.caught[before:]:
            if "synchroniz" in str(w.message).lower():
                self.count.sites[f"{name} at {caller(self.skip)}"] += 1
        del self.caught[before:]
        return out


@contextmanager
def count_host_syncs(device: torch.device | str = "cpu", skip: tuple[str, ...] = ()) -> Iterator[SyncCount]:
    """Count the host synchronizations of the block (see [Note: counting host synchronizations])."""
    count = SyncCount()
    if torch.device(device).type != "cuda":
        with _Operations(count, skip, None):
            yield count
        return
    patched = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")]
    originals = [getattr(owner, name) for owner, name in patched]

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught, torch.autograd.set_multithreading_enabled(False):
        warnings.simplefilter("always")

        def counting(what: str, original: Any) -> Any:
            def call(*a: Any, **k: Any) -> Any:
                count.sites[f"{what} at {caller(skip)}"] += 1
                before = len(caught)
                try:
                    return original(*a, **k)
                finally:
                    del caught[before:]  # CUDA's own warning about this call: counted once, here

            return call

        for (owner, name), original in zip(patched, originals):
            setattr(owner, name, counting(f"{getattr(owner, '__name__', owner)}.{name}", original))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with _Operations(count, skip, caught):
                yield count
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for (owner, name), original in zip(patched, originals):
                setattr(owner, name, original)
    # warnings outside any operation (a copy torch makes on its own): still synchronizations
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            count.sites[f"outside an operation at {w.filename}:{w.lineno}"] += 1
    torch.cuda.synchronize()
