"""Optimizer state in host memory or in swap files, stepped one sub-group at a time (DeepSpeed's ZeRO-Offload
and ZeRO-Infinity for the optimizer).

[Note: sub-group stepping]
A rank's stepped tensors (fp32 fragments, or their masters; [Note: optimizer fragments]) are cut, in the wrapper's
order, into *sub-groups* of about ``sub_group_size`` elements (never splitting a fragment). The user's optimizer steps
one sub-group at a time: only its tensors carry a ``.grad``, and torch optimizers skip tensors without one. Updates are
element-wise ([Note: element-wise optimizers]) and torch's CPU optimizers loop over tensors, so values are bitwise one
call's. Scalar state (``step``) stays in ``optimizer.state``; an offloaded sub-group's element-wise state is there only
while stepped. ``ratio`` < 1 offloads the first sub-groups holding that fraction of the elements. Step hooks registered
on the optimizer run once per sub-group.

[Note: sub-groups of whole buckets]
An optimizer whose step is collective over the shard group (Muon's owners, [Note: one owner per matrix] in
zero/muon_owners.py: two collectives per bucket; LAMB's shard sums, one all-reduce per param group and step call)
needs every rank to step the same sub-groups in the same order, each holding the same buckets: a rank's fragments
differ in size from another's, so sub-groups cut by them differ, and the collectives would pair different buckets or
hang. For such an optimizer sub-groups are cut at bucket boundaries by each bucket's chunk size (the same on every
rank), and whether one is offloaded (``ratio``) is decided on chunk sizes too. Within a sub-group every rank holds a
fragment (maybe empty) of every parameter of its buckets, so the step's collectives line up, and each tensor's
whole update (or norm) is the one a single step over all tensors would make: the values are bitwise those of one
call's step.

[Note: swap pipeline]
With ``device: nvme`` each (stepped tensor, state key) has one file in the rank's scratch directory, open only while
read or written ([Note: bounded descriptors] in :mod:`shardtrain.offload.swap`). A pool of ``buffer_count`` byte
buffers holds sub-groups: while sub-group i steps, reads of the next (as many as free buffers allow) and write-backs
of the previous run on a small thread pool (``os.preadv``/``os.pwritev`` release the GIL). A buffer is reused only
after its write finished, so in-memory element-wise state never exceeds ``buffer_count`` sub-groups, except on a
tensor's first step, when the optimizer creates its state itself (one more sub-group). A buffer is reused for a
sub-group needing at most ``FRAME_SLACK`` less, else replaced at the exact size: buffers that only grew would each
reach the largest sub-group's size. The pool is last in, first out, so with fewer sub-groups than buffers no more
buffers than sub-groups are allocated. Every rank agrees on the step's outcome (one small object all-gather), so a
full disk on one rank raises on all, naming rank and file, instead of the others waiting for a collective.

[Note: offloaded masters]
Under mixed precision with ``nvme`` the fp32 masters go to the files too (key ``master``), so a rank keeps neither the 4
bytes of master nor the 8 of Adam moments per element. A master stays the same tensor object (``optimizer.state`` and
the param groups are keyed on it): between steps its storage is empty (``Tensor.set_``), during its sub-group's step a
view of the buffer, after which it refreshes the compute-dtype fragment. Readers and writers between steps (loading
weights, ``engine.gathered(modifier_rank=...)``, checkpoints) get its file mapped shared, never the whole state
(:meth:`OptimizerOffload.master_view`). In fp32 training the stepped tensor is the parameter's own fragment. Swap files
and :class:`OffloadError`: :mod:`shardtrain.offload.swap`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardtrain.distributed.communicator import Communicator
from shardtrain.offload.gradients import GradOffload
from shardtrain.offload.host_copies import CopyStreams, HostCopies, host_block, pack_blocks
from shardtrain.offload.one_pass import OnePassStep
from shardtrain.offload.parameters import release_mapped
from shardtrain.offload.swap import ALIGN, GRAD, OffloadError, SwapFiles
from shardtrain.zero.layout import fragment_places, fragment_tensor

if TYPE_CHECKING:
    from shardtrain.zero.layout import Bucket

Rescale = Callable[[list[torch.Tensor]], None]
"""Unscales and clips, in place, gradients the stepper reads itself (from swap files, or host copies of raw shards)
by the factors of the step ([Note: the one step] in :mod:`shardtrain.zero.optimizer`)."""


# -- sub-groups ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubGroup:
    """Consecutive stepped tensors (indices into the wrapper's list) stepped together."""

    index: int
    members: tuple[int, ...]
    numel: int
    offloaded: bool


def make_sub_groups(numels: list[int], size: int, ratio: float = 1.0) -> list[SubGroup]:
    """Cut tensors of ``numels`` elements, in order, into sub-groups of at most ``size`` elements (a larger
    tensor alone); the first ones holding ``ratio`` of all elements are offloaded."""
    groups: list[list[int]] = []
    current: list[int] = []
    count = 0
    for i, n in enumerate(numels):
        if current and count + n > max(size, 1):
            groups.append(current)
            current, count = [], 0
        current.append(i)
        count += n
    if current:
        groups.append(current)
    total = sum(numels)
    out, offloaded_so_far = [], 0
    for gi, members in enumerate(groups):
        n = sum(numels[i] for i in members)
        offloaded = ratio >= 1.0 or offloaded_so_far + n <= ratio * total
        offloaded_so_far += n if offloaded else 0
        out.append(SubGroup(gi, tuple(members), n, offloaded))
    return out


@dataclass(frozen=True)
class WholeBuckets:
    """Where each stepped tensor lies, for an optimizer whose step is collective ([Note: sub-groups of whole
    buckets]): ``bucket[i]``, the position of member ``i``'s bucket (members of a bucket are consecutive), and
    ``chunk[b]``, that bucket's chunk size (elements), the same on every rank of its shard group."""

    bucket: tuple[int, ...]
    chunk: tuple[int, ...]


def whole_bucket_sub_groups(numels: list[int], buckets: WholeBuckets, size: int, ratio: float = 1.0) -> list[SubGroup]:
    """Sub-groups that never split a bucket, cut by the buckets' chunk sizes rather than this rank's fragments, so
    that every rank of the shard group cuts the same ([Note: sub-groups of whole buckets]). ``numels``: each member's
    size here (a sub-group's ``numel``)."""
    runs: list[list[int]] = []  # the members of each bucket, in order
    for i, b in enumerate(buckets.bucket):
        if not runs or buckets.bucket[runs[-1][0]] != b:
            runs.append([])
        runs[-1].append(i)
    by_chunk = make_sub_groups([buckets.chunk[buckets.bucket[run[0]]] for run in runs], size, ratio)
    return [
        SubGroup(g.index, members, sum(numels[i] for i in members), g.offloaded)
        for g in by_chunk
        for members in [tuple(i for r in g.members for i in runs[r])]
    ]


# -- the offloaded optimizer step ------------------------------------------------------------------


FRAME_SLACK = 1 / 8  # a buffer is reused for a sub-group needing at most this much less than it holds


@dataclass
class _Frame:
    """One reusable byte buffer holding a sub-group's element-wise state while it is read, stepped, written."""

    data: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))

    def ensure(self, nbytes: int, pin: bool) -> None:
        """Hold ``nbytes``: the buffer is kept when it is large enough and not more than ``FRAME_SLACK`` larger,
        else replaced by one of exactly ``nbytes`` (see [Note: swap pipeline]: a buffer that only grew would make
        every one of them as large as the largest sub-group)."""
        have = self.data.numel()
        if have < nbytes or have > nbytes * (1 + FRAME_SLACK):
            self.data = torch.empty(0, dtype=torch.uint8)  # free the old one before allocating the new one
            self.data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _elementwise(v: Any, shape: torch.Size) -> bool:
    return torch.is_tensor(v) and v.dim() > 0 and v.shape == shape


