"""Gradient reduction for ZeRO stages 0, 1 and 2, bucket by bucket, overlapped with backward.

[Note: gradient storage per stage]
* stage 0: each bucket has a full flat gradient buffer that ``param.grad`` views, so autograd accumulates micro-steps
  in place; at the accumulation boundary each bucket is all-reduced (averaged).
* stage 1: the same buffers; at the boundary each bucket is reduce-scattered and the average written into this
  rank's chunk, which the optimizer's fragments view.
* stages 2 and 3: no full gradient buffer outlives a bucket. A ready gradient is copied into its bucket's staging
  buffer and ``param.grad`` freed; a complete bucket is reduce-scattered (every micro-step) and added into a
  persistent ``shard_numel`` buffer. Staging is allocated empty: each slot's first gradient overwrites it, and what
  no gradient wrote is zeroed at launch (memsets cost measurable CPU: docs/benchmarks.md, "Figures from the design
  notes"). A reduction is finished (waited, folded in, staging freed) when the next bucket launches, so once the
  launch order matches completion order ([Note: collective order]) at most two staging buffers exist (``max_staging``
  records it), plus buckets whose gradients arrive far apart (stage 3's root unit: head first, embeddings last; at
  stage 2 a size-based bucket straddling two blocks whose backward order is not the layout's). At stage 3 a bucket
  belongs to a unit; ``on_grad_ready`` tells the unit runtime as each parameter's gradient arrives, so a unit is
  released when its backward is over, however late its reduction launches. Under pipeline parallelism one backward
  spans the step's micro-batches (reduced once, after the last): the staging buffers then accumulate them in the
  accumulation dtype, cast to the wire dtype at launch, as the shard would have.

A parameter may get several gradients in one backward (used inside and outside a reentrant checkpoint): its slot
counts once towards readiness and later gradients are added to the first. A gradient arriving after its bucket's
collective was launched is an error, never lost.

[Note: collective order]
Every rank launches the buckets' collectives in one order, ``launch_order``: a ready bucket waits for those before it,
and buckets no rank used are launched at the end of backward with zero gradients. It starts as index order. At stages
2-3 (a waiting bucket holds a staging buffer) each rank records the order its buckets became ready; if it differs from
``launch_order`` anywhere (a flag on the step's gradient-norm all-reduce, read a step later: [Note: reading device
values a step later] in :mod:`shardtrain.host_read`), the ranks exchange their orders once and adopt them if all agree,
else keep the previous one, always safe. Under hybrid sharding the flag and exchange span every data-parallel rank
(``order_comm``): the replicas' all-reduces need one order too.

[Note: hybrid gradient reduction]
With hybrid sharding ([Note: the hybrid mesh] in :mod:`shardtrain.distributed.mesh`) ``comm`` is the shard group,
reduce-scattered within as above. At the accumulation boundary each complete gradient shard is all-reduced (averaged)
over ``replicate``, launched once its reduce-scatter is folded in (overlapping backward) and waited for at the end of
backward; earlier micro-steps reduce within the group only, as MiCS does. It runs in the wire dtype from the fp32
accumulation. The average of group averages is the average over all ``R * S`` ranks (``prescale_gradients`` applies
within the group, the replica average after). Buckets the captured graph reduced (:meth:`GradientReducer.hand_over`) are
all-reduced the same way after backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from shardtrain.distributed.communicator import Communicator, Handle, Reduce
from shardtrain.errors import ShardtrainError
from shardtrain.host_read import HostRead
from shardtrain.plan.policies import ZeroPolicy
from shardtrain.zero.layout import Bucket, ParamSlot


class GradientFiles(Protocol):
    """Stages 2-3: gradient shards kept in swap files instead of memory between micro-steps (``GradOffload``,
    [Note: gradient offload] in :mod:`shardtrain.offload.gradients`). Positions index the reducer's buckets."""

    on_disk: set[int]
    """The buckets whose gradient shard is in its file: the reducer keeps no in-memory shard for them."""

    def fold(self, position: int, bucket: Bucket, out: torch.Tensor, fresh: bool, boundary: bool) -> None:
        """``out``, this rank's reduced gradient of one micro-step, into the bucket's file (``fresh``: the first
        micro-step since the gradients were zeroed; ``boundary``: the last one of the step). Never raises."""

    def keep_in_memory(self, positions: list[int]) -> list[int]:
        """These buckets' shards stay in memory from now on; returns those that were in files."""


