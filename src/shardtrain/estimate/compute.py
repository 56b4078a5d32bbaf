"""Activations and temporaries of one forward and backward, measured on fake tensors.

The model is built under torch's :class:`FakeTensorMode` (no storage anywhere), split for tensor parallelism by
:func:`shardtrain.tensor_parallel.parallelize` over a communicator that only knows its size (collectives on fake
tensors have nothing to move; a gather returns a tensor of the gathered shape), cast to the compute dtype as the
engine casts it, and run forward and backward on one micro-batch under torch's own
:class:`torch.distributed._tools.mem_tracker.MemTracker`, which follows every storage an operator creates or frees
(resizes included). Its peak, less what existed before the forward (parameters, buffers, the gradient buffers
that are model state), is what training adds to the model state: the activations autograd saves, the loss and its
inputs, gradients of activations, and each parameter gradient until the engine takes it.

The engine's gradient path is replayed around that run, because its buffers are alive at the same time as the
activations ([Note: gradient storage per stage] in ``zero/reducer.py``):

* stages 0-1 in fp32, or accumulating in the compute dtype: ``param.grad`` views a persistent flat buffer (model
  state), so autograd accumulates into it;
* stages 0-1 in mixed precision accumulating in fp32: the compute-dtype gradient is added into the fp32 buffer and
  dropped;
* stages 2-3: each gradient is copied into its bucket's staging buffer (``padded_numel`` elements in the
  reduction dtype, made at the bucket's first gradient) and dropped; a complete bucket is launched in bucket order
  with its reduce-scatter output, and the reduction before it finished then (its staging freed): at most two
  buckets' staging buffers are alive, as in the reducer. On gloo (``gloo``: planning for a machine without
  accelerator) the reduce-scatter is the communicator's pairwise exchange, which also receives the group's ``N - 1``
  other copies of this rank's chunk into a buffer alive until the reduction finishes ([Note: bytes on the wire]).

At stage 3 the units' full buffers are replayed too (their parameters exist whole in this run and are counted as
model state; the replay allocates each unit's gathered bytes when the engine gathers it and frees them when it
releases it). gloo's ``all_gather_into_tensor`` gathers into a temporary of the output's size and copies it out
(measured: one unit's bytes more while the gather runs), so with ``gloo`` each gather also allocates and frees the
unit's bytes once. What is not counted here is added by the planner: optimizer-offload buffers, and the optimizer step
(element-wise state exists already; its temporaries are one fragment at a time).
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from shardtrain.activations import HostOffload, apply_checkpointing, keep_matmuls
from shardtrain.errors import ShardtrainError
from shardtrain.estimate import wire
from shardtrain.estimate.experts import GroupedMatmulShapes, has_experts, split_experts
from shardtrain.estimate.sequence import as_fake, install_sequence_parallel, refuse_shared_config, split_batch
from shardtrain.estimate.source import ModelSource, loss_of
from shardtrain.expert_parallel import expert_weights
from shardtrain.plan.policies import NO_PREFETCH, ActivationPolicy, BlockRecompute, PrefetchPolicy
from shardtrain.zero.layout import Bucket
from shardtrain.zero.units import find_unit_modules

FP32 = torch.float32


class _Done:
    def wait(self) -> None:
        return None


@contextmanager
def unpacked_batch() -> Iterator[None]:
    """[Note: the estimate's batch is not packed]
    Given no attention mask in training, transformers (``masking_utils``) looks at the position ids for several
    sequences packed into one row (``find_packed_sequence_indices``: consecutive positions that do not step by one),
    and with none found lets SDPA run causally without building a mask. On fake tensors the values cannot be read, so
    it assumes packing and builds an ``S x S`` mask and its temporaries (about ``2 S^2`` bytes: 0.5 GiB at 16,384
    tokens) that a real run of the same batch never makes. The planner's batch is one sequence per row by
    construction, so while its fake forward runs that function answers what a real run's would: no packed
    sequences. Everything else about the mask (padding, sliding windows, eager attention) is decided as in a real
    run."""
    try:
        from transformers import masking_utils
    except ImportError:  # no transformers: no transformers model either
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


class ShapeOnlyComm:
    """What tensor-parallel layers ask of a :class:`~shardtrain.distributed.communicator.Communicator`, for fake
    tensors: the group's size and this rank; sums and maxima leave the tensor as it is, a gather concatenates ``size``
    copies. Each call is noted for the time model (:mod:`.wire`)."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def all_reduce(self, t: torch.Tensor, op: str = "sum", *, what: str, async_op: bool = False) -> Any:
        wire.note("all_reduce", "tp", self.size, t.numel() * t.element_size())
        return _Done() if async_op else None

    def all_gather_dim(self, inp: torch.Tensor, dim: int, *, what: str) -> torch.Tensor:
        wire.note("all_gather", "tp", self.size, inp.numel() * inp.element_size() * self.size)
        return torch.cat([inp] * self.size, dim=dim)

    def all_gather_object(self, obj: Any, *, what: str) -> list[Any]:
        return [obj] * self.size


@dataclass(frozen=True)
class ComputePeak:
    """Bytes above the model state during one micro-step's forward and backward."""

    activations: int
    """Saved for backward at the end of forward (with the loss and the batch)."""
    peak: int
    """The most at any time of forward and backward, everything below included."""
    peak_activations: int
    peak_temporaries: int
    """At the peak: what forward made that is still alive, and what backward made (gradients, staging)."""
    staging: int
    """Stages 2-3: most bytes of gradient staging buffers alive at once."""
    gathered: int
    """Stage 3: most bytes of units gathered at once (included in ``peak``)."""
    host_activations: int = 0
    """``cpu_checkpointing``: most bytes of checkpointed blocks' inputs in host memory at once."""


@dataclass(frozen=True)
class BlockCheckpointing:
    """Checkpointing applied as the engine applies it (:func:`shardtrain.activations.apply_checkpointing` on the
    blocks :func:`checkpointed_blocks` finds): a recompute per block, and whether the inputs kept go to host memory
    (``cpu_checkpointing``, replayed by :class:`_ShapeOnlyHostOffload`)."""

    per_block: tuple[BlockRecompute, ...] | BlockRecompute
    """One recompute per block, or one for every block."""
    offload_inputs: bool = False

    @property
    def policy(self) -> ActivationPolicy:
        if isinstance(self.per_block, str):
            return ActivationPolicy(self.per_block, self.offload_inputs)
        return ActivationPolicy("budget", self.offload_inputs, per_block=self.per_block)


def checkpointed_blocks(model: nn.Module, unit_classes: list[str] | None) -> list[nn.Module]:
    """The blocks the engine checkpoints (``engine/parallelize.py``): ZeRO-3's units without the root."""
    return [m for _, m in find_unit_modules(model, unit_classes) if m is not model]


class _ShapeOnlyHostOffload(HostOffload):
    """The engine's host offload on fake tensors: a block input's host copy is its shape alone, so the tracker sees
    the device's bytes (the input freed after forward, fetched again in backward with the block before it) and the
    host's are counted here (``peak_host_bytes``)."""

    def _to_host(self, t: torch.Tensor) -> Any:
        return (t.shape, t.dtype, t.device)

    def _to_device(self, host: Any) -> torch.Tensor:
        shape, dtype, device = host
        return torch.empty(shape, dtype=dtype, device=device)


def build_fake(
    source: ModelSource, tp: int, compute: torch.dtype, tp_plan: Any = None, ep: int = 1, split: bool = True
) -> nn.Module:
    """The model on fake tensors, split for ``tp`` (and its experts for ``ep``, [Note: experts on fake tensors];
    ``split`` False: the caller splits them, the tensor-parallel plan keeping them whole already) and cast to
    ``compute`` as the engine does. Call inside the :class:`FakeTensorMode` the tensors are to live in."""
    model = source.build()
    if not isinstance(model, nn.Module):
        raise TypeError(f"estimate: the model factory {source.name!r} returned {type(model).__name__}, not a module")
    refuse_shared_config(model, source.name)
    if tp > 1:
        from shardtrain.tensor_parallel import parallelize
        from shardtrain.tensor_parallel.rng import RegionRNG

        plan = tp_plan if tp_plan is not None else source.tp_plan
        whole = expert_weights(model, ep) if ep > 1 else None  # whole on every tp rank, as initialize keeps them
        parallelize(model, plan, ShapeOnlyComm(tp), check_replicated_grads=False, whole_experts=whole)
        for m in model.modules():  # random-stream forks move no memory, and read a drawn value (none on fakes)
            rng = getattr(m, "rng", None)
            if isinstance(rng, RegionRNG):
                rng.tp_size = 1
    if ep > 1 and split:
        split_experts(model, ep, tp)
    if compute != FP32:
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype == FP32:
                    p.data = p.data.to(compute)
            for m in model.modules():
                for name, buf in m._buffers.items():
                    if buf is not None and buf.dtype == FP32:
                        m._buffers[name] = buf.to(compute)
    return model


class _Staging:
    """The reducer's staging lifecycle at stages 2-3 (see the module docstring), on fake tensors."""

    def __init__(
        self, buckets: list[Bucket], names: list[list[str]], wire: Callable[[Bucket], torch.dtype], gloo: bool
    ) -> None:
        self.buckets = [b for b in buckets if b.requires_grad]
        self.wire = wire
        self.gloo = gloo
        self.slot_of: dict[str, tuple[int, int]] = {}
        for pos, b in enumerate(self.buckets):
            for i, n in enumerate(names[buckets.index(b)]):
                self.slot_of[n] = (pos, i)
        self.got: list[set[int]] = [set() for _ in self.buckets]
        self.staging: dict[int, torch.Tensor] = {}
        self.pending: list[tuple[torch.Tensor, ...]] = []
        self.next = 0
        self.most = 0

    def grad(self, name: str, p: torch.Tensor) -> None:
        pos, i = self.slot_of[name]
        b = self.buckets[pos]
        buf = self.staging.get(pos)
        if buf is None:
            buf = self.staging[pos] = torch.empty(b.padded_numel, dtype=self.wire(b), device=p.device)
        slot = b.slots[i]
        buf[slot.offset : slot.offset + slot.numel].copy_(p.grad.reshape(-1))
        p.grad = None
        self.most = max(self.most, self._alive())
        self.got[pos].add(i)
        while self.next < len(self.buckets) and len(self.got[self.next]) == len(self.buckets[self.next].slots):
            self._launch(self.next, p.device)
            self.next += 1

    def _alive(self) -> int:
        tensors = [*self.staging.values(), *(t for pair in self.pending for t in pair)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _launch(self, pos: int, device: torch.device) -> None:
        b = self.buckets[pos]
        inp = self.staging.pop(pos, None)
        if inp is None:
            inp = torch.zeros(b.padded_numel, dtype=self.wire(b), device=device)
        received = (inp.new_empty((b.world - 1) * b.shard_numel),) if self.gloo and b.world > 1 else ()
        self.pending.append((inp.new_empty(b.shard_numel), inp, *received))
        self.most = max(self.most, self._alive())
        while len(self.pending) > 1:
            self.pending.pop(0)

    def finish(self, device: torch.device) -> None:
        while self.next < len(self.buckets):
            self._launch(self.next, device)
            self.next += 1
        self.pending.clear()
        self.staging.clear()


class _Gathers:
    """ZeRO-3's gathered units on fake tensors ([Note: unit lifecycle], [Note: kept after forward]): a unit's full
    buffers exist from its gather to its release, the root unit from the root's forward to the end of backward,
    the next unit of the order is gathered ahead of use (prefetch), and the last unit of forward stays for
    backward. Backward's need for a unit is seen by its module's backward hooks (the engine sees it when autograd
    unpacks a saved weight: the same moment, within one operator)."""

    def __init__(
        self, model: nn.Module, units: list[tuple[nn.Module, int, int]], root: int, prefetch: PrefetchPolicy, gloo: bool
    ) -> None:
        self.units, self.root_bytes, self.prefetch, self.gloo = units, root, prefetch, gloo
        self.alive: dict[int, torch.Tensor] = {}
        self.root: torch.Tensor | None = None
        self.backward = False
        self.most = 0  # most gathered bytes at once
        self.handles = [
            model.register_forward_pre_hook(self._root_pre),
            model.register_forward_hook(self._root_post),
        ]
        for i, (m, _, _) in enumerate(units):
            self.handles += [
                m.register_forward_pre_hook(functools.partial(self._pre, i)),
                m.register_forward_hook(functools.partial(self._post, i)),
                m.register_full_backward_pre_hook(functools.partial(self._bwd_pre, i)),
                m.register_full_backward_hook(functools.partial(self._bwd_post, i)),
            ]

    def _gather(self, i: int) -> None:
        if 0 <= i < len(self.units) and i not in self.alive:
            self.alive[i] = torch.empty(self.units[i][1], dtype=torch.uint8)
            self._landing(self.units[i][1])
            self.most = max(self.most, self.root_bytes + sum(self.units[j][1] for j in self.alive))

    def _landing(self, nbytes: int) -> None:
        """gloo's gather lands in a temporary of the output's size, freed when the gather returns (see the module
        docstring): made and dropped at once, the tracker samples it at its peak."""
        if self.gloo:
            torch.empty(nbytes, dtype=torch.uint8)

    def _ahead(self, i: int) -> None:
        if 0 <= i < len(self.units) and self.prefetch.ahead(self.units[i][2]):
            self._gather(i)

    def _root_pre(self, module, args) -> None:
        if self.root is None:
            self.root = torch.empty(self.root_bytes, dtype=torch.uint8)
            self._landing(self.root_bytes)
        self._ahead(0)

    def _root_post(self, module, args, output) -> None:
        for i in [i for i in self.alive if i != len(self.units) - 1]:
            del self.alive[i]

    def _pre(self, i: int, module, args) -> None:
        self._gather(i)
        self._ahead(i - 1 if self.backward else i + 1)

    def _post(self, i: int, module, args, output) -> None:
        if not self.backward and i != len(self.units) - 1:
            self.alive.pop(i, None)

    def _bwd_pre(self, i: int, module, grad_output) -> None:
        self.backward = True
        self._gather(i)
        self._ahead(i - 1)

    def _bwd_post(self, i: int, module, grad_input, grad_output) -> None:
        self.alive.pop(i, None)

    def finish(self) -> None:
        self.alive.clear()
        self.root = None
        for h in self.handles:
            h.remove()


def _checkpoint_units(model: nn.Module, unit_classes: list[str] | None, selective: bool = False) -> None:
    """Activation checkpointing of every block (the modules ZeRO-3 would make units), non-reentrant; ``selective``:
    with the per-operation policy of ``activation_checkpointing.policy: "selective"``."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, keep_matmuls)
    if getattr(model, "supports_gradient_checkpointing", False):  # transformers: its own, as users enable it
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    for _, m in find_unit_modules(model, unit_classes):
        m.forward = functools.partial(checkpoint, m.forward, **kwargs)


def measure_compute(
    source: ModelSource,
    *,
    tp: int,
    compute: torch.dtype,
    micro_batch: int,
    seq_len: int,
    stage: int,
    buckets: list[Bucket],
    bucket_names: list[list[str]],
    reduce_dtype: torch.dtype | None,
    checkpointing: bool | str | BlockCheckpointing = False,
    unit_classes: list[str] | None = None,
    tp_plan: Any = None,
    ep: int = 1,
    sp: int = 1,
    gloo: bool = False,
    units: list[tuple[str, int, int]] | None = None,
    prefetch: PrefetchPolicy = NO_PREFETCH,
    module_peaks: bool = False,
    models: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
    accum_dtype: torch.dtype = FP32,
) -> ComputePeak:
    """Forward and backward of one micro-batch on fake tensors under ``MemTracker`` (see the module docstring).

    ``gloo``: the collectives are gloo's (planning for a machine without accelerator), with the buffers of theirs
    the module docstring names. ``sp``: the run is rank 0's of a Ulysses group of that size ([Note: sequence
    parallelism on fake tensors] in :mod:`.sequence`). ``units``: stage 3, ``(name, gathered bytes, elements)`` of
    each unit in the layout's order (last block first, ``<root>`` last), whose gathers are replayed by module hooks.
    ``module_peaks``: run torch's ``MemTracker`` as it is (it also keeps each module's peak; slower, the same bytes:
    the reference the fast path is tested against).
    ``models``: fake models built by earlier calls, by (tp, compute dtype, checkpointing, ep, sp), reused and added
    to (each run leaves its model as it found it: hooks removed, no gradients). ``progress(done, total)``: called as
    blocks run forward and parameters get their gradients (hooks that allocate nothing)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )
    from torch.distributed._tools.mem_tracker import MemTracker

    mixed = compute != FP32
    key = model_key(tp, compute, checkpointing, unit_classes, ep, sp)
    if models is not None and key in models:
        mode, model, splitter = models.pop(key)  # put back only after a run that finished (hooks removed, no grads)
    else:
        mode, model, splitter = _build_run_model(source, tp, compute, checkpointing, unit_classes, tp_plan, ep, sp)
    with mode:
        if not source.hf and source.batch is None and _is_transformers_model(model):
            source.hf = True  # a factory returning a transformers model: call it as one
        if source.vocab_size is None and source.batch is None:
            emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
            source.vocab_size = emb.num_embeddings if emb is not None else 2
        params = {}
        for n, p in model.named_parameters():
            params.setdefault(id(p), (n, p))
        handles = []
        staging = None
        if stage >= 2:
            staging = _Staging(buckets, bucket_names, lambda b: reduce_dtype or b.dtype, gloo)
            for n, p in params.values():
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(functools.partial(_staged, staging, n)))
        else:
            for _, p in params.values():
                if not p.requires_grad:
                    continue
                if mixed and accum_dtype != compute:  # added into the fp32 flat buffer (model state), then dropped
                    handles.append(p.register_post_accumulate_grad_hook(_drop_grad))
                else:  # a view of the persistent flat buffer: accumulated in place
                    p.grad = torch.zeros_like(p)
        if progress is not None:
            handles += _progress_hooks(model, params, unit_classes, progress)
        host_offload = getattr(model, "_shardtrain_host_offload", None)
        if host_offload is not None:
            host_offload.peak_host_bytes = host_offload.host_bytes = 0
        gathers = None
        if units:
            modules = dict(model.named_modules())
            blocks = [(modules[n], b, k) for n, b, k in units[::-1] if n != "<root>"]
            root = sum(b for n, b, _ in units if n == "<root>")
            gathers = _Gathers(model, blocks, root, prefetch, gloo)
        tracker = MemTracker() if module_peaks else _peak_only_tracker()
        tracker.track_external(model)
        # a dispatch mode costs Python time per operator: only models with experts call grouped matmuls
        grouped = GroupedMatmulShapes() if has_experts(model) else nullcontext()
        with tracker, grouped, warnings.catch_warnings():
            # MemTracker looks for tensors in every module output, and says so for each None it finds
            warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass", UserWarning)
            base = _total(tracker.get_tracker_snapshot("current"))
            held = None
            if splitter is None:
                args, kwargs = source.make_batch(micro_batch, seq_len)
            else:  # the engine's split reads values: on a real batch, then copied into fake tensors
                from torch._subclasses.fake_tensor import unset_fake_temporarily

                with unset_fake_temporarily():
                    whole = source.make_batch(micro_batch, seq_len)
                    parts = split_batch(splitter, whole)
                held = as_fake(whole)  # the whole batch the caller holds during the step
                args, kwargs = as_fake(parts)
            unpacked = unpacked_batch() if source.hf and source.batch is None else nullcontext()
            try:
                with unpacked:
                    out = model(*args, **kwargs)
                loss = loss_of(out if splitter is None else splitter.combine(out))
                del out
                after_forward = _total(tracker.get_tracker_snapshot("current"))
                loss.backward()
            except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as err:
                raise ShardtrainError(
                    f"estimate: {source.name} cannot run on fake tensors ({type(err).__name__}: {err}): its forward "
                    "reads tensor values. Estimate the model state alone (activations=False, --state-only)"
                ) from err
            if staging is not None:
                staging.finish(loss.device)
            if gathers is not None:
                gathers.finish()
            del loss, args, kwargs, held
        peak = tracker.get_tracker_snapshot("peak")
        for h in handles:
            h.remove()
        for _, p in params.values():
            p.grad = None
    if models is not None:
        models[key] = (mode, model, splitter)
    snap = next(iter(peak.values()), {})
    by_kind = {str(k.value) if hasattr(k, "value") else str(k): v for k, v in snap.items()}
    return ComputePeak(
        activations=after_forward - base,
        peak=_total(peak) - base,
        peak_activations=by_kind.get("Activation", 0),
        peak_temporaries=by_kind.get("Temp", 0),
        staging=staging.most if staging is not None else 0,
        gathered=gathers.most if gathers is not None else 0,
        host_activations=host_offload.peak_host_bytes if host_offload is not None else 0,
    )


