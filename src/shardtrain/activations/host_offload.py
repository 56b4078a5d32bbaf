"""The inputs a checkpointed block keeps, in host memory between forward and backward (DeepSpeed's
``cpu_checkpointing``, ALST's offloaded checkpoints): what is left on the device of a checkpointed model is then one
block's activations at a time.

[Note: offloaded block inputs]
A checkpointed block saves only its inputs (the rest is recomputed). Saved-tensor hooks pushed around the block's
forward, outside the checkpoint ([Note: the order of a checkpointed block's hooks]), see exactly those: each is copied
to page-locked host memory on a side stream, after an event of the compute stream (the tensor is complete), and
``record_stream`` keeps the caching allocator from reusing its device memory before the copy has read it; the device
tensor is then freed by autograd. In backward, unpacking a block's input copies back every input of that block, if
not already in flight, and starts the copies of the block before it (the next one backward reaches): one block
ahead, on the side stream, each copy complete at an event the compute stream waits on before its first use. Host
buffers come from torch's caching host allocator, so steady-state steps reuse the same pinned pages. On the CPU the
same path runs with plain copies in host memory, so the values given back are the values saved, bit for bit.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardtrain.activations.block_hooks import BlockInputHooks


@dataclass(eq=False)
class _HostCopy:
    """One saved input: its host copy, and its device copy once fetched for backward."""

    host: torch.Tensor
    nbytes: int
    block: list[weakref.ref[_HostCopy]]  # the copies of the block this one was saved in
    previous: list[weakref.ref[_HostCopy]] | None  # those of the block before it in the forward
    copied: Any = None  # CUDA: the event after which ``host`` is complete
    device: torch.Tensor | None = None
    fetched: Any = None  # CUDA: the event after which ``device`` is complete


@dataclass
class HostOffload(BlockInputHooks):
    """Saved-tensor hooks moving the inputs of checkpointed blocks to host memory ([Note: offloaded block inputs]);
    one per engine, installed on each block by :func:`shardtrain.activations.apply_checkpointing`."""

    device: torch.device
    host_bytes: int = 0
    """Bytes of block inputs in host memory now."""
    peak_host_bytes: int = 0
    offloaded: int = 0
    """Tensors moved to the host since the engine was made (tests read it)."""
    _stream: Any = None  # CUDA: the side stream of the copies, both ways
    _pass: list[list[weakref.ref[_HostCopy]]] = field(default_factory=list)  # this forward's blocks, in order
    _seen: set[int] = field(default_factory=set)  # ids of the blocks of this forward
    _open: list[Any] = field(default_factory=list)  # the hooks pushed by the blocks running now (None: none pushed)

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)

    def _entering(self, module: nn.Module) -> None:
        if id(module) in self._seen:  # a block seen again: a new forward
            self._pass, self._seen = [], set()
        self._seen.add(id(module))
        self._pass.append([])

    def _pack(self, t: torch.Tensor) -> _HostCopy | torch.Tensor:
        if t.device.type == "cpu" and self.device.type != "cpu":  # already in host memory
            return t
        block = self._pass[-1]
        previous = self._pass[-2] if len(self._pass) > 1 else None
        nbytes = t.numel() * t.element_size()
        if self._stream is None:
            copy = _HostCopy(self._to_host(t), nbytes, block, previous)
        else:
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            self._stream.wait_stream(torch.cuda.current_stream(t.device))  # t is complete on the compute stream
            with torch.cuda.stream(self._stream):
                host.copy_(t.detach(), non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
            t.record_stream(self._stream)  # its memory is not reused before the copy has read it
            copy = _HostCopy(host, nbytes, block, previous, copied=copied)
        block.append(weakref.ref(copy))
        self.offloaded += 1
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return copy

    def _unpack(self, packed: _HostCopy | torch.Tensor) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self._fetch(packed.block)
        if packed.previous is not None:
            self._fetch(packed.previous)  # one block ahead of backward
        t = packed.device
        if t is None:  # unpacked a second time (retain_graph): fetch it alone
            self._fetch([weakref.ref(packed)])
            t = packed.device
        assert t is not None
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(packed.fetched)
            t.record_stream(current)  # allocated on the side stream, used on this one
        packed.device = packed.fetched = None  # the host copy stays while autograd holds it (retain_graph)
        self.host_bytes -= packed.nbytes
        packed.nbytes = 0
        return t

    def _fetch(self, block: list[weakref.ref[_HostCopy]]) -> None:
        for ref in block:
            copy = ref()
            if copy is None or copy.device is not None:
                continue
            if self._stream is None:
                copy.device = self._to_device(copy.host)
                continue
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(copy.copied)
                copy.device = copy.host.to(self.device, non_blocking=True)
                copy.fetched = torch.cuda.Event()
                copy.fetched.record()

    def _to_host(self, t: torch.Tensor) -> Any:
        """Without a side stream (the CPU): a plain copy in host memory. The planner's fake run overrides this pair
        to keep shapes only, so that its tracker sees the device bytes alone."""
        return t.detach().to("cpu", copy=True)

    def _to_device(self, host: Any) -> torch.Tensor:
        return host.to(self.device)