def follow_device(state: dict[str, Any] | None, stepped: torch.Tensor) -> None:
    """Move ``state``'s element-wise tensors to ``stepped``'s device, in place. State an optimizer made at its
    construction (Adagrad's ``sum``) was made where the parameter was, the GPU, and cut into fragments there;
    with offload the optimizer steps a host master, and the swap files read and write host memory."""
    for k, v in (state or {}).items():
        if _elementwise(v, stepped.shape) and v.device != stepped.device:
            state[k] = v.to(stepped.device)


MASTER = "master"  # the file key of an offloaded fp32 master (see [Note: offloaded masters])


class OptimizerOffload:
    """Steps ``optimizer`` one sub-group at a time over ``stepped`` (see [Note: sub-group stepping]); with
    ``files``, element-wise state of offloaded sub-groups lives in them (see [Note: swap pipeline])."""

    one_pass: bool = True
    """Step each sub-group in one pass over memory where the optimizer allows it ([Note: one pass over a sub-group]
    in :mod:`shardtrain.offload.one_pass`). False: the multi-pass step, kept as the reference the tests and
    ``bench/bench_offload.py`` compare against (bitwise the same numbers)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stepped: list[torch.Tensor],
        groups: list[SubGroup],
        files: SwapFiles | None,
        buffer_count: int,
        world: Communicator,
        pin_memory: bool = False,
        fragments: list[torch.Tensor] | None = None,
        grads: GradOffload | None = None,
        copies: HostCopies | None = None,
    ) -> None:
        """``grads``: the gradient shards in swap files too (see [Note: gradient offload]); ``copies``: a run whose
        fragments are on a device and whose masters are on the host (CUDA), the copies between them overlapping the
        GPU (see [Note: overlapped offload] in :mod:`shardtrain.offload.host_copies`). Both are built before the
        reducer by :func:`build_gradient_sinks`, over the same ``stepped`` and ``fragments``."""
        self.optimizer, self.stepped, self.groups, self.files = optimizer, stepped, groups, files
        self.shapes = [t.shape for t in stepped]  # an offloaded master is empty between steps
        # mixed precision: the compute-dtype fragment each stepped fp32 master refreshes after its step
        self.fragments = fragments
        self.holds_masters = fragments is not None and files is not None
        self.world, self.pin = world, pin_memory and torch.cuda.is_available()
        self.buffer_count = buffer_count
        self._index = {id(s): i for i, s in enumerate(stepped)}
        self._one_pass_step = OnePassStep(optimizer)
        self.refreshed = [False] * len(stepped)
        """Per member: its compute-dtype fragment was written by this step's one pass (the caller's refresh skips
        it)."""
        for s in stepped:
            follow_device(optimizer.state.get(s), s)
        self._group_of = {i: g for g in groups for i in g.members}
        # element-wise state on disk: member -> {key: dtype}
        self._saved: dict[int, dict[str, torch.dtype]] = {}
        # last in, first out: the buffer given back last is taken first, so buffers the pipeline never needs at once
        # are never allocated. With fewer sub-groups than buffers (one sub-group with DeepSpeed's default
        # sub_group_size on a model of under 1e9 parameters per rank), first in, first out took a fresh buffer on
        # each of ``buffer_count`` steps and ended with that many copies of the sub-group's state in memory
        self._frames: queue.LifoQueue[_Frame] = queue.LifoQueue()
        for _ in range(buffer_count):
            self._frames.put(_Frame())
        self.grads = grads  # gradient shards in swap files too
        self.copies = copies  # gradients to the host and parameters back
        self._copied_after = None  # the compute-stream event of this step that copies back wait for
        self._held_lock = threading.Lock()
        self._busy_bytes = 0  # bytes of buffers taken out of the pool
        self._extra_bytes = 0  # state the optimizer created itself, on its way to the files
        self.peak_held_bytes = 0
        """Most bytes of element-wise state this object held in memory at once (buffers + first-step state)."""
        if files is not None:  # state made at construction (Adagrad's ``sum``) goes to the files at once
            for g in groups:
                if g.offloaded:
                    for i in g.members:
                        self._write_new(i, self._detach_state(i))
                        if self.holds_masters:
                            self._write_new(i, {MASTER: stepped[i].detach()})
                            self._park(i)

    # -- accounting (read by tests and the benchmark) --
    def held_bytes(self) -> int:
        """Bytes of the buffers allocated now plus first-step state not yet written: what is in memory."""
        frames = sum(f.data.untyped_storage().nbytes() for f in list(self._frames.queue))
        return frames + self._busy_bytes + self._extra_bytes

    def _note_peak(self) -> None:
        with self._held_lock:
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes())

    @property
    def offloaded(self) -> bool:
        return self.files is not None

    def is_offloaded(self, stepped: torch.Tensor) -> bool:
        i = self._index.get(id(stepped))
        return self.files is not None and i is not None and self._group_of[i].offloaded

    # -- state access for checkpoints --
    def state_of(self, stepped: torch.Tensor) -> dict[str, Any]:
        """The full optimizer state of one stepped tensor: element-wise state of an offloaded one mapped from
        its files (read page by page as it is used)."""
        state = dict(self.optimizer.state.get(stepped, {}))
        if self.is_offloaded(stepped):
            i = self._index[id(stepped)]
            for key, dtype in self._saved.get(i, {}).items():
                if key != MASTER:
                    state[key] = self.files.mapped(i, key, dtype, self.shapes[i].numel()).view(self.shapes[i])
        return state

    def master_view(self, stepped: torch.Tensor) -> torch.Tensor:
        """What ``stepped`` holds: itself, or for an offloaded master its file mapped shared (reads fetch pages,
        writes go to the file)."""
        if not (self.holds_masters and self.is_offloaded(stepped)):
            return stepped
        i = self._index[id(stepped)]
        return self.files.mapped(i, MASTER, torch.float32, self.shapes[i].numel(), shared=True).view(self.shapes[i])

    def set_state(self, stepped: torch.Tensor, state: dict[str, Any]) -> None:
        """Replace the optimizer state of one stepped tensor; element-wise state of an offloaded one goes to its
        files at once and is not kept."""
        if not self.is_offloaded(stepped):
            if state:
                self.optimizer.state[stepped] = state
            else:
                self.optimizer.state.pop(stepped, None)
            return
        i = self._index[id(stepped)]
        elementwise = {k: v for k, v in state.items() if _elementwise(v, self.shapes[i])}
        scalars = {k: v for k, v in state.items() if k not in elementwise}
        master = self._saved.get(i, {}).get(MASTER)
        self._saved[i] = {MASTER: master} if master is not None else {}
        self._write_new(i, elementwise)
        if scalars:
            self.optimizer.state[stepped] = scalars
        else:
            self.optimizer.state.pop(stepped, None)

    def on_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A device scalar (the clip coefficient) on the host, for the host-stepped gradients; else ``t``."""
        if t is None or self.copies is None or t.device.type == "cpu":
            return t
        return self.copies.host_scalar(t)

    # -- the step --
    @property
    def takes_clip(self) -> bool:
        """Whether the caller leaves the clip coefficient of the in-memory gradients to :meth:`step` (its
        ``factors``), which applies it in the one pass ([Note: one pass over a sub-group]): gradients in memory,
        stepped on the host as they are (no swap files, no copies)."""
        on_host = all(s.device.type == "cpu" for s in self.stepped)  # else the caller's device clips them
        return (
            self.one_pass
            and on_host
            and self.files is None
            and self.copies is None
            and OnePassStep.supports(self.optimizer)
        )

    def step(
        self,
        grads: list[torch.Tensor | None],
        on_disk: frozenset[int] = frozenset(),
        transform: Rescale | None = None,
        factors: tuple[torch.Tensor | float, ...] | None = None,
    ) -> None:
        """Step every sub-group with ``grads[i]`` as the gradient of ``stepped[i]`` (None: not stepped). Members in
        ``on_disk`` have their gradient in a swap file instead (see [Note: gradient offload]): it is read with the
        sub-group's state and ``transform(list of gradients)`` (unscale, clip) applied in place before the step.
        ``factors``: the multiplications still due, in order, on the gradients this step scales itself: with
        :attr:`takes_clip`, the in-memory ones' clip coefficient; with copies, the raw host copies' unscale and clip
        (what ``transform`` does to them, done in the one pass instead where it runs; None: not given, ``transform``
        scales them)."""
        grads = list(grads)
        self.refreshed = [False] * len(self.stepped)
        if self.copies is not None:  # the buckets backward did not copy, from the step's gradients
            self._copied_after = self.copies.prepare(grads)
        try:
            if self.files is None:
                for g in self.groups:
                    self._step_group(g, grads, transform, factors)
                return
            self._files_step(grads, on_disk, transform)
        finally:
            if self.copies is not None:  # the all-gathers and the next forward see every copy back
                self.copies.finish()

    def _files_step(self, grads: list[torch.Tensor | None], on_disk: frozenset[int], transform: Rescale | None) -> None:
        error = None
        try:
            self._pipelined_step(grads, on_disk, transform)
        except Exception as err:  # shared with every rank below
            error = str(err) if isinstance(err, OffloadError) else f"{type(err).__name__}: {err}"
            cause = err
        outcomes = self.world.all_gather_object(error, what="offloaded optimizer step outcome")
        failed = [e for e in outcomes if e is not None]
        if failed:
            message = "offloaded optimizer step failed: " + "; ".join(failed)
            if error is not None:
                raise OffloadError(message) from cause
            raise OffloadError(message)

    def _step_members(self, members: list[int], grads: list[torch.Tensor]) -> None:
        """The optimizer's step over ``members`` alone, with ``grads`` as their gradients (the others have none)."""
        for i, g in zip(members, grads):
            self.stepped[i].grad = g
        try:
            self.optimizer.step()
        finally:
            for i in members:
                self.stepped[i].grad = None

    def _one_pass_ready(self, members: list[int], grads: list[torch.Tensor], outs: list[torch.Tensor | None]) -> bool:
        """Whether ``members`` step in one pass now ([Note: one pass over a sub-group]): enabled, the optimizer's
        update and state allow it, every tensor flat in memory on the host."""
        if not self.one_pass or not members:
            return False
        tensors = [self.stepped[i] for i in members]
        flat = tensors + list(grads) + [o for o in outs if o is not None]
        if not all(t.is_contiguous() and t.device.type == "cpu" for t in flat):
            return False
        if any(o is not None and o.numel() != t.numel() for o, t in zip(outs, tensors)):
            return False
        return self._one_pass_step.ready(tensors)

    def _step_group(
        self,
        group: SubGroup,
        grads: list[torch.Tensor | None],
        transform: Rescale | None = None,
        factors: tuple[torch.Tensor | float, ...] | None = None,
    ) -> None:
        members = [i for i in group.members if grads[i] is not None]
        if self.copies is not None and self.copies.covers(group.members):
            self._step_host_group(group, members, transform, factors)
            return
        host = [grads[i].to(self.stepped[i].device, non_blocking=True) for i in members]  # CUDA: to the host
        if any(g.device != grads[i].device for g, i in zip(host, members)) and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # device-to-host copies done before the CPU reads them
        # the fragments refreshed in the pass: all of them with separate masters, whoever would refresh them after
        outs = [
            self.fragments[i] if self.fragments is not None and self.fragments[i].numel() else None for i in members
        ]
        passed = set()
        factors = factors or ()
        if self._one_pass_ready(members, host, outs):
            self._one_pass_step.step([self.stepped[i] for i in members], host, outs, [factors] * len(members))
            passed = {i for i, o in zip(members, outs) if o is not None}
            for i in passed:
                self.refreshed[i] = True
        else:
            with torch.no_grad():
                present = [g for g in host if g.numel()]
                for f in factors:  # the clip the caller left to this step, as it would have applied it
                    if present:
                        torch._foreach_mul_(present, f)
            self._step_members(members, host)
        if self.holds_masters:  # refresh the compute-dtype fragments while the masters are in memory
            with torch.no_grad():
                for i in group.members:
                    if self.fragments[i].numel() and i not in passed:
                        self.fragments[i].copy_(self.stepped[i].view_as(self.fragments[i]))
        # parameter offload: the pages of this sub-group's shards leave memory now, not after the whole step
        release_mapped([self.stepped[i] for i in members] + [self.fragments[i] for i in members if self.fragments])

    def _step_host_group(
        self,
        group: SubGroup,
        members: list[int],
        transform: Rescale | None,
        factors: tuple[torch.Tensor | float, ...] | None = None,
    ) -> None:
        """A sub-group stepped on the host with overlapped copies (see [Note: overlapped offload]): wait for its
        buckets' gradient copies only, unscale and clip the raw ones (``transform``, or ``factors`` in the one pass),
        step, send the values back (those rounded on the host written in the one pass)."""
        copies = self.copies
        host, raw = copies.host_grads(members)
        outs = [copies.staged(i) for i in members]
        # the one pass scales the raw copies itself: by the factors the caller gave for them
        one_pass = (transform is None or factors is not None) and self._one_pass_ready(members, host, outs)
        if not one_pass and transform is not None and raw:
            transform(raw)
        copies.before_step(group.members)  # its masters and copy-back buffers are free to be rewritten
        if one_pass:
            raw_ids = {id(g) for g in raw}
            due = [(factors or ()) if id(g) in raw_ids else () for g in host]
            self._one_pass_step.step([self.stepped[i] for i in members], host, outs, due)
            copies.send_back(
                group.members, self._copied_after, staged={i for i, o in zip(members, outs) if o is not None}
            )
        else:
            self._step_members(members, host)
            copies.send_back(group.members, self._copied_after)

    def _park(self, i: int) -> None:
        """An offloaded master holds no memory between steps (same tensor object: the optimizer keys on it)."""
        self.stepped[i].set_(torch.empty(0, dtype=self.stepped[i].dtype, device=self.stepped[i].device))

    def _regions(self, group: SubGroup) -> tuple[list[tuple[int, str, torch.dtype, int]], int]:
        """(member, key, dtype, byte offset) of every saved element-wise state of ``group``, and the bytes."""
        regions, offset = [], 0
        for i in group.members:
            for key, dtype in sorted(self._saved.get(i, {}).items()):
                regions.append((i, key, dtype, offset))
                nbytes = self.shapes[i].numel() * dtype.itemsize
                offset += -(-nbytes // ALIGN) * ALIGN
        return regions, offset

    def _take_frame(self, block: bool) -> _Frame | None:
        try:
            frame = self._frames.get(block=block)
        except queue.Empty:
            return None
        with self._held_lock:
            self._busy_bytes += frame.data.untyped_storage().nbytes()
        return frame

    def _give_frame(self, frame: _Frame) -> None:
        with self._held_lock:
            self._busy_bytes -= frame.data.untyped_storage().nbytes()
        self._frames.put(frame)

    def _read_group(
        self, group: SubGroup, frame: _Frame, on_disk: frozenset[int] = frozenset()
    ) -> dict[int, dict[str, torch.Tensor]]:
        regions, nbytes = self._regions(group)
        for i in group.members:  # gradients in swap files come in the same buffer, after the state
            if i in on_disk and self.shapes[i].numel():
                regions.append((i, GRAD, torch.float32, nbytes))
                nbytes += -(-self.shapes[i].numel() * 4 // ALIGN) * ALIGN
        with self._held_lock:
            self._busy_bytes -= frame.data.untyped_storage().nbytes()
            frame.ensure(nbytes, self.pin)
            self._busy_bytes += frame.data.untyped_storage().nbytes()
        self._note_peak()
        views: dict[int, dict[str, torch.Tensor]] = {}
        for i, key, dtype, offset in regions:
            n = self.shapes[i].numel()
            view = frame.data[offset : offset + n * dtype.itemsize].view(dtype).view(self.shapes[i])
            if key == GRAD:
                self.grads.read(i, view.view(-1))
            else:
                self.files.read(i, key, view)
            views.setdefault(i, {})[key] = view
        return views

    def _write_group(self, group: SubGroup, frame: _Frame, out: dict[int, dict[str, torch.Tensor]]) -> None:
        try:
            for i, state in out.items():
                for key, t in state.items():
                    self.files.write(i, key, t)
        finally:
            self._give_frame(frame)

    def _detach_state(self, i: int) -> dict[str, torch.Tensor]:
        """Remove and return the element-wise state of ``stepped[i]`` from the optimizer."""
        s = self.stepped[i]
        state = self.optimizer.state.get(s)
        if not state:
            return {}
        out = {k: v for k, v in state.items() if _elementwise(v, self.shapes[i])}
        for k in out:
            del state[k]
        if not state:
            del self.optimizer.state[s]
        return out

    def _write_new(self, i: int, state: dict[str, torch.Tensor]) -> None:
        """State that is not in a buffer (made by the optimizer, or loaded): written at once, then dropped."""
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        with self._held_lock:
            self._extra_bytes += nbytes
        self._note_peak()
        try:
            for key, t in state.items():
                self.files.write(i, key, t)
                self._saved.setdefault(i, {})[key] = t.dtype
        finally:
            with self._held_lock:
                self._extra_bytes -= nbytes

    def _pipelined_step(
        self,
        grads: list[torch.Tensor | None],
        on_disk: frozenset[int] = frozenset(),
        transform: Rescale | None = None,
    ) -> None:
        offloaded = [g for g in self.groups if g.offloaded]
        reads: dict[int, tuple[_Frame, Future]] = {}
        writes: list[Future] = []
        issued = 0

        def issue(block: bool) -> bool:
            nonlocal issued
            if issued >= len(offloaded):
                return False
            frame = self._take_frame(block)
            if frame is None:
                return False
            reads[issued] = (frame, self.files.submit(self._read_group, offloaded[issued], frame, on_disk))
            issued += 1
            return True

        try:
            while issue(block=False):  # read ahead while buffers are free
                pass
            for g in self.groups:  # resident sub-groups step while the first reads run
                if not g.offloaded:
                    loaded = [i for i in g.members if i in on_disk]
                    for i in loaded:  # their gradients are read here, one sub-group at a time
                        grads[i] = self.grads.load(i).view(self.shapes[i])
                    if transform is not None and self.copies is None:
                        transform([grads[i] for i in loaded if grads[i].numel()])
                    self._step_group(g, grads, transform)
                    for i in loaded:
                        grads[i] = None
            for k, group in enumerate(offloaded):
                while issued <= k:
                    issue(block=True)
                frame, future = reads.pop(k)
                try:
                    views = future.result()
                except BaseException:
                    self._give_frame(frame)
                    raise
                read_grads, read_members = [], []
                for i, state in views.items():
                    g = state.pop(GRAD, None)
                    if g is not None:
                        grads[i] = g
                        read_grads.append(g)
                        read_members.append(i)
                    master = state.pop(MASTER, None)
                    if master is not None:
                        self.stepped[i].set_(master)
                    if state:
                        self.optimizer.state.setdefault(self.stepped[i], {}).update(state)
                try:
                    try:
                        if transform is not None and read_grads:
                            transform(read_grads)
                        self._step_group(group, grads, transform)
                    finally:
                        for i in read_members:  # the buffer is written back and reused: no reference stays
                            grads[i] = None
                        out = {i: self._detach_state(i) for i in group.members}
                        if self.holds_masters:
                            for i in group.members:
                                out[i][MASTER] = self.stepped[i].detach()
                                views.setdefault(i, {})[MASTER] = out[i][MASTER]
                                self._park(i)
                    # state the optimizer created on this step (not in the buffer) is written from where it is
                    for i, state in out.items():
                        fresh = {key: t for key, t in state.items() if key not in views.get(i, {})}
                        for key in fresh:
                            del state[key]
                        if fresh:
                            self._write_new(i, fresh)
                except BaseException:
                    self._give_frame(frame)
                    raise
                writes.append(self.files.submit(self._write_group, group, frame, out))
                while issue(block=False):
                    pass
            for w in writes:
                w.result()
        finally:  # on failure: no thread may still fill a buffer after this returns
            for frame, future in reads.values():
                with contextlib.suppress(BaseException):
                    future.result()
                self._give_frame(frame)
            for w in writes:
                with contextlib.suppress(BaseException):
                    w.result()

    def close(self) -> None:
        """Stop the I/O threads and the one pass's workers, close the files (the scratch directory is removed by
        its owner)."""
        self._one_pass_step.close()
        if self.files is not None:
            self.files.close()
        while not self._frames.empty():
            self._frames.get_nowait().data = torch.empty(0, dtype=torch.uint8)


# -- wiring ----------------------------------------------------------------------------------------


def host_masters(
    masters: dict[int, torch.Tensor] | None,
    fragments: dict[int, torch.Tensor],
    pin: bool,
    sub_group_size: int | None = None,
    ratio: float = 1.0,
) -> dict[int, torch.Tensor]:
    """fp32 masters in host memory for a CUDA run whose optimizer state is offloaded: the step runs on the CPU
    (see docs/offload.md). ``fragments``: the fp32 fragments in the order they are stepped, used when there are no
    separate masters. ``ratio`` < 1 (``device: cpu``, DeepSpeed's partial offload): only the sub-groups of the
    first ``ratio`` of the elements go to the host, the others stay where they are and step on the GPU (their
    state is made there). The host copies are views into a few large blocks, one per sub-group at least (so that a
    sub-group whose masters leave memory frees its blocks), pinned with ``pin``: pinned memory allocated per
    fragment would cost one call into the CUDA driver and a power-of-two rounding per fragment."""
    source = masters if masters is not None else fragments
    keys = list(fragments)
    numels = [source[k].numel() for k in keys]
    groups = make_sub_groups(numels, sub_group_size or max(sum(numels), 1), ratio)
    to_host = [i for g in groups if g.offloaded for i in g.members]
    breaks = {g.members[0] for g in groups}
    sizes, where = pack_blocks([numels[i] * 4 for i in to_host], {j for j, i in enumerate(to_host) if i in breaks})
    blocks = [host_block(n, pin) for n in sizes]  # pinned at their exact size (see [Note: overlapped offload])
    out = {k: source[k] for k in keys}  # not offloaded (ratio): the master, or the fp32 fragment itself
    for j, i in enumerate(to_host):
        t = source[keys[i]]
        b, offset = where[j]
        host = blocks[b][offset : offset + numels[i] * 4].view(torch.float32).view(t.shape)
        host.copy_(t)
        out[keys[i]] = host
    return out


@dataclass(frozen=True)
class GradientSinks:
    """Where the reducer sends its complete gradient shards besides its own memory, at most one of: the gradient
    files (``files``, [Note: gradient offload]) or, on a device whose optimizer steps host masters, the host copies
    (``copies``, [Note: overlapped offload]). Built before the reducer, from the layout's buckets and the tensors the
    optimizer wrapper will step, and handed to the reducer and to the optimizer offload."""

    files: GradOffload | None = None
    copies: HostCopies | None = None


def build_gradient_sinks(
    buckets: list[Bucket],
    masters: dict[int, torch.Tensor] | None,
    files: SwapFiles | None,
    streams: CopyStreams | None,
    *,
    sharded_state: bool,
    sharded_grads: bool,
    grad_dtypes: list[torch.dtype],
    read_in_memory: bool,
    host_fragments: bool = False,
    pin_memory: bool = True,
) -> GradientSinks:
    """The gradient sinks of the optimizer offload over the reducer's ``buckets`` (trainable, in its order). The
    stepped tensors are the fp32 ``masters`` (by parameter id) or, without them, the fragments, in the wrapper's
    order (:func:`~shardtrain.zero.layout.fragment_places`); ``sharded_state``: stages 1-3 (fragments are slices of
    the shards), ``sharded_grads``: stages 2-3; ``grad_dtypes``: each bucket's gradient accumulation dtype;
    ``read_in_memory``: tensor parallelism's norm or hybrid sharding's replica all-reduce reads the gradient shards.

    With ``streams`` (CUDA) and separate masters, some of them on the host: the host copies. Else the gradient shards
    go to swap files where that is built: state in files (``files``), gradients sharded and accumulated in the dtype
    stepped (fp32), on the host, and not read in memory. Else gradients stay in memory (no sink).
    ``host_fragments``: the fragments are host shards (parameter offload on the device): the step writes them.
    ``pin_memory``: ``offload_optimizer.pin_memory``, the copies' host buffers page-locked (with ``streams.pins``)."""
    places = fragment_places(buckets)
    fragments = [fragment_tensor(b, i, sharded_state) for b, i in places]
    stepped = [masters[id(b.slots[i].param)] for b, i in places] if masters is not None else fragments
    position = {id(b): k for k, b in enumerate(buckets)}
    # member -> (bucket position, element offset in its shard, length, fragment index)
    where = [(position[id(b)], b.fragments[i].shard_offset, b.fragments[i].length, i) for b, i in places]
    if streams is not None:
        host = [s.device.type == "cpu" for s in stepped]
        if masters is None or not any(host):  # no separate masters, or none on the host: nothing to copy
            return GradientSinks()
        # fragments go back from their page-locked masters themselves (rounded on the device); masters in swap
        # buffers (files) through a compute-dtype buffer
        pins = streams.pins and pin_memory
        direct = [files is None and (not pins or s.is_pinned()) for s in stepped]
        copies = HostCopies(
            streams, [w[:3] for w in where], host, stepped, fragments, direct, host_fragments, pin_memory
        )
        return GradientSinks(copies=copies)
    device = buckets[0].shard.device if buckets else torch.device("cpu")
    if (
        files is None
        or not (sharded_state and sharded_grads)
        or read_in_memory
        or device.type != "cpu"
        or any(d != torch.float32 for d in grad_dtypes)
        or any(s.dtype != torch.float32 for s in stepped)
    ):
        return GradientSinks()
    return GradientSinks(files=GradOffload(files, buckets, where))


def build_optimizer_offload(
    optimizer: torch.optim.Optimizer,
    stepped: list[torch.Tensor],
    device: str,
    sub_group_size: int,
    buffer_count: int,
    ratio: float,
    pin_memory: bool,
    files: SwapFiles | None,
    world: Communicator,
    fragments: list[torch.Tensor] | None = None,
    sinks: GradientSinks | None = None,
    whole_buckets: WholeBuckets | None = None,
) -> OptimizerOffload:
    """Sub-groups over ``stepped`` and, with ``device == "nvme"``, the swap ``files``; ``fragments``: with separate
    fp32 masters, the compute-dtype fragment of each (the masters are then offloaded too); ``sinks``: the gradient
    sinks :func:`build_gradient_sinks` made over the same tensors; ``whole_buckets``: the optimizer's step is
    collective, its sub-groups are whole buckets ([Note: sub-groups of whole buckets])."""
    numels, ratio = [s.numel() for s in stepped], ratio if device == "nvme" else 0.0
    if whole_buckets is not None:
        groups = whole_bucket_sub_groups(numels, whole_buckets, sub_group_size, ratio)
    else:
        groups = make_sub_groups(numels, sub_group_size, ratio)
    sinks = sinks if sinks is not None else GradientSinks()
    return OptimizerOffload(
        optimizer, stepped, groups, files, buffer_count, world, pin_memory, fragments, sinks.files, sinks.copies
    )