class ShardCopies(Protocol):
    """CUDA with the optimizer stepped on the host: each complete gradient shard copied to the host at the
    accumulation boundary (``HostCopies``, [Note: overlapped offload] in :mod:`shardtrain.offload.host_copies`)."""

    def invalidate(self) -> None:
        """A backward begins or the gradients are zeroed: the host copies are stale."""

    def bucket_reduced(self, position: int, shard: torch.Tensor) -> None:
        """At the boundary, bucket ``position``'s gradient ``shard`` is complete on the compute stream."""

    def backward_done(self, shards: dict[int, torch.Tensor]) -> None:
        """The end of a boundary backward: every complete gradient shard reduced here, by bucket position."""


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
        policy: ZeroPolicy,
        comm: Communicator,
        overlap: bool,
        on_grad_ready: Callable[[Bucket], None] | None = None,
        reduce_dtype: torch.dtype | None = None,
        accum_dtype: torch.dtype = torch.float32,
        tp_partial: tuple[Communicator, frozenset[int]] | None = None,
        predivide: float | None = None,
        replicate: Communicator | None = None,
        order_comm: Communicator | None = None,
        experts: tuple[Communicator, int] | None = None,
        grad_files: GradientFiles | None = None,
        host_copies: ShardCopies | None = None,
        micro_batches_per_backward: int = 1,
    ) -> None:
        """``replicate``: hybrid sharding's replicate group (see [Note: hybrid gradient reduction]); ``order_comm``:
        the ranks that must agree on the launch order (every data-parallel rank; default ``comm``). ``experts``:
        under expert parallelism, the expert-data-parallel group the expert buckets are reduced over and the
        expert-parallel size ``E`` their average is divided by (see [Note: expert buckets] in zero/layout.py).
        ``grad_files``: stages 2-3, the gradient shards kept in swap files (:class:`GradientFiles`); ``host_copies``:
        each complete gradient shard copied to the host (:class:`ShardCopies`); both built by the optimizer offload
        before the reducer (``engine/parallelize.py``). ``micro_batches_per_backward`` > 1: one backward spans a
        pipeline step's micro-batches, so at stages 2-3 the staging buffers accumulate them, in the accumulation
        dtype, and are cast to the wire dtype at launch ([Note: gradient storage per stage])."""
        self.buckets, self.comm, self.overlap = buckets, comm, overlap
        self.staging_accumulates = micro_batches_per_backward > 1
        self.expert_comm, self.expert_groups = experts if experts is not None else (None, 1)
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        self.order_comm = order_comm if order_comm is not None else comm
        self._replica_pending: list[tuple[Handle, torch.Tensor, torch.Tensor]] = []
        # None: reductions average (AVG). Else DeepSpeed's prescale_gradients / gradient_predivide_factor: each
        # bucket is multiplied by 1/predivide, summed, then by predivide/N (see config.gradient_predivide)
        self.predivide = predivide
        self.device = buckets[0].flat_param.device if buckets else torch.device("cpu")  # shards may be on the host
        self.reduce_dtype = reduce_dtype  # None: each bucket's own dtype (see [Note: mixed precision])
        self.accum_dtype = accum_dtype  # compute-dtype gradients accumulate in it (fp32, or the compute dtype)
        self.mode = policy.gradient_reduction  # see [Note: gradient storage per stage]
        self.sharded_grads = policy.shard_gradients
        self._on_grad_ready = on_grad_ready
        self._in_backward = False
        self._boundary = False
        self._fresh_shard = True  # stages 2-3: the gradient shards hold nothing yet this step (see grads_zeroed)
        self._position = {b.index: i for i, b in enumerate(buckets)}
        self.launch_order: list[int] = list(
            range(len(buckets))
        )  # positions in ``buckets``; see [Note: collective order]
        self._observed: list[int] = []  # positions in the order they became ready this backward
        self.order_departed = False  # the observed order differed from launch_order since the last step
        # the last step's all-reduced order flag on its way to the host, and how many order exchanges preceded it
        self._order_read: tuple[HostRead, int] | None = None
        self._exchanges = 0  # order exchanges so far (collective: the same on every rank)
        self._got: list[set[int]] = [set() for _ in buckets]  # slots that have a gradient this backward
        # ids of the parameters that required grad at a backward since the gradients were zeroed: the ones the step
        # updates (see [Note: parameters frozen after initialize] in zero/optimizer.py)
        self._trained: set[int] = set()
        self._next = 0  # index into launch_order
        self._launched: set[int] = set()
        self._pending: list[_Pending] = []
        self._staging: dict[int, torch.Tensor] = {}
        self.max_staging = 0  # most staging buffers alive at once since the last reset (tests read it)
        self.full_grads: list[torch.Tensor] = []
        self.shard_grads: list[torch.Tensor] = []
        self._alias = True
        if not self.sharded_grads:
            # buffers in the accumulation dtype; param.grad aliases those in the parameters' own dtype
            self.full_grads = [b.flat_param.new_zeros(b.padded_numel, dtype=self._grad_dtype(b)) for b in buckets]
            self._alias = all(g.dtype == b.dtype for b, g in zip(buckets, self.full_grads))
            if self._alias:
                for b, g in zip(buckets, self.full_grads):
                    for s in b.slots:
                        s.param.grad = self._grad_view(g, s)
        else:  # gradient shards in the accumulation dtype (fp32: accumulation over micro-steps is exact)
            in_files = grad_files.on_disk if grad_files is not None else set()
            self.shard_grads = [
                b.flat_param.new_empty(0, dtype=self._grad_dtype(b))
                if position in in_files
                else b.flat_param.new_zeros(b.shard_numel, dtype=self._grad_dtype(b))
                for position, b in enumerate(buckets)
            ]
        hooks = {id(s.param): self._make_hook(b.index, s) for b in buckets for s in b.slots}
        self._hook_of = hooks  # what a gradient set directly is handed to (grads_set_directly)
        self._hooks = [s.param.register_post_accumulate_grad_hook(hooks[id(s.param)]) for b in buckets for s in b.slots]
        if tp_partial is not None:  # before accumulation into .grad, so micro-steps are summed once
            tp_comm, ids = tp_partial
            for b in buckets:
                for s in b.slots:
                    if id(s.param) in ids:
                        self._hooks.append(s.param.register_hook(partial(_tp_sum, tp_comm, s.name)))
        self._proposal: list[int] | None = None
        self._external: frozenset[int] = frozenset()
        # weakly: the gradient hooks can outlive an engine dropped without close(), and must not keep its swap
        # directory (owned through the files) from being removed when the engine is collected
        self.grad_files = weakref.proxy(grad_files) if grad_files is not None else None
        self.host_copies = host_copies

    def hand_over(self, buckets: list[Bucket]) -> None:
        """The gradients of ``buckets`` arrive reduced from elsewhere, added into :meth:`shard_grad` (graph-mode
        ZeRO-3: the captured backward graph reduce-scatters the units); they are never launched here, and the
        other buckets (stage 3's persistent parameters) are reduced as before. Called again before each backward
        (``[]``: a backward that follows only eager calls of the module reduces every bucket here); buckets taken
        back return to their place in bucket order."""
        external = frozenset(self._position[b.index] for b in buckets)
        order = [p for p in self.launch_order if p not in external]
        for p in sorted(set(range(len(self.buckets))) - external - set(order)):
            later = [i for i, q in enumerate(order) if q > p]
            order.insert(later[0] if later else len(order), p)
        self.launch_order, self._external = order, external
        if self.grad_files is not None:  # those shards are added into here, by the graph: not in files (for good)
            for position in self.grad_files.keep_in_memory(sorted(external)):
                b = self.buckets[position]
                self.shard_grads[position] = b.flat_param.new_zeros(b.shard_numel, dtype=self._grad_dtype(b))

    def _grad_dtype(self, b: Bucket) -> torch.dtype:
        """What ``b``'s gradients accumulate in: ``accum_dtype`` for the compute dtypes, else their own dtype."""
        return self.accum_dtype if b.dtype in (torch.bfloat16, torch.float16) else b.dtype

    @staticmethod
    def _grad_view(flat: torch.Tensor, s: ParamSlot) -> torch.Tensor:
        return flat[s.offset : s.offset + s.numel].view(s.shape)

    # -- backward --------------------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        self._in_backward, self._boundary = True, boundary
        self._trained.update(id(s.param) for b in self.buckets for s in b.slots if s.param.requires_grad)
        self._got = [set() for _ in self.buckets]
        self._observed = []
        self._launched = set()
        self._next = 0
        if self.host_copies is not None:  # this backward changes the shards: the host copies are stale
            self.host_copies.invalidate()

    def _active(self) -> bool:
        """Whether this backward reduces (stages 2-3 every micro-step, stages 0-1 at the boundary)."""
        return self.sharded_grads or self._boundary

    def _make_hook(self, index: int, slot: ParamSlot):
        position = self._position[index]
        slot_index = next(i for i, x in enumerate(self.buckets[position].slots) if x is slot)

        def hook(param: torch.Tensor) -> None:
            if not self._in_backward:
                raise ShardtrainError(
                    f"gradient of {slot.name!r} computed outside engine.backward(): call "
                    "engine.backward(loss) instead of loss.backward() so gradients are reduced across ranks"
                )
            bucket = self.buckets[position]
            if position in self._external:  # its gradient is reduced by the captured graph this backward
                raise ShardtrainError(
                    f"gradient of {slot.name!r} from an eager call of the module in a backward that also runs a "
                    "captured graph's (graph-mode ZeRO-3 reduces the units' gradients inside that graph): call "
                    "engine.backward() on the loss of engine(...) and on the loss of engine.module(...) separately"
                )
            if self._active() and position in self._launched:
                # its bucket's collective is already in flight: this gradient would be lost or race with it
                raise ShardtrainError(
                    f"parameter {slot.name!r} received a second gradient in one backward after its bucket was "
                    "reduced (a parameter used inside and outside a reentrant activation checkpoint?); use "
                    "torch.utils.checkpoint(..., use_reentrant=False), or set zero_optimization.overlap_comm to "
                    "false so that reductions wait for the end of backward"
                )
            first = slot_index not in self._got[position]
            if not self.sharded_grads:
                view = self._grad_view(self.full_grads[position], slot)
                if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                    # a compute-dtype gradient into its fp32 buffer, or .grad was reset by the user
                    view.add_(param.grad)
                    param.grad = view if self._alias else None
            else:
                staging = self._staging.get(position)
                if staging is None:
                    # not zeroed: every slot is written by its first gradient; the rest is zeroed at launch
                    staging = self._staging[position] = bucket.flat_param.new_empty(
                        bucket.padded_numel, dtype=self._staging_dtype(bucket)
                    )
                    self.max_staging = max(self.max_staging, len(self._staging) + len(self._pending))
                target = staging[slot.offset : slot.offset + slot.numel]
                if first:
                    target.copy_(param.grad.reshape(-1))
                else:  # a second gradient in the same backward adds to the first
                    target.add_(param.grad.reshape(-1))
                param.grad = None
            if not first:
                return
            self._got[position].add(slot_index)
            if self._on_grad_ready is not None:
                self._on_grad_ready(bucket)
            if len(self._got[position]) == len(bucket.slots):
                self._observed.append(position)
                if self.overlap and self._active():
                    self._launch_ready()

        return hook

    def grads_set_directly(self, params: list[torch.Tensor]) -> None:
        """Each of ``params`` holds in ``.grad`` a gradient a pass assigned rather than accumulated (no
        ``AccumulateGrad``, so no hook ran): folded in as the hook folds one (a pipeline's weight pass, [Note: the
        weight pass reaches the reducer] in ``pipeline_parallel/schedule.py``)."""
        for p in params:
            hook = self._hook_of.get(id(p))
            if hook is None:
                raise ShardtrainError("a gradient set directly on a parameter in none of the reducer's buckets")
            hook(p)

    def _launch_ready(self) -> None:
        order = self.launch_order
        while self._next < len(order) and len(self._got[order[self._next]]) == len(
            self.buckets[order[self._next]].slots
        ):
            self._next += 1  # first: see end_backward
            self._launch(order[self._next - 1])

    def _wire_dtype(self, b: Bucket) -> torch.dtype:
        return self.reduce_dtype or b.dtype

    def _staging_dtype(self, b: Bucket) -> torch.dtype:
        return self._grad_dtype(b) if self.staging_accumulates else self._wire_dtype(b)

    def _divides_first(self, wire: torch.dtype) -> bool:
        """See [Note: low-precision reductions divide first]."""
        return divides_first(self.predivide, wire) and self.mode != "all_reduce"

    def _comm_of(self, b: Bucket) -> Communicator:
        return self.expert_comm if b.expert and self.expert_comm is not None else self.comm

    def _launch(self, position: int) -> None:
        b = self.buckets[position]
        comm = self._comm_of(b)
        self._launched.add(position)
        what = f"gradient bucket {b.index} ({b.numel} elements)"
        wire = self._wire_dtype(b)
        first = self._divides_first(wire)
        op = Reduce.AVG if self.predivide is None and not first else Reduce.SUM
        if self.mode == "all_reduce":
            buf = self.full_grads[position]
            tmp = buf if buf.dtype == wire else buf.to(wire)  # reduced in the wire dtype, written back after
            self._prescale(tmp)  # in place: the buffer receives the reduced values anyway
            handle = comm.all_reduce(tmp, op, what=what, async_op=True)
            self._pending.append(_Pending(b, handle, None if tmp is buf else tmp, tmp))
        else:
            if self.mode == "reduce_scatter":
                inp = self.full_grads[position].to(wire)  # no copy when the dtypes agree
                if (self.predivide is not None or first) and inp is self.full_grads[position]:
                    inp = inp.clone()  # the other ranks' parts of the local gradient stay as computed
            else:
                inp = self._staging.pop(position, None)
                if inp is None:  # no parameter of the bucket got a gradient on this rank
                    inp = b.flat_param.new_zeros(b.padded_numel, dtype=wire)
                else:  # what no gradient wrote: slots without one this backward, and the padding
                    got = self._got[position]
                    for i, s in enumerate(b.slots):
                        if i not in got:
                            inp[s.offset : s.offset + s.numel].zero_()
                    inp[b.numel :].zero_()
                    inp = inp.to(wire)  # no copy unless the step's micro-batches accumulated in a wider dtype
            self._prescale(inp)
            if first:
                inp.div_(comm.size)
            out = inp.new_empty(b.shard_numel)
            handle = comm.reduce_scatter(out, inp, op, what=what, async_op=True)
            self._pending.append(_Pending(b, handle, out, inp))
        # Older reductions had a whole bucket's backward to finish: fold them in now, so that their
        # full-size staging buffers do not outlive the next bucket (at most one stays in flight).
        while len(self._pending) > 1:
            self._finish(self._pending.pop(0))

    def _prescale(self, t: torch.Tensor) -> None:
        if self.predivide is not None and self.predivide != 1:
            t.mul_(1.0 / self.predivide)  # DeepSpeed multiplies by the reciprocal: the same rounding

    def _postscale(self, t: torch.Tensor, b: Bucket) -> None:
        size = self._comm_of(b).size
        factor = 1.0 if self.predivide is None else self.predivide / size
        if b.expert:  # each rank's expert gradient sums every rank of its expert group's losses
            factor /= self.expert_groups
        if factor != 1.0:
            t.mul_(factor)

    def _finish(self, p: _Pending) -> None:
        assert p.handle is not None
        p.handle.wait()
        position = self._position[p.bucket.index]
        if p.out is None:  # reduced in place in the gradient buffer
            self._postscale(self.full_grads[position], p.bucket)
            return
        self._postscale(p.out, p.bucket)
        if self.mode == "all_reduce":
            self.full_grads[position].copy_(p.out)
        elif self.mode == "reduce_scatter":
            lo, hi = p.bucket.shard_range
            self.full_grads[position][lo:hi].copy_(p.out)
        elif self.grad_files is not None and position in self.grad_files.on_disk:
            # to its swap file ([Note: gradient offload] in offload/gradients.py); a bucket graph mode once reduced
            # stays in memory, also when a backward that followed only direct module calls reduces it here
            self.grad_files.fold(position, p.bucket, p.out, self._fresh_shard, self._boundary)
        elif self._fresh_shard:
            self.shard_grads[position].copy_(p.out)
        else:
            self.shard_grads[position].add_(p.out)
        if self.host_copies is not None and self._boundary and self.replicate is None:  # complete: to the host
            self.host_copies.bucket_reduced(position, self.shard_grad(p.bucket))
        if self.replicate is not None and self._boundary and not p.bucket.expert:  # expert buckets: never replicated
            self._launch_replica(p.bucket)

    def _launch_replica(self, b: Bucket) -> None:
        """All-reduce this rank's complete gradient shard of ``b`` across the replicas ([Note: hybrid gradient
        reduction])."""
        grad = self.shard_grad(b)
        wire = self._wire_dtype(b)
        tmp = grad if grad.dtype == wire else grad.to(wire)
        what = f"gradient shard of bucket {b.index} across replicas"
        handle = self.replicate.all_reduce(tmp, Reduce.AVG, what=what, async_op=True)
        self._replica_pending.append((handle, grad, tmp))

    def end_backward(self, unwinding: bool = False) -> None:
        """Launch what is left in order and wait for every reduction of this backward.

        ``unwinding``: backward raised. If a collective of these groups failed, that failure is what backward is
        raising: nothing more is launched nor waited for, see [Note: no collective after a failure] in
        :mod:`shardtrain.distributed.communicator` (any other error still reduces what is left, so that the peers'
        collectives complete). A bucket counts as launched before its ``_launch`` returns: the launch issues the
        collective, then may raise from waiting for an older one; launching it again here sent its chunks a second time
        under the next tag, where a surviving peer expected another bucket's."""
        if unwinding and self._failed():
            self._reset_backward()
            return
        if self._active():
            while self._next < len(self.launch_order):
                self._next += 1
                self._launch(self.launch_order[self._next - 1])
        for p in self._pending:
            self._finish(p)
        if self.replicate is not None and self._boundary:
            for position in sorted(self._external):  # reduced by the captured graph (see hand_over)
                self._launch_replica(self.buckets[position])
            for handle, grad, tmp in self._replica_pending:
                handle.wait()
                if tmp is not grad:
                    grad.copy_(tmp)
        self._replica_pending.clear()
        if self.host_copies is not None and self._boundary:  # complete only now (replicas), or already copied
            self.host_copies.backward_done(
                {p: self.shard_grad(b) for p, b in enumerate(self.buckets) if p not in self._external}
            )
        if self.sharded_grads and self._active():
            self._fresh_shard = False
            complete = len(self._observed) == len(self.buckets) - len(self._external)
            if complete and self._observed != self.launch_order:
                self.order_departed = True
                self._proposal = list(self._observed)
        self._reset_backward()

    def unreduced_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """During a backward that has launched no reduction yet (overlap off, as under pipeline parallelism):
        ``param``'s gradient on this rank, accumulated over the backward's micro-batches, as a view that the
        reduction will read; None if none arrived. What a weight tied across pipeline stages is summed in ([Note:
        weights tied across stages] in ``pipeline_parallel/cut.py``)."""
        if self._launched or self._pending:
            raise ShardtrainError("unreduced_grad after this backward's reductions were launched")
        for position, bucket in enumerate(self.buckets):
            for index, slot in enumerate(bucket.slots):
                if slot.param is not param:
                    continue
                if index not in self._got[position]:
                    return None
                if not self.sharded_grads:
                    return self._grad_view(self.full_grads[position], slot)
                return self._staging[position][slot.offset : slot.offset + slot.numel].view(slot.param.shape)
        raise ShardtrainError("unreduced_grad of a parameter in none of the reducer's buckets")

    def _failed(self) -> bool:
        comms = (self.comm, self.replicate, self.order_comm, self.expert_comm)
        return any(c is not None and c.failure is not None for c in comms)

    def _reset_backward(self) -> None:
        self._replica_pending.clear()
        self._pending.clear()
        self._staging.clear()
        self._in_backward = False

    def settle_order_later(self, departed: torch.Tensor) -> None:
        """``departed``: this step's flag, all-reduced over the ranks (non-zero: a rank departed), still on the
        device. It is settled at the next step, and the last step's flag now (see [Note: reading device values a
        step later]): every rank reads the same value at the same step, so the exchange stays collective. A flag
        raised before the last exchange describes the order that exchange replaced: it is dropped, not exchanged
        again (on NCCL each exchange is an object all-gather, which synchronizes)."""
        previous, self._order_read = self._order_read, (HostRead(departed), self._exchanges)
        if previous is not None:
            flag, exchanges = previous
            if exchanges == self._exchanges:
                self.settle_order(flag.values()[0] > 0)

    def settle_order(self, departed_anywhere: bool) -> None:
        """At a step, after the ranks learned whether any of them saw gradients complete in another order than
        ``launch_order`` (see [Note: collective order]): if so, exchange the observed orders and adopt them when
        every rank observed the same one. Collective when ``departed_anywhere``."""
        if not departed_anywhere:
            return
        mine = self._proposal if self.order_departed else None
        self._exchanges += 1
        everyone = self.order_comm.all_gather_object(mine, what="observed gradient order")
        if all(o is not None and o == everyone[0] for o in everyone):
            self.launch_order = list(everyone[0])
        self.order_departed = False
        self._proposal = None

    # -- after the step --------------------------------------------------------------------------
    def shard_grad(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced gradient chunk of bucket ``b`` (valid after a boundary backward)."""
        if self.sharded_grads:
            return self.shard_grads[self._position[b.index]]
        lo, hi = b.shard_range
        return self.full_grads[self._position[b.index]][lo:hi]

    def param_grad(self, b: Bucket, i: int) -> torch.Tensor:
        """The (reduced, at stage 0) full gradient of slot ``i`` of bucket ``b``, shaped like the parameter."""
        return self._grad_view(self.full_grads[self._position[b.index]], b.slots[i])

    @property
    def grads_zeroed(self) -> bool:
        """Stages 2-3: no reduction has reached the gradient shards since they were zeroed (they hold zeros)."""
        return self._fresh_shard

    def has_gradient(self, param: torch.Tensor) -> bool:
        """Whether ``param`` required grad at a backward since the gradients were last zeroed: where torch.optim
        would find its ``.grad`` set (see [Note: parameters frozen after initialize] in zero/optimizer.py)."""
        return id(param) in self._trained

    def zero_grads(self) -> None:
        self._trained.clear()
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
        if self.host_copies is not None:
            self.host_copies.invalidate()

    def grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.full_grads + self.shard_grads)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _tp_sum(tp_comm: Communicator, name: str, grad: torch.Tensor) -> torch.Tensor:
    out = grad.clone()
    tp_comm.all_reduce(out, Reduce.SUM, what=f"tensor-parallel partial gradient of {name!r}")
    return out


# [Note: low-precision reductions divide first]
# DeepSpeed's ZeRO 1-2 (``average_tensor``) and ZeRO-3 (``reduce_scatter_coalesced``) divide each gradient bucket by
# the group's size *before* the summing reduce-scatter. In fp16 or bf16 (the reduction dtype by default, as in
# DeepSpeed) that decides whether a sum near the dtype's largest value overflows: summed first, two ranks' fp16
# values above 32752 give inf and the step is skipped, divided first they do not. So a reduce-scatter in a low-
# precision dtype divides first (``div_``, DeepSpeed's rounding) and sums, eager and in graphs alike; fp32 reductions
# and stage 0's all-reduce (DeepSpeed's ``allreduce_bucket`` sums, then divides) average as the backend does, and
# ``prescale_gradients`` / ``gradient_predivide_factor`` keep their own rule (:func:`gradient_predivide`).
LOW_PRECISION = (torch.float16, torch.bfloat16)


def divides_first(predivide: float | None, wire: torch.dtype) -> bool:
    """Whether a reduce-scatter in ``wire`` divides by the group's size before it sums (see [Note: low-precision
    reductions divide first]); ``predivide``: the prescale factor, whose own rule wins when given."""
    return predivide is None and wire in LOW_PRECISION