def prepare_models(
    source: ModelSource,
    *,
    tp: int,
    compute: torch.dtype,
    checkpointing: bool | str | BlockCheckpointing,
    unit_classes: list[str] | None,
    tp_plan: Any,
    models: dict | None,
    ep: int = 1,
    sp: int = 1,
) -> None:
    """Build into ``models`` the fake model a :func:`measure_compute` call with these arguments reuses (nothing when
    it is there already, or ``models`` is None)."""
    key = model_key(tp, compute, checkpointing, unit_classes, ep, sp)
    if models is not None and key not in models:
        models[key] = _build_run_model(source, tp, compute, checkpointing, unit_classes, tp_plan, ep, sp)


def model_key(
    tp: int,
    compute: torch.dtype,
    checkpointing: bool | str | BlockCheckpointing,
    unit_classes: list[str] | None,
    ep: int = 1,
    sp: int = 1,
) -> tuple:
    return (tp, compute, checkpointing, tuple(unit_classes or ()) if checkpointing else None, ep, sp)


def _build_run_model(
    source: ModelSource,
    tp: int,
    compute: torch.dtype,
    checkpointing: bool | str | BlockCheckpointing,
    unit_classes: list[str] | None,
    tp_plan: Any,
    ep: int = 1,
    sp: int = 1,
) -> tuple[Any, nn.Module, Any]:
    """A fake-tensor mode, the model built in it, and the splitter of its inputs under sequence parallelism (None
    without)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = build_fake(source, tp, compute, tp_plan, ep)
        splitter = install_sequence_parallel(model, sp, tp) if sp > 1 else None
        if isinstance(checkpointing, BlockCheckpointing):
            offload = _ShapeOnlyHostOffload(torch.device("cpu")) if checkpointing.offload_inputs else None
            apply_checkpointing(checkpointed_blocks(model, unit_classes), checkpointing.policy, offload)
            model._shardtrain_host_offload = offload  # read back by measure_compute
        elif checkpointing:
            _checkpoint_units(model, unit_classes, selective=checkpointing == "selective")
    return mode, model, splitter


def _progress_hooks(
    model: nn.Module, params: dict, unit_classes: list[str] | None, progress: Callable[[int, int], None]
) -> list[Any]:
    """Hooks calling ``progress(done, total)``: one step per block's first forward, one per parameter gradient."""
    blocks = [m for _, m in find_unit_modules(model, unit_classes)]
    trainable = [p for _, p in params.values() if p.requires_grad]
    total, seen = len(blocks) + len(trainable), set()

    def tick(key: Any, *_: Any) -> None:
        if key not in seen:
            seen.add(key)
            progress(len(seen), total)

    handles = [m.register_forward_pre_hook(functools.partial(tick, id(m))) for m in blocks]
    return handles + [p.register_post_accumulate_grad_hook(functools.partial(tick, id(p))) for p in trainable]


