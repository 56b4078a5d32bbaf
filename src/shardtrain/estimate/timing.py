"""The time model: one layout's step time, tokens/s per GPU, MFU and exposed communication on a described cluster.

It reads what the memory planner already has: the fake run of one micro-batch (every operator's FLOPs and bytes,
every tensor-, sequence- and expert-parallel collective, :func:`measure_work`), the layout's ZeRO buckets and units
(the gathers and reductions of a step, :func:`zero_traffic`), and the pipeline's and ring's arithmetic
(:mod:`.axes`). :func:`step_time` puts them on a :class:`~shardtrain.estimate.cluster.Cluster`.

[Note: the roofline]
An operator takes ``max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x memory efficiency))`` plus the host's
per-operator overhead (measured on a CPU by ``calibrate``; zero on a GPU, whose launches run ahead of its kernels),
charged to operators that run a kernel only ([Note: metadata-only operators]).
FLOPs are ``torch.utils.flop_counter``'s registry's (matmuls, convolutions, attention; CPU's fused attention, which
the registry does not list, by the registry's own ``sdpa_flop_count``). Its kind picks the efficiency: a matmul's
by its FLOPs (small matmuls reach less of the peak; the profile's curve), attention one figure, everything else is
memory-bound: its bytes are its inputs' and outputs' (views move nothing). The peak is the compute dtype's (fp8
layouts: the fp8 peak for the converted linears' matmuls, [Note: fp8 matmuls]).

[Note: the alpha-beta model]
A collective over ``n`` ranks costs ``steps x latency + bus bytes / (link bandwidth x link efficiency)``, the bus
bytes as the communicator counts them (all-reduce ``2 S (n-1)/n``, all-gather, reduce-scatter and all-to-all
``S (n-1)/n``, p2p ``S``), the steps of a ring (``n - 1``; all-reduce ``2 (n - 1)``, or a tree's ``2 log2 n``
where fewer, as NCCL picks a tree for small all-reduces; p2p 1). Each call pays its steps: ZeRO's collectives are
one per bucket and one per unit gathered, and the step adds the squared norm's all-reduce at stages 1-3 (the first
slice charged one latency per kind of collective). The link is NVLink when the group's ranks lie in
one node, else the network ([Note: rings across nodes]). The mesh
puts tensor-parallel ranks adjacent, then sequence, then data (``distributed/mesh.py``), so a group spans
``size x stride`` consecutive ranks: tp ``tp``, sp ``tp x sp``, ep ``tp x ep``, ZeRO's shard group ``tp x sp x
shard``, the pipeline's neighbours ``world / pp`` apart.

[Note: rings across nodes]
A group that spans nodes with ``k`` of its ranks in each node crosses between nodes on ``k`` network adapters at
once (one per GPU, [Note: link bandwidths] in :mod:`.cluster`): NCCL builds one ring (a channel) per adapter, each
carrying ``1/k`` of the bytes, so the bytes a rank sends move at ``k`` times one adapter's rate, at most NVLink's
(the ring's hops within a node carry all of them). ``k`` is the node's GPUs over the group's stride (``span /
size``), at least 1: ZeRO's group at tp 1 has all 8 ranks of a node in it, at tp 8 one. Charging every group one
adapter's rate put the data-parallel reductions of Megatron-LM's 1.7B model over 48 GPUs (docs/planner.md) at
8x their time, exposed behind a backward they fit in.

[Note: what overlaps]
* ZeRO-3's unit gathers run ahead of the unit that needs them (prefetch) and gradients are reduce-scattered while
  backward goes on: both hide behind the micro-batch's compute, less the first gather of forward and the last
  bucket's reduction, which nothing covers; ``overlap`` of the profile says how much of the rest hides.
* Stages 0-1 reduce the gradients once per step, at the accumulation boundary, behind the last micro-batch's
  backward, less the last bucket's reduction (it starts when backward's last gradient is in; a model in one bucket
  hides nothing); stages 2-3 every micro-batch's. The all-gather after the step (stages 1-2) is waited for by the
  first module of the next forward that reads each bucket ([Note: gathers after the step] in
  ``zero/step_gather.py``): it hides behind the next step's first forward, less the bucket read first (the
  embedding's: buckets are built in backward's order, so it is the last). Charging both as hidden put the
  benchmark's one-bucket GPT at world 2 2-4 ms short of the engine's measured waits (bench_planner_time.py).
* Tensor-, sequence- and expert-parallel collectives are on the critical path (each layer waits for its result):
  exposed (tensor parallelism as shardtrain runs it; other stacks' in [Note: how a stack runs its TP]). So is the
  context-parallel ring (not overlapped in the engine yet) and the pipeline's p2p.
* A pipeline step is the stage's micro-batches stretched by the bubble: ``/ (1 - (p-1)/(v m + p-1))``.
* Activation checkpointing's recompute is in the fake run itself (the checkpointed forward runs again in backward).
* The optimizer step is memory-bound: Adam reads and writes 28 bytes per fp32 element stepped (parameter, gradient,
  two moments in; parameter, moments out) plus the compute-dtype copy. With optimizer offload it is the host step
  in one pass ([Note: one pass over a sub-group] in ``offload/one_pass.py``): :data:`HOST_STEP_BYTES_PER_ELEMENT`
  over the cluster's ``host_gb_s``, shared by a node's ranks. Its PCIe copies overlap ([Note: overlapped offload]
  in ``offload/host_copies.py``): the fp32 gradients' copy down behind the last backward, the fp32 masters' copy up
  (rounded on the device) behind the host step of the next sub-group; what does not fit is exposed. Charged in
  series, the H200 validation's offload step was predicted 1.22x its measured 772 ms. NVMe offload adds the swap
  files' bytes (optimizer state read and written once per step; parameter shards read for each micro-batch's
  forward and backward, written after the step) at ``nvme_gb_s``, not overlapped (the sub-groups' swaps are waited
  for between steps).
* Hybrid sharding's replica all-reduce (each rank's gradient shard over the ``zero / shard`` replicas, once per step
  at the boundary, [Note: hybrid gradient reduction] in ``zero/reducer.py``) hides behind the last backward as the
  boundary reduction does, in what is left of it.
[Note: attention under context parallelism]
Under context parallelism the fake run is one rank's ``S / cp`` tokens, and its attention operator attends them to
those ``S / cp`` keys only; the ring attends them to the whole sequence's ``S`` keys (``cp`` chunks, one per ring
step, [Note: which context attention] in ``sequence_parallel/ring.py``). So an attention operator's time, forward,
backward and recomputed alike, is ``cp`` times the fake run's, and so are its FLOPs in the model FLOPs (MFU). The
matmuls, norms and the rest see the rank's tokens only and are as the fake run counts them. Without it the planner
put torchtitan's Llama-3.1-8B at 65,536 tokens on FSDP 4 x CP 2 (docs/planner.md) at the speed of 32,768 tokens on
one rank, 1.68x the published figure.

[Note: metadata-only operators]
A view (``view``, ``t``, ``transpose``, ``expand``, ``as_strided``, ``detach``, ``split``...) makes a tensor that
shares its input's storage: no kernel, no bytes. The rule is the operator's schema: every output aliases an input
(``alias_info`` set) and none is written (``is_write`` false; an in-place ``add_`` aliases its output too, but runs
a kernel). ``_unsafe_view``, ``alias`` and ``lift_fresh``, whose schemas declare no alias but which return their
input's storage, are listed by name. Such an operator is charged neither bytes nor the per-operator overhead: the
first slice charged the overhead to every operator, and views are a third of a transformer's eager operators.

[Note: fp8 matmuls]
The fake run does not convert linears to float8 (its memory is the engine's, which keeps bf16 weights and casts per
call), so the fp8 matmuls are found by shape: a matmul of a converted linear has the weight, or its transpose, as
an operand or as its output (forward ``x @ W^T``, input gradient ``dy @ W``, weight gradient ``dy^T @ x``); the
converted weights' shapes are the linears torchao converts (``precision/float8.py``). Such a matmul runs at the fp8
peak, every other one (attention's, the output head's, layers left in bf16) at the compute dtype's. A bf16 matmul
of the same shape as a converted weight would be counted as fp8: a stated approximation.

[Note: what compile changes]
``--compile`` (``torch.compile``'s Inductor) fuses chains of element-wise operators into one kernel: the model
charges a pointwise operator (``torch.Tag.pointwise``) only its output's bytes (its inputs come from the fused
producer's registers) and no per-operator host time (one launch per fused kernel). Matmuls, attention and the
other memory-bound operators (reductions, copies, indexing) are charged as in eager. It is a lower bound of what
fusion saves where a pointwise input comes from memory, an upper bound where the chain's intermediate outputs are
never written; no compiled step has been timed against it yet.

[Note: how a stack runs its TP]
``tp_style`` says how the layout's tensor parallelism runs. ``shardtrain`` (the engine's): each block's all-reduce
exposed, and the operators between the parallel regions (norms, residual adds, dropout) run on the whole sequence on
every rank. ``sequence-parallel`` (Megatron-LM's ``--sequence-parallel``, torchtitan's ``SequenceParallel``): the
all-reduce becomes a reduce-scatter and an all-gather over the sequence (the same bus bytes, ``2 (n-1)`` ring steps),
and those operators run on ``1/tp`` of it: a memory-bound operator whose output's last dimension is the model's
hidden size takes ``1/tp`` of the fake run's time (inside the parallel regions the widths are split already).
``sequence-parallel-overlap`` adds the overlap of those collectives with the matmuls next to them (Megatron's
``--tp-comm-overlap``, NeMo's default; torchtitan's Async TP): per micro-batch, forward and backward apart, the
exposed part is ``max(0, TP collectives - matmul time)``. The slowdown of a matmul that shares the GPU with a
collective is left out. Without this, every published tp 4-8 row was predicted 0.53-0.86x (docs/planner.md).

[Note: ranks that meet]
Ranks that meet at collectives move at the pace of the slowest: between two meetings they drift apart, and the
others wait for the last. On a GPU cluster that is its stragglers (left out: ``sync_skew`` 0); on a CPU shared by
more ranks than cores, a rank that is not scheduled when its peers arrive. ``calibrate`` measures how much a block
of compute stretches when the ranks meet after it ([Note: a collective after compute] in :mod:`.calibrate`), and
a multi-rank step's compute (forward, backward, the optimizer step) is stretched by it. Every compute interval of a
step ends at some meeting, so the stretch is of the whole compute, however many collectives cut it up.

[Note: arithmetic-bound operators]
On a GPU an element-wise operator, a softmax or a norm is bound by its bytes. On a CPU core some are bound by their
arithmetic instead: a tanh-form GELU computes a polynomial and a tanh per element, a log-softmax an exponential and a
logarithm, so ``gelu`` over a 1 MiB tensor takes 4-5x what its bytes take at the measured bandwidth (and 16x an
``add`` of the same size). ``calibrate`` times each operator of its ``ELEMENTWISE_OPERATORS`` on this machine and
records nanoseconds per output element; such an operator takes ``max(bytes / bandwidth, elements x ns)``. A GPU
profile lists none (its kernels are bound by bytes). The operator is named by its aten name, and ``gelu`` and
``gelu_backward`` by their form too (``gelu:tanh``): the two forms differ by 2x here. Without it the fake run's GELUs,
softmaxes and norms of the benchmark's GPT were charged 1.2 ms of the 5 ms they take (bench_planner_time.py).

[Note: the optimizer's host loop]
torch's optimizers on CPU tensors step one tensor at a time (``foreach`` is for CUDA tensors), and the gradient
clipping's scale is applied per tensor: about a dozen operators a tensor, each paying the host's dispatch, plus the
Python of the loop. That host time grows with the tensors stepped, not their elements: 53 tensors of the benchmark's
GPT take 5 ms to step where their bytes take 1.4 ms. ``calibrate`` measures it (``measure_optimizer_loop``: AdamW
with clipping over tensors small enough that their bytes do not count) as ``optimizer_us_per_tensor``; the step
is charged that per tensor this rank steps (every parameter at stage 0, each fragment of its shard at stages 1-3),
beside its bytes. A GPU profile has 0: a fused or for-each step is a handful of launches that run ahead of the device.

Left out: stragglers, congestion, kernels the fake run cannot see (fused kernels of a compiler), and the host's
Python time beyond the per-operator overhead and the optimizer's loop.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from shardtrain.errors import LayoutError
from shardtrain.estimate import wire
from shardtrain.estimate.cluster import Cluster
from shardtrain.estimate.source import ModelSource, loss_of
from shardtrain.estimate.state import RankState, UnitSize
from shardtrain.offload.one_pass import HOST_STEP_BYTES_PER_ELEMENT

aten = torch.ops.aten

_ATTENTION = {
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
    aten._flash_attention_forward,
    aten._efficient_attention_forward,
    aten._flash_attention_backward,
    aten._efficient_attention_backward,
}
_CPU_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu
_CPU_ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward
_NO_BYTES = {aten.detach, aten._unsafe_view, aten.lift_fresh, aten.empty, aten.empty_like, aten.empty_strided}
_NO_BYTES |= {aten.new_empty, aten.new_empty_strided, aten.alias}
_ALIAS_UNDECLARED = {aten._unsafe_view, aten.alias, aten.lift_fresh}
"""Operators that return their input's storage without their schema saying so ([Note: metadata-only operators])."""


