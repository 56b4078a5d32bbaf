"""What an estimate is compared with: the bytes torch's CPU allocator holds, measured by torch's profiler.

With ``profile_memory=True`` the profiler records every allocation and free of torch's CPU allocator (tensors,
storages resized by ZeRO-3's gathers and releases, the engine's buckets, optimizer state, autograd's saved tensors,
temporaries inside operators, gloo collectives' torch-side buffers). Started before the model is built, the running
sum of those events is the number of bytes of tensors alive in the process at every instant, and its maximum inside
a marked window (a training step after the first, when optimizer state exists) is that step's peak.

Not counted, by design: memory outside torch's allocator (the Python interpreter and imported libraries, gloo's own
buffers, allocator caching; on CUDA the caching allocator's reserve), and pages of memory-mapped swap files (ZeRO
offload to ``nvme``; the kernel's page cache holds them). Those are what ``ru_maxrss`` adds, and are the same for
every layout of one program; the planner predicts tensors.

[Note: frees the profiler misses]
The profiler records the allocations and frees made on the threads it follows. A storage whose last reference is
dropped on another thread is freed unrecorded, and the running sum stays that much too high from then on: gloo's
worker thread can hold the last reference to a collective's tensors after the call returned. This happens under
sequence parallelism (its all-to-alls, gathers and sums over the group), varying with the threads' timing
(measured in docs/estimate.md, "Sequence parallelism"). :meth:`PeakMeter.unrecorded_frees` measures it between two
scanned windows.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

_PREFIX = "shardtrain.estimate.window:"


class PeakMeter:
    """Profile the CPU allocator from construction to :meth:`stop`; :meth:`window` marks regions to read."""

    def __init__(self) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        self._events: list[tuple[int, int]] | None = None
        self._windows: dict[str, list[tuple[int, int]]] = {}
        self.live: dict[str, int] = {}
        """Per window opened with ``scan=True``: :func:`live_tensor_bytes` when it opened."""

    @contextmanager
    def window(self, name: str, scan: bool = False) -> Iterator[None]:
        if scan:
            self.live[name] = live_tensor_bytes()
        with record_function(_PREFIX + name):
            yield

    def stop(self) -> None:
        self._prof.__exit__(None, None, None)
        events = self._prof.profiler.kineto_results.events()
        self._events = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        for e in events:
            if e.name().startswith(_PREFIX):
                self._windows.setdefault(e.name()[len(_PREFIX) :], []).append((e.start_ns(), e.end_ns()))

    def _levels(self, name: str) -> tuple[int, int]:
        """(bytes alive when the first window ``name`` opened, most bytes alive inside any window ``name``)."""
        if self._events is None:
            raise RuntimeError("PeakMeter: call stop() first")
        spans = self._windows.get(name)
        if not spans:
            raise KeyError(f"no window {name!r} was recorded")
        total, start, peak = 0, None, 0
        first = min(lo for lo, _ in spans)
        for t, n in self._events:
            if start is None and t >= first:
                start = total
            total += n
            if any(lo <= t <= hi for lo, hi in spans):
                peak = max(peak, total)
        return (total if start is None else start), max(peak, start or 0)

    def start_level(self, name: str) -> int:
        return self._levels(name)[0]

    def peak(self, name: str) -> int:
        return self._levels(name)[1]

    def unrecorded_frees(self, first: str, second: str) -> int:
        """Bytes freed between the openings of two windows opened with ``scan=True`` whose frees the profiler did not
        record: the running sum's rise less the rise of :func:`live_tensor_bytes`. A window's :meth:`rise` between
        them is above the bytes really alive by at most this much (the gloo worker thread of a collective that
        returned may drop the last reference to its tensors: [Note: frees the profiler misses])."""
        return (self.start_level(second) - self.start_level(first)) - (self.live[second] - self.live[first])

    def rise(self, name: str) -> int:
        """Most bytes the window ``name`` added to what was alive when it opened."""
        start, peak = self._levels(name)
        return peak - start


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of every tensor reachable from Python objects (after a collection).

    Between training steps everything the engine keeps is reachable so (parameters and their flat buffers, gradient
    buffers, optimizer state, fp32 masters, unit shards, swap buffers). It is what the running sum should be there;
    unlike the running sum it does not drift when a tensor made here is freed on a thread the profiler does not
    follow (a backend's worker dropping the last reference), whose free is never recorded."""
    gc.collect()
    sizes: dict[int, int] = {}
    # type(), not isinstance(): some module objects warn when their __class__ is read; guarded ZeRO-3 parameters
    # refuse data access outside a forward unless torch-function subclass handling is off
    with torch._C.DisableTorchFunctionSubclass():
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                try:
                    storage = obj.untyped_storage()
                except (RuntimeError, NotImplementedError):  # tensors without a plain storage (sparse, subclasses)
                    continue
                if storage.data_ptr():
                    sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def measure_peak(fn: Callable[[PeakMeter], Any]) -> tuple[Any, PeakMeter]:
    """Run ``fn(meter)`` under a :class:`PeakMeter` (it marks its windows with ``meter.window(name)``)."""
    meter = PeakMeter()
    try:
        result = fn(meter)
    finally:
        meter.stop()
    return result, meter