def _peak_only_tracker() -> Any:
    """torch's ``MemTracker``, keeping only the whole-process peak ([Note: the lean tracker]).

    [Note: the lean tracker]
    ``MemTracker`` also keeps per-module statistics the planner never reads: after every operator ``_update_peak_stats``
    walks every module seen (O(layers^2) per run), and every module hook deep-copies the snapshot. This subclass drops
    those and keeps every step that moves a byte or a category (same storages, reference types and moments; the peak
    sampled after every operator), so the peak and its breakdown are torch's. Operator outputs that are a tensor or a
    flat tuple/list skip ``tree_map_only`` and a new peak's snapshot is a plain dict copy; anything else takes torch's
    path. ``test_fast_path_gives_the_reference_bytes`` compares it with ``MemTracker``."""
    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModState
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_map_only

    wait_tensor = torch.ops._c10d_functional.wait_tensor.default

    class PeakOnlyTracker(MemTracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(dev_snap)  # integers by reference type: a copy is a deep copy

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            # MemTracker's hook without its per-module statistics (its sums of inputs and outputs only read what
            # is tracked): the same tracking and the same refusals
            if module not in self.memory_tracking:
                self._track_module_params_and_buffers(module, install_grad_hooks=True)
                self.memory_tracking[module] = True
            elif self._mod_tracker.is_bw:
                if self._ac_mod is None:
                    self._ac_mod = weakref.ref(module)
                    self._in_ac = True
            else:
                name = self._mod_tracker.get_known_fqn(module)
                parents = set(self._mod_tracker.parents) - {name}
                if len(parents) == 1 and "Global" in parents:
                    raise NotImplementedError("MemTracker tracks one iteration: a second forward of the root")

        def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod = None
                self._in_ac = False

        def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
            return None

        def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
            return None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if DTensor in types:
                return NotImplemented
            if func is wait_tensor and active_fake_mode():
                res = args[0]
            else:
                res = func(*args, **kwargs or {})
            if active_fake_mode() is self._fake_mode_on_entry:
                if self._in_opt:
                    reftype = _MemRefType.OPT
                elif self._mod_tracker.is_bw and not self._in_ac:
                    reftype = _MemRefType.TEMP
                else:
                    reftype = _MemRefType.ACT
                if isinstance(res, torch.Tensor) and not is_traceable_wrapper_subclass(res):
                    self._track(reftype, res)
                elif type(res) in (tuple, list) and all(
                    x is None or type(x) in (int, float, bool) or _plain(x) for x in res
                ):
                    for x in res:
                        if isinstance(x, torch.Tensor):
                            self._track(reftype, x)
                else:
                    tree_map_only(torch.Tensor, functools.partial(self._track, reftype), res)
                self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
            return res

    def _plain(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and not is_traceable_wrapper_subclass(x)

    return PeakOnlyTracker()


def _is_transformers_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # imported by the factory if the model is one
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _staged(staging: _Staging, name: str, p: torch.Tensor) -> None:
    staging.grad(name, p)


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def _total(snapshot: dict) -> int:
    return sum(dev.get("Total", 0) for dev in snapshot.values())