def is_metadata_only(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` only makes a new view of its input ([Note: metadata-only operators])."""
    if func._overloadpacket in _ALIAS_UNDECLARED:
        return True
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@dataclass(frozen=True)
class Op:
    kind: str  # matmul, attention or memory
    flops: int
    nbytes: int
    backward: bool
    metadata_only: bool = False
    """A view: no kernel runs, no host overhead is charged ([Note: metadata-only operators])."""
    pointwise: bool = False
    """Element-wise (``torch.Tag.pointwise``): fused under compile ([Note: what compile changes])."""
    out_bytes: int = 0
    """Its outputs' bytes (a fused pointwise operator's only traffic)."""
    shapes: tuple[tuple[int, int], ...] = ()
    """A matmul's operands' and output's last two dimensions ([Note: fp8 matmuls])."""
    width: int = 0
    """Its first output's last dimension ([Note: how a stack runs its TP])."""
    name: str = ""
    """A memory-bound operator's aten name, with ``gelu``'s form ([Note: arithmetic-bound operators])."""
    elements: int = 0
    """Elements of its first output ([Note: arithmetic-bound operators])."""


@dataclass
class MicroBatchWork:
    """One micro-batch's forward and backward on one rank, from the fake run."""

    ops: Counter = field(default_factory=Counter)
    """:class:`Op` -> how many times it ran (identical layers collapse into one entry)."""
    forward_flops: int = 0
    """FLOPs of the forward (before backward started): the model FLOPs are three times it ([Note: model FLOPs and
    MFU] in ``engine/monitor.py``)."""
    collectives: list[wire.Collective] = field(default_factory=list)

    def flops(self, kind: str | None = None) -> int:
        return sum(op.flops * n for op, n in self.ops.items() if kind in (None, op.kind))


class _WorkCounter(TorchDispatchMode):
    """Each operator's kind, FLOPs and bytes ([Note: the roofline])."""

    def __init__(self, work: MicroBatchWork) -> None:
        super().__init__()
        self.work = work
        self.backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            return out  # a query of metadata (a device, a size): no kernel runs
        packet = func._overloadpacket
        flops, kind = 0, "memory"
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            kind = "attention" if packet in _ATTENTION else "matmul"
        elif packet is _CPU_ATTENTION:
            flops, kind = sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape), "attention"
        elif packet is _CPU_ATTENTION_BACKWARD:
            flops = sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape)
            kind = "attention"
        elif packet is aten._grouped_mm:  # not in the registry: each output element is a dot product
            flops, kind = 2 * out.numel() * args[0].shape[-1], "matmul"
        metadata_only = is_metadata_only(func)
        moved = not (metadata_only or packet in _NO_BYTES)
        nbytes = _bytes(args, kwargs, out) if moved else 0
        pointwise = torch.Tag.pointwise in func.tags
        out_bytes = _bytes((), {}, out) if moved and pointwise else 0
        shapes = _matrix_shapes(args, out) if kind == "matmul" else ()
        first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        width = int(first.shape[-1]) if first is not None and first.dim() else 0
        name, elements = "", 0
        if kind == "memory" and moved and first is not None:
            name, elements = _elementwise_name(packet, kwargs), first.numel()
        op = Op(kind, int(flops), nbytes, self.backward, metadata_only, pointwise, out_bytes, shapes, width, name,
                elements)  # fmt: skip
        self.work.ops[op] += 1
        if not self.backward:
            self.work.forward_flops += int(flops)
        return out


def _elementwise_name(packet: Any, kwargs: dict) -> str:
    """The name an arithmetic-bound operator is calibrated under ([Note: arithmetic-bound operators])."""
    name = packet.__name__
    if name in ("gelu", "gelu_backward") and kwargs.get("approximate", "none") == "tanh":
        return f"{name}:tanh"
    return name


def _matrix_shapes(args: Any, out: Any) -> tuple[tuple[int, int], ...]:
    """The last two dimensions of a matmul's tensor operands and output ([Note: fp8 matmuls])."""
    tensors = [t for t in tree_leaves((args, out)) if isinstance(t, torch.Tensor) and t.dim() >= 2]
    return tuple(sorted({(int(t.shape[-2]), int(t.shape[-1])) for t in tensors}))


def _bytes(args: Any, kwargs: Any, out: Any) -> int:
    seen, total = set(), 0
    for t in tree_leaves((args, kwargs, out)):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def measure_work(
    source: ModelSource,
    *,
    tp: int,
    compute: torch.dtype,
    micro_batch: int,
    seq_len: int,
    checkpointing: bool | str = False,
    unit_classes: list[str] | None = None,
    tp_plan: Any = None,
    ep: int = 1,
    sp: int = 1,
    models: dict | None = None,
    **_: Any,
) -> MicroBatchWork:
    """One micro-batch's forward and backward on fake tensors, counted per operator (takes the keyword arguments of
    :func:`~shardtrain.estimate.compute.measure_compute`; ``models`` is the same cache of fake models)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from shardtrain.estimate.compute import _build_run_model, _is_transformers_model, model_key, unpacked_batch
    from shardtrain.estimate.experts import GroupedMatmulShapes, has_experts
    from shardtrain.estimate.sequence import as_fake, split_batch

    key = model_key(tp, compute, checkpointing, unit_classes, ep, sp)
    if models is not None and key in models:
        mode, model, splitter = models.pop(key)
    else:
        mode, model, splitter = _build_run_model(source, tp, compute, checkpointing, unit_classes, tp_plan, ep, sp)
    work = MicroBatchWork()
    counter = _WorkCounter(work)
    with mode:
        if not source.hf and source.batch is None and _is_transformers_model(model):
            source.hf = True  # a factory returning a transformers model: call it as one
        if source.vocab_size is None and source.batch is None:
            emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
            source.vocab_size = emb.num_embeddings if emb is not None else 2
        if splitter is None:
            args, kwargs = source.make_batch(micro_batch, seq_len)
        else:
            with unset_fake_temporarily():
                parts = split_batch(splitter, source.make_batch(micro_batch, seq_len))
            args, kwargs = as_fake(parts)
        unpacked = unpacked_batch() if source.hf and source.batch is None else nullcontext()
        # experts' grouped matmuls need the memory run's shapes on fake tensors; the counter is entered after it,
        # so it sees each call before that mode answers it
        grouped = GroupedMatmulShapes() if has_experts(model) else nullcontext()
        with wire.recording() as calls:
            wire.set_backward(False)
            try:
                with grouped, counter, unpacked:
                    out = model(*args, **kwargs)
                    loss = loss_of(out if splitter is None else splitter.combine(out))
                    counter.backward = True
                    wire.set_backward(True)
                    loss.backward()
            finally:
                wire.set_backward(False)
        work.collectives = list(calls)
        for p in model.parameters():
            p.grad = None
    if models is not None:
        models[key] = (mode, model, splitter)
    return work


# -- ZeRO's traffic --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZeroTraffic:
    """Bus bytes (the communicator's convention) of ZeRO's collectives over one optimizer step of ``m``
    micro-batches, split by when they run ([Note: what overlaps])."""

    per_micro_batch: dict[str, int]
    """Every micro-batch: stage 3's unit gathers (``all_gather``), stage 2-3's reduce-scatter."""
    at_boundary: dict[str, int]
    """Once per step behind the last backward: stage 0's all-reduce, stage 1's reduce-scatter."""
    after_step: dict[str, int]
    """After the optimizer step: the all-gather of stages 1-2 (and stage 3's persistent parameters)."""
    first_gather: int = 0
    """Bus bytes of the first unit gathered in forward (nothing to hide it behind)."""
    last_reduce: int = 0
    """Bus bytes of the last bucket reduced in backward (a reduce-scatter's; an all-reduce moves twice them)."""
    first_after_gather: int = 0
    """Bus bytes of the after-step all-gather of the bucket the next forward reads first (the last bucket: they are
    built in backward's order), which nothing hides ([Note: what overlaps])."""
    group: int = 1
    """Ranks of ZeRO's shard group."""
    replica_all_reduce: int = 0
    """Hybrid sharding: bus bytes of the gradient shards' all-reduce over the replicas, once per step."""
    replicas: int = 1
    calls: dict[str, dict[str, int]] = field(default_factory=dict)
    """Collectives by when (``per_micro_batch``, ``at_boundary``, ``after_step``) and kind: one per bucket or unit
    gathered, each paying its latencies (one of each kind where absent)."""

    def per_step(self, micro_batches: int) -> dict[str, int]:
        out: Counter = Counter()
        for kind, nbytes in self.per_micro_batch.items():
            out[kind] += nbytes * micro_batches
        out.update(self.at_boundary)
        out.update(self.after_step)
        return dict(out)


def zero_traffic(
    state: RankState, stage: int, wire_itemsize: dict[int, int] | None = None, replicas: int = 1
) -> ZeroTraffic:
    """ZeRO's bytes per step from the layout's buckets and units, as the engine moves them (its communicator's counts,
    ``tests/estimate/test_estimate_time.py``): stage 0 all-reduces the gradients once per step, stage 1
    reduce-scatters them once per step, stage 2 every micro-batch; stages 1-2 all-gather the parameters after the
    step; stage 3 gathers every unit for forward and again for backward
    (the last block and the root once: they stay gathered, [Note: kept after forward] in :mod:`.compute`) and
    reduce-scatters every micro-batch. ``wire_itemsize``: the reduction's bytes per element by bucket index (default:
    the bucket's dtype). ``replicas``: hybrid sharding's replica count; each rank's shard of every dense bucket is
    all-reduced across them once per step (expert buckets never are)."""
    per_micro: Counter = Counter()
    boundary: Counter = Counter()
    replica = 0
    after: Counter = Counter()
    calls: dict[str, Counter] = {"per_micro_batch": Counter(), "at_boundary": Counter(), "after_step": Counter()}
    reduced = []
    first_after = 0
    for b in state.buckets:
        if not b.requires_grad or b.world <= 1:
            continue
        item = (wire_itemsize or {}).get(b.index, b.dtype.itemsize)
        full = b.padded_numel * item
        moved = full * (b.world - 1) // b.world
        reduced.append(moved)
        if replicas > 1 and not b.expert:
            replica += 2 * (full // b.world) * (replicas - 1) // replicas
        if stage == 0:
            boundary["all_reduce"] += 2 * moved
            calls["at_boundary"]["all_reduce"] += 1
        elif stage == 1:
            boundary["reduce_scatter"] += moved
            calls["at_boundary"]["reduce_scatter"] += 1
        else:
            per_micro["reduce_scatter"] += moved
            calls["per_micro_batch"]["reduce_scatter"] += 1
        if stage in (1, 2) or (stage == 3 and b.gather_after_step):
            first_after = b.padded_numel * b.dtype.itemsize * (b.world - 1) // b.world
            after["all_gather"] += first_after
            calls["after_step"]["all_gather"] += 1
    first = 0
    if stage == 3:
        groups = {b.world for b in state.buckets if b.world > 1}
        n = max(groups) if groups else 1
        per_micro["all_gather"] += _unit_gathers(state.units, n)
        blocks = [u for u in state.units if not u.root]
        if n > 1:
            calls["per_micro_batch"]["all_gather"] += sum(1 if u.root or u is blocks[0] else 2 for u in state.units)
        first = blocks[-1].nbytes * (n - 1) // n if blocks else 0  # units are in the layout's order: last first
    group = max((b.world for b in state.buckets), default=1)
    last = reduced[-1] if reduced else 0
    return ZeroTraffic(
        dict(per_micro), dict(boundary), dict(after), first, last, first_after, group, replica, replicas,
        {when: dict(kinds) for when, kinds in calls.items()},
    )  # fmt: skip


def _unit_gathers(units: list[UnitSize], n: int) -> int:
    """Bus bytes of one micro-batch's unit gathers (see :func:`zero_traffic`)."""
    if n <= 1:
        return 0
    blocks = [u for u in units if not u.root]
    last_block = blocks[0] if blocks else None
    return sum(u.nbytes * (1 if u is last_block or u.root else 2) for u in units) * (n - 1) // n


# -- the step on a cluster --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """How many consecutive ranks a group of each axis spans, and its size ([Note: the alpha-beta model])."""

    world: int
    tp: int = 1
    sp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    shard: int = 1

    def span(self, axis: str) -> int:
        inner = self.tp
        return {
            "tp": self.tp,
            "sp": inner * self.sp,
            "cp": inner * self.sp * self.cp,
            "ep": inner * self.ep,
            "zero": inner * self.shard,  # the shard group holds the sequence and context ranks already
            "replicate": self.world // self.pp,
            "pp": self.world,
        }[axis]


def collective_time(kind: str, nbytes: float, size: int, span: int, cluster: Cluster, calls: int = 1) -> float:
    """Seconds of ``calls`` collectives moving ``nbytes`` bus bytes together over ``size`` ranks spanning ``span``
    consecutive ranks ([Note: the alpha-beta model]): each call pays its latencies."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    gpu, eff = cluster.gpu, cluster.efficiencies
    intra = span <= cluster.gpus_per_node
    gb_s = gpu.intra_node_gb_s
    if not intra and gpu.inter_node_gb_s_per_gpu:  # [Note: rings across nodes]
        per_node = max(1, min(size, cluster.gpus_per_node // max(span // size, 1)))
        gb_s = min(gpu.intra_node_gb_s, per_node * gpu.inter_node_gb_s_per_gpu)
    latency = calls * collective_steps(kind, size) * eff.latency_us * 1e-6
    return latency + nbytes / (gb_s * 1e9 * eff.link)


def collective_steps(kind: str, size: int) -> int:
    """Latencies one collective over ``size`` ranks pays ([Note: the alpha-beta model])."""
    steps = {"all_reduce": 2 * (size - 1), "p2p": 1}.get(kind, size - 1)
    if kind == "all_reduce":  # NCCL's tree for small messages: 2 log2(n) latencies where the ring's are more
        steps = min(steps, 2 * math.ceil(math.log2(size)))
    return steps


def op_time(op: Op, cluster: Cluster, dtype: str, fp8: bool = False, compiled: bool = False) -> float:
    """Seconds of one operator on ``cluster``'s GPU ([Note: the roofline]); ``fp8``: a matmul at the fp8 peak
    ([Note: fp8 matmuls]); ``compiled``: fused if pointwise ([Note: what compile changes])."""
    eff = cluster.efficiencies
    peak = cluster.peak_tflops(dtype, fp8 and op.kind == "matmul") * 1e12
    hbm = cluster.gpu.hbm_tb_s * 1e12 * eff.memory
    rate = eff.matmul_at(op.flops) if op.kind == "matmul" else eff.attention
    compute = op.flops / (peak * rate) if op.flops else 0.0
    fused = compiled and op.pointwise
    nbytes = op.out_bytes if fused else op.nbytes
    overhead = 0.0 if op.metadata_only or fused else eff.op_overhead_us * 1e-6
    arithmetic = op.elements * eff.elementwise_ns_of(op.name) * 1e-9  # [Note: arithmetic-bound operators]
    return max(compute, nbytes / hbm, arithmetic) + overhead


def _is_float8_matmul(op: Op, float8_linears: frozenset[tuple[int, int]]) -> bool:
    """Whether ``op`` is a converted linear's matmul ([Note: fp8 matmuls])."""
    if op.kind != "matmul":
        return False
    return any(shape in float8_linears or shape[::-1] in float8_linears for shape in op.shapes)


@dataclass(frozen=True)
class TimeEstimate:
    """One layout's predicted step on a cluster (seconds unless named otherwise)."""

    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    exposed_comm_s: float
    parts: dict[str, float]
    """The step's parts, which add up to ``step_time_s``: forward, backward (with recompute), exposed
    collectives by axis, the optimizer step, offload's copies, the pipeline bubble."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "exposed_comm_s": self.exposed_comm_s,
            "parts_s": dict(self.parts),
        }

    def format(self) -> str:
        parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.parts.items() if v > 0)
        return (
            f"  time: step {self.step_time_s * 1e3:.2f} ms, {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
            f"MFU {self.mfu:.1%}, exposed communication {self.exposed_comm_s * 1e3:.2f} ms\n    ({parts})"
        )


@dataclass(frozen=True)
class StepInputs:
    """What :func:`step_time` reads of a layout besides the fake run's work."""

    world: int
    dp: int
    micro_batch: int
    seq_len: int
    micro_batches: int
    dtype: str
    fp8: bool = False
    float8_linears: frozenset[tuple[int, int]] | None = None
    """FP8: the converted linears' weight shapes ([Note: fp8 matmuls]); None: every matmul at the fp8 peak."""
    stage: int = 0
    tp: int = 1
    sp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    shard: int = 1
    stages_per_rank: int = 1
    bubble: float | None = None
    layer_share: float = 1.0
    stepped_elements: int = 0
    """fp32 elements this rank's optimizer steps (its fragments; every element at stage 0)."""
    stepped_tensors: int = 0
    """Tensors this rank's optimizer steps: its parameters at stage 0, its fragments at 1-3 ([Note: the optimizer's
    host loop])."""
    offload_optimizer: str = "none"
    nvme_bytes: int = 0
    """NVMe offload: bytes read and written on swap files per step ([Note: what overlaps])."""
    compile: bool = False
    """``torch.compile``: memory-bound operators fuse into their neighbours ([Note: what compile changes])."""
    ring_bytes: int = 0
    """Context-parallel ring: bytes sent and reduce-scattered per step ([Note: why not torch's context_parallel])."""
    boundary_bytes: int = 0
    """Pipeline: one micro-batch's activation at a stage boundary (sent forward, its gradient back)."""
    tp_style: str = "shardtrain"
    """How the tensor parallelism runs: one of :data:`TP_STYLES` ([Note: how a stack runs its TP])."""
    hidden: int = 0
    """The model's hidden size (the width of the operators sequence parallelism splits; 0: unknown)."""


def step_time(work: MicroBatchWork, zero: ZeroTraffic, s: StepInputs, cluster: Cluster) -> TimeEstimate:
    """The step of one layout on ``cluster`` ([Note: the roofline], [Note: the alpha-beta model], [Note: what
    overlaps])."""
    eff = cluster.efficiencies
    if s.tp_style not in TP_STYLES:
        raise LayoutError(f"tp_style {s.tp_style!r}: expected one of {', '.join(TP_STYLES)}")
    place = Placement(s.world, s.tp, s.sp, s.cp, s.ep, s.pp, s.shard)
    split_sequence = s.tp > 1 and s.tp_style != "shardtrain" and s.hidden > 0  # [Note: how a stack runs its TP]
    fwd = bwd = 0.0
    matmul = {False: 0.0, True: 0.0}  # by phase (backward?): what TP's collectives may hide behind
    times: dict[Op, float] = {}
    for op, n in work.ops.items():
        if op not in times:
            fp8 = s.fp8 and (s.float8_linears is None or _is_float8_matmul(op, s.float8_linears))
            times[op] = op_time(op, cluster, s.dtype, fp8, s.compile)
        t = times[op] * n * (s.cp if op.kind == "attention" else 1)  # [Note: attention under context parallelism]
        if split_sequence and op.kind == "memory" and op.width == s.hidden:
            t /= s.tp
        if op.kind == "matmul":
            matmul[op.backward] += t
        if op.backward:
            bwd += t
        else:
            fwd += t
    share = s.layer_share
    stretch = 1 + eff.sync_skew if s.world > 1 else 1.0  # [Note: ranks that meet]
    fwd, bwd = fwd * share * stretch, bwd * share * stretch
    model_comm = Counter()
    tp_comm = {False: 0.0, True: 0.0}
    for c in work.collectives:
        if c.axis == "tp" and c.kind == "all_reduce" and s.tp_style != "shardtrain":  # a reduce-scatter + all-gather
            t = sum(collective_time(k, c.nbytes / 2, c.size, place.span("tp"), cluster) for k in _SP_HALVES)
        else:
            t = collective_time(c.kind, c.nbytes, c.size, place.span(c.axis), cluster)
        if c.axis == "tp" and s.tp_style == "sequence-parallel-overlap":
            tp_comm[c.backward] += t * share
        else:
            model_comm[c.axis] += t * share
    if s.tp_style == "sequence-parallel-overlap":
        model_comm["tp"] += sum(max(0.0, tp_comm[b] - matmul[b] * share) for b in (False, True))
    zspan = place.span("zero")

    def zero_time(kinds: dict[str, int], when: str = "") -> float:
        calls = zero.calls.get(when, {})
        return sum(collective_time(k, v, zero.group, zspan, cluster, calls.get(k, 1)) for k, v in kinds.items())

    m = s.micro_batches
    per_micro_zero = zero_time(zero.per_micro_batch, "per_micro_batch")
    boundary_zero = zero_time(zero.at_boundary, "at_boundary")
    unhidden = zero_time({"all_gather": zero.first_gather}) + zero_time({"reduce_scatter": zero.last_reduce})
    unhidden = min(unhidden, per_micro_zero + boundary_zero)
    window = fwd + bwd if s.stage == 3 else bwd
    hidden_micro = eff.overlap * min(max(per_micro_zero - unhidden, 0.0), window)
    exposed_zero = m * (per_micro_zero - hidden_micro)
    # the boundary's last bucket is reduced after backward's last gradient: nothing is left to hide it
    last_kind = "all_reduce" if s.stage == 0 else "reduce_scatter"
    last_bucket = min(zero_time({last_kind: zero.last_reduce * (2 if s.stage == 0 else 1)}), boundary_zero)
    hideable = boundary_zero - last_bucket
    exposed_zero += last_bucket + hideable - eff.overlap * min(hideable, bwd)
    replica = collective_time("all_reduce", zero.replica_all_reduce, zero.replicas, place.span("replicate"), cluster)
    exposed_zero += replica - eff.overlap * min(replica, max(bwd - boundary_zero, 0.0))
    after = zero_time(zero.after_step, "after_step")
    first_after = min(zero_time({"all_gather": zero.first_after_gather}), after)  # the next forward's first read
    exposed_zero += after - eff.overlap * min(after - first_after, fwd)
    if s.stage >= 1:  # the step's squared-norm all-reduce (two numbers), which every rank waits for
        exposed_zero += collective_time("all_reduce", 8, zero.group, zspan, cluster)
    ring = collective_time("all_gather", s.ring_bytes, s.cp, place.span("cp"), cluster) * share
    p2p = 0.0
    if s.pp > 1 and s.boundary_bytes:
        p2p = 2 * m * collective_time("p2p", s.boundary_bytes, 2, place.span("pp"), cluster)
    optimizer, (down, up), disk = _optimizer_time(s, cluster)
    optimizer *= stretch
    # [Note: overlapped offload] in offload/host_copies.py: gradients go down behind the last backward, each
    # sub-group's parameters up while the next one steps on the host
    offload = down - eff.overlap * min(down, bwd) + up - eff.overlap * min(up, optimizer)
    micro = fwd + bwd + sum(model_comm.values())
    pipeline = m * micro + ring
    bubble = pipeline * s.bubble / (1 - s.bubble) if s.pp > 1 and s.bubble else 0.0
    parts = {
        "forward": m * fwd,
        "backward": m * bwd,
        **{f"{axis} collectives": m * t for axis, t in sorted(model_comm.items())},
        "zero collectives (exposed)": exposed_zero,
        "cp ring": ring,
        "pipeline p2p": p2p,
        "pipeline bubble": bubble,
        "optimizer step": optimizer,
        "offload copies": offload,
        "nvme swaps": disk,
    }
    step = sum(parts.values())
    tokens = s.dp * m * s.micro_batch * s.seq_len
    forward_attention = sum(op.flops * n for op, n in work.ops.items() if op.kind == "attention" and not op.backward)
    forward_flops = work.forward_flops + (s.cp - 1) * forward_attention  # [Note: attention under context parallelism]
    model_flops = 3 * forward_flops * share * m  # this rank's share of the model FLOPs
    peak = cluster.peak_tflops(s.dtype, s.fp8) * 1e12
    exposed = sum(m * t for t in model_comm.values()) + exposed_zero + ring + p2p
    return TimeEstimate(step, tokens / step / s.world, model_flops / step / peak, exposed, parts)


TP_STYLES = ("shardtrain", "sequence-parallel", "sequence-parallel-overlap")
"""How a layout's tensor parallelism runs ([Note: how a stack runs its TP])."""
_SP_HALVES = ("reduce_scatter", "all_gather")


ADAM_BYTES_PER_ELEMENT = 28
"""Adam on fp32 masters: parameter, gradient and two moments read, parameter and two moments written
(docs/benchmarks-gpu.md, 'The floor of a host step')."""


def _optimizer_time(s: StepInputs, cluster: Cluster) -> tuple[float, tuple[float, float], float]:
    """(the optimizer step, offload's copies (gradients down, parameters up), NVMe swaps) in seconds, before any
    overlap ([Note: what overlaps])."""
    n = s.stepped_elements
    copy = 2 if s.dtype in ("bf16", "fp16") else 0  # the compute-dtype copy written after the step
    if s.offload_optimizer == "none":
        rate = cluster.gpu.hbm_tb_s * 1e12 * cluster.efficiencies.memory
        # [Note: the optimizer's host loop]
        loop = s.stepped_tensors * cluster.efficiencies.optimizer_us_per_tensor * 1e-6
        return n * (ADAM_BYTES_PER_ELEMENT + copy) / rate + loop, (0.0, 0.0), 0.0
    host_bytes = n * (HOST_STEP_BYTES_PER_ELEMENT + copy)
    cpu_only = cluster.gpu.name == "cpu"
    # a node's ranks share its host memory and disks; calibrate's figures are per rank already (all ranks at once)
    node_share = 1 if cpu_only else max(min(cluster.gpus_per_node, s.world), 1)
    host = host_bytes * node_share / (cluster.host_gb_s * 1e9)
    disk = s.nvme_bytes * node_share / (cluster.nvme_gb_s * 1e9)
    # fp32 gradients down; fp32 masters up, rounded on the device ([Note: overlapped offload])
    pcie = 0.0 if cpu_only else n * 4 / (cluster.pcie_gb_s * 1e9)
    return host, (pcie, pcie), disk


def sum_kinds(items: Iterable[wire.Collective]) -> dict[tuple[str, str], int]:
    """Bus bytes of the recorded collectives by (axis, kind)."""
    out: Counter = Counter()
    for c in items:
        out[c.axis, c.kind] += c.nbytes
    return dict(out)


__all__ = [
    "HOST_STEP_BYTES_PER_ELEMENT",
    "TP_STYLES",
    "MicroBatchWork",
    "Op",
    "StepInputs",
    "TimeEstimate",
    "ZeroTraffic",
    "collective_time",
    "is_metadata_only",
    "measure_work",
    "op_time",
    "step_time",
    "sum_kinds",
    "zero_traffic",
]
