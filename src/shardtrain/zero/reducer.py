"""Gradient reduction for ZeRO stages 0, 1 and 2, bucket by bucket, overlapped with backward.

[Note: gradient storage per stage]
* stage 0: each bucket has a full flat gradient buffer; ``param.grad`` is a view into it, so autograd
  accumulates micro-steps in place. At the accumulation boundary each bucket is all-reduced (averaged).
* stage 1: same full buffers; at the boundary each bucket is reduce-scattered and the averaged result
  written into this rank's chunk of the buffer, which the optimizer's fragments view.
* stages 2 and 3: no full gradient buffer survives a bucket. When a parameter's gradient is ready it is copied into its
  bucket's staging buffer and ``param.grad`` is freed; a complete bucket is reduce-scattered (every
  micro-step) and the result added into a persistent ``shard_numel`` gradient buffer. A reduction is
  finished (waited for, folded in, staging freed) when the next bucket is launched, so at most two
  buckets' staging buffers exist at once. At stage 3 a bucket is a unit, and ``on_launch`` releases the unit's
  gathered parameters as soon as its reduction is launched (its backward is over).

[Note: collective order]
Buckets are launched strictly in index order on every rank: a bucket that is ready before its predecessor
waits for it. Buckets with parameters no rank used are launched at the end of backward with zero
gradients. This keeps the sequence of collectives identical on every rank whatever the autograd order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardtrain.comm import Communicator, Handle
from shardtrain.errors import ShardtrainError
from shardtrain.zero.layout import Bucket, ParamSlot


@dataclass
class _Pending:
    bucket: Bucket
    handle: Handle | None
    out: torch.Tensor | None  # reduce-scatter output, folded into the gradient shard on completion
    staging: torch.Tensor | None  # kept alive until the collective completes


class GradientReducer:
    def __init__(
        self,
        buckets: list[Bucket],
        stage: int,
        comm: Communicator,
        overlap: bool,
        on_launch: Callable[[Bucket], None] | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.buckets, self.stage, self.comm, self.overlap = buckets, stage, comm, overlap
        self.reduce_dtype = reduce_dtype  # None: each bucket's own dtype (see [Note: mixed precision])
        self.sharded_grads = stage >= 2
        self._on_launch = on_launch
        self._in_backward = False
        self._boundary = False
        self._fresh_shard = True  # stages 2-3: the gradient shards hold nothing yet this step
        self._ready = [0] * len(buckets)
        self._next = 0
        self._pending: list[_Pending] = []
        self._staging: dict[int, torch.Tensor] = {}
        self.full_grads: list[torch.Tensor] = []
        self.shard_grads: list[torch.Tensor] = []
        self._alias = True
        if not self.sharded_grads:
            # fp32 buffers for compute-dtype parameters (exact accumulation); else param.grad aliases them
            self.full_grads = [
                b.flat_param.new_zeros(b.padded_numel, dtype=_accumulation_dtype(b.dtype)) for b in buckets
            ]
            self._alias = all(g.dtype == b.dtype for b, g in zip(buckets, self.full_grads))
            if self._alias:
                for b, g in zip(buckets, self.full_grads):
                    for s in b.slots:
                        s.param.grad = self._grad_view(g, s)
        else:  # fp32 gradient shards for compute-dtype parameters: accumulation over micro-steps is exact
            self.shard_grads = [b.shard.new_zeros(b.shard_numel, dtype=_accumulation_dtype(b.dtype)) for b in buckets]
        self._hooks = [
            s.param.register_post_accumulate_grad_hook(self._make_hook(b.index, s)) for b in buckets for s in b.slots
        ]

    @staticmethod
    def _grad_view(flat: torch.Tensor, s: ParamSlot) -> torch.Tensor:
        return flat[s.offset : s.offset + s.numel].view(s.shape)

    # -- backward --------------------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        self._in_backward, self._boundary = True, boundary
        self._ready = [0] * len(self.buckets)
        self._next = 0

    def _active(self) -> bool:
        """Whether this backward reduces (stages 2-3 every micro-step, stages 0-1 at the boundary)."""
        return self.sharded_grads or self._boundary

    def _make_hook(self, index: int, slot: ParamSlot):
        def hook(param: torch.Tensor) -> None:
            if not self._in_backward:
                raise ShardtrainError(
                    f"gradient of {slot.name!r} computed outside engine.backward(): call "
                    "engine.backward(loss) instead of loss.backward() so gradients are reduced across ranks"
                )
            bucket = self.buckets[index]
            if self._active() and index < self._next:
                # its bucket's collective is already in flight: this gradient would be lost or race with it
                raise ShardtrainError(
                    f"parameter {slot.name!r} received a second gradient in one backward after its bucket was "
                    "reduced (reentrant activation checkpointing?); use torch.utils.checkpoint(..., "
                    "use_reentrant=False) or set zero_optimization.overlap_comm to false"
                )
            if not self.sharded_grads:
                view = self._grad_view(self.full_grads[index], slot)
                if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                    # a compute-dtype gradient into its fp32 buffer, or .grad was reset by the user
                    view.add_(param.grad)
                    param.grad = view if self._alias else None
            else:
                staging = self._staging.get(index)
                if staging is None:
                    staging = self._staging[index] = bucket.shard.new_zeros(
                        bucket.padded_numel, dtype=self._wire_dtype(bucket)
                    )
                staging[slot.offset : slot.offset + slot.numel].copy_(param.grad.reshape(-1))
                param.grad = None
            self._ready[index] += 1
            if self.overlap and self._active():
                self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].slots):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _wire_dtype(self, b: Bucket) -> torch.dtype:
        return self.reduce_dtype or b.dtype

    def _launch(self, b: Bucket) -> None:
        what = f"gradient bucket {b.index} ({b.numel} elements)"
        wire = self._wire_dtype(b)
        if self.stage == 0:
            buf = self.full_grads[b.index]
            tmp = buf if buf.dtype == wire else buf.to(wire)  # reduced in the wire dtype, written back after
            handle = self.comm.all_reduce(tmp, "avg", what=what, async_op=True)
            self._pending.append(_Pending(b, handle, None if tmp is buf else tmp, tmp))
        else:
            if self.stage == 1:
                inp = self.full_grads[b.index].to(wire)  # no copy when the dtypes agree
            else:
                inp = self._staging.pop(b.index, None)
                if inp is None:  # no parameter of the bucket got a gradient on this rank
                    inp = b.shard.new_zeros(b.padded_numel, dtype=wire)
            out = inp.new_empty(b.shard_numel)
            handle = self.comm.reduce_scatter(out, inp, "avg", what=what, async_op=True)
            self._pending.append(_Pending(b, handle, out, inp))
        if self._on_launch is not None:
            self._on_launch(b)
        # Older reductions had a whole bucket's backward to finish: fold them in now, so that their
        # full-size staging buffers do not outlive the next bucket (at most one stays in flight).
        while len(self._pending) > 1:
            self._finish(self._pending.pop(0))

    def _finish(self, p: _Pending) -> None:
        assert p.handle is not None
        p.handle.wait()
        if p.out is None:
            return
        if self.stage == 0:
            self.full_grads[p.bucket.index].copy_(p.out)
        elif self.stage == 1:
            lo, hi = p.bucket.shard_range
            self.full_grads[p.bucket.index][lo:hi].copy_(p.out)
        elif self._fresh_shard:
            self.shard_grads[p.bucket.index].copy_(p.out)
        else:
            self.shard_grads[p.bucket.index].add_(p.out)

    def end_backward(self) -> None:
        """Launch what is left in order and wait for every reduction of this backward."""
        if self._active():
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
                self._next += 1
        for p in self._pending:
            self._finish(p)
        if self.sharded_grads and self._active():
            self._fresh_shard = False
        self._pending.clear()
        self._staging.clear()
        self._in_backward = False

    # -- after the step --------------------------------------------------------------------------
    def shard_grad(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced gradient chunk of bucket ``b`` (valid after a boundary backward)."""
        if self.sharded_grads:
            return self.shard_grads[b.index]
        lo, hi = b.shard_range
        return self.full_grads[b.index][lo:hi]

    def param_grad(self, b: Bucket, i: int) -> torch.Tensor:
        """The (reduced, at stage 0) full gradient of slot ``i`` of bucket ``b``, shaped like the parameter."""
        return self._grad_view(self.full_grads[b.index], b.slots[i])

    def zero_grads(self) -> None:
        for g in self.full_grads:
            g.zero_()
        if self.full_grads and not self._alias:
            return
        for b, g in zip(self.buckets, self.full_grads):
            for s in b.slots:  # re-point in case the user replaced or dropped a .grad
                if s.param.grad is None or s.param.grad.data_ptr() != g.data_ptr() + s.offset * g.element_size():
                    s.param.grad = self._grad_view(g, s)
        for g in self.shard_grads:
            g.zero_()
        self._fresh_shard = True

    def grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.full_grads + self.shard_grads)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
