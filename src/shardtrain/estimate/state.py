"""Model-state bytes of one rank, laid out by the engine's own layout code on parameters without storage.

The planner does what ``build_layout`` does (``zero/build.py``), with the same functions: units from
:func:`~shardtrain.zero.units.find_unit_modules` and :func:`~shardtrain.zero.units.assign_parameters`, buckets
from :func:`~shardtrain.zero.layout.group_by_size` and :func:`~shardtrain.zero.layout.build_buckets` (so padding
to a multiple of the shard group and each rank's fragments are the engine's), on ``meta`` stand-ins of the
(tensor-parallel local) parameters. Then it counts what :meth:`Engine.state_bytes` counts:

* parameters: full flat buffers at stages 0-2, unit shards plus whole persistent parameters at stage 3, frozen
  parameters outside buckets, in the compute dtype; less unit shards in parameter swap files (``nvme``);
* gradients: a full buffer in the accumulation dtype per bucket at stages 0-1, one shard per bucket at 2-3;
* optimizer: fp32 masters of this rank's fragments under mixed precision, the optimizer's element-wise state of
  them (Adam: two moments; SGD with momentum: one) and Adam's 0-dim ``step`` per parameter; what optimizer
  offload keeps in swap files or host memory is reported where it lives.

Under expert parallelism (``expert_parallel_size: E``) the model is the rank's: ``num_experts / E`` experts of
every MoE layer ([Note: experts on fake tensors] in :mod:`.experts`). Its expert parameters are laid out as
``zero/build.py`` lays them out ([Note: expert buckets] in ``zero/layout.py``): in buckets of their own, padded to
and sharded over the ``dp / E`` ranks holding the same experts; dense parameters over all ``dp`` ranks. At stage 3
each unit's expert parameters are buckets of their own in it (after its dense ones), sharded over and gathered
within those ``dp / E`` ranks; persistent parameters (below the threshold) are held whole and reduced in buckets,
the expert ones over the same ranks.

Stage 3 also gives each unit's gathered size (its dense and expert buffers whole), which :mod:`.compute` replays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from shardtrain.offload.optimizer_state import SubGroup, WholeBuckets, make_sub_groups, whole_bucket_sub_groups
from shardtrain.offload.swap import ALIGN
from shardtrain.plan.policies import OffloadPolicy, ZeroPolicy
from shardtrain.zero.layout import Bucket, build_buckets, group_by_size
from shardtrain.zero.units import assign_parameters, find_unit_modules

FP32 = torch.float32


@dataclass
class UnitSize:
    name: str
    nbytes: int  # its full (gathered) flat buffers in the compute dtype
    numel: int
    root: bool
    float8_numel: int = 0
    """Elements of its buckets gathered in float8, 1 byte each in ``nbytes`` ([Note: gathering in float8] in
    ``zero/float8_gather.py``)."""


@dataclass
class RankState:
    """One rank's permanent bytes, each where it lives (``device``, ``host`` or ``nvme``)."""

    params: dict[str, int] = field(default_factory=dict)
    grads: dict[str, int] = field(default_factory=dict)
    optimizer: dict[str, int] = field(default_factory=dict)
    """Keys ``masters``, ``moments``, ``steps`` (each ``where:kind``) and ``offload_buffers``."""
    units: list[UnitSize] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    """Stand-in buckets (meta parameters) in the engine's order, trainable and frozen."""
    bucket_names: list[list[str]] = field(default_factory=list)
    zenflow: dict[str, int] = field(default_factory=dict)
    """Stall-free offload (``zero_optimization.zenflow``), [Note: ZenFlow in the estimate]: ``selected`` (device: the
    top-k columns' fp32 values and the device twin's moments), ``host_state`` (host masters and the host twin's
    moments), ``host_grads`` (the accumulator, its twin and two staging buffers the gradients come down into)."""
    offload_buffers_least: int = 0
    """``nvme`` optimizer offload: the bytes of the ``buffer_count`` smallest sub-groups' swap buffers. The estimate
    counts the largest ones (``optimizer["offload_buffers"]``), which the pipeline holds in a step; between steps the
    buffers hold the sub-groups they held last, which the timing of the writes decides: the peak outside the step
    lies between the two ([Note: swap pipeline] in ``offload/optimizer_state.py``)."""


def _stand_ins(model: nn.Module) -> dict[int, nn.Parameter]:
    """A storage-less copy of every distinct parameter (the layout code re-points their ``.data``)."""
    out: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        if id(p) not in out:
            out[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    return out


def plan_buckets(
    model: nn.Module,
    policy: ZeroPolicy,
    world: int,
    rank: int,
    experts: frozenset[int] = frozenset(),
    ep: int = 1,
    expert_world: int | None = None,
    float8: frozenset[int] = frozenset(),
) -> tuple[list[Bucket], list[tuple[str, list[int]]], list[tuple[str, nn.Parameter]]]:
    """The engine's buckets (stand-ins), stage-3 units as (name, bucket indices) and the parameters held whole.
    ``experts``: the ids of the expert parameters of a model split for expert parallelism of size ``ep``, laid
    out over the ``expert_world`` ranks holding the same experts (``dp / ep``; None: ``world / ep``, which it is
    without hybrid sharding; this rank's index there: ``rank // ep``). ``float8``: at stage 3, the ids of the
    weights gathered in float8: buckets of their own in their unit, as ``zero/build.py`` makes them (their
    ``float8`` set to an empty mapping: the planner has no ``Float8Linear``)."""
    proxy = _stand_ins(model)
    float8_stand_ins = {id(proxy[i]) for i in float8 if i in proxy}
    # the ranks holding this rank's experts, and its index there; with hybrid sharding too they are all dp / ep of
    # them (expert buckets are never replicated: [Note: expert buckets] in zero/layout.py)
    ep_world, ep_rank = (expert_world or world // ep), rank // ep

    def swap(items: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
        return [(n, proxy[id(p)]) for n, p in items]

    units: list[tuple[str, list[int]]] = []
    buckets: list[Bucket] = []
    if policy.shard_parameters:  # as zero/build.py's _plan_units
        unit_modules = find_unit_modules(model, policy.unit_classes)
        groups = assign_parameters(model, unit_modules)
        threshold = policy.persistence_threshold
        outside = [(n, p) for g in groups for n, p in g if p.numel() < threshold and p.requires_grad]
        named = [*[n for n, _ in unit_modules[::-1]], "<root>"]
        params_of = [*groups[:-1][::-1], groups[-1]]
        for name, params in zip(named, params_of):
            # trainable and frozen, dense and expert parameters in buckets of their own; the expert ones after the
            # dense ones of the unit, sharded over the ranks holding the same experts
            by_kind: dict[tuple[torch.dtype, bool, bool, bool], list[tuple[str, nn.Parameter]]] = {}
            for n, p in params:
                if p.numel() >= threshold:
                    kind = (p.dtype, p.requires_grad, id(p) in experts, id(p) in float8)
                    by_kind.setdefault(kind, []).append((n, p))
            if not by_kind:
                continue
            dense = [swap(g) for (_, _, moe, _), g in by_kind.items() if not moe]
            moe = [swap(g) for (_, _, moe, _), g in by_kind.items() if moe]
            made = build_buckets(dense, world, rank, first_index=len(buckets))
            for b in build_buckets(moe, ep_world, ep_rank, first_index=len(buckets) + len(dense)):
                b.expert = True
                made.append(b)
            for b in made:
                b.gather_after_step = False
                if id(b.slots[0].param) in float8_stand_ins:
                    b.float8 = {}
            units.append((name, [b.index for b in made]))
            buckets += made
    else:
        outside = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # as zero/build.py: below stage 3 every trainable parameter, at stage 3 the persistent ones: dense buckets over
    # the group, then the expert buckets over theirs
    dense_outside = [(n, p) for n, p in outside if id(p) not in experts]
    buckets += build_buckets(
        group_by_size(swap(dense_outside), policy.reduce_bucket_size), world, rank, first_index=len(buckets)
    )
    moe_outside = [(n, p) for n, p in outside if id(p) in experts]
    if moe_outside:
        grouped = group_by_size(swap(moe_outside), policy.reduce_bucket_size)
        for b in build_buckets(grouped, ep_world, ep_rank, first_index=len(buckets)):
            b.expert = True
            buckets.append(b)
    bucketed = {id(s.param) for b in buckets for s in b.slots}
    whole = [(n, proxy[id(p)]) for n, p in model.named_parameters() if id(proxy[id(p)]) not in bucketed]
    return buckets, units, whole


def _itemsize(dtype: torch.dtype, compute: torch.dtype) -> int:
    """Bytes per element once the engine casts fp32 tensors to the compute dtype (mixed precision)."""
    return (compute if dtype == FP32 else dtype).itemsize


def rank_state(
    model: nn.Module,
    policy: ZeroPolicy,
    offload: OffloadPolicy,
    world: int,
    rank: int,
    compute: torch.dtype,
    moments: int,
    step_scalars: bool,
    device_type: str,
    grads_in_files: bool = False,
    experts: frozenset[int] = frozenset(),
    ep: int = 1,
    expert_world: int | None = None,
    accum: torch.dtype = FP32,
    float8: frozenset[int] = frozenset(),
    muon: Callable[[str, torch.Size], bool] | None = None,
    collective_step: bool = False,
) -> RankState:
    """Bytes of one rank whose ZeRO shard group has ``world`` ranks and which is ``rank`` in it; ``grads_in_files``:
    the gradient shards are in swap files (``GradOffload`` in offload/gradients.py; the caller knows tp and hybrid).
    ``experts``, ``ep``, ``expert_world``: expert parallelism, as :func:`plan_buckets` takes them. ``accum``: the
    dtype compute-dtype gradients accumulate in (the precision policy's ``accum_dtype``). ``float8``: the weights
    ZeRO-3 gathers in float8 (:func:`plan_buckets`); their units' gathered bytes count 1 per element. ``muon(name,
    shape)``: the parameters a Muon optimizer steps, with one state tensor (its momentum) and no step counter; the
    others keep ``moments`` and ``step_scalars``. ``collective_step``: the optimizer's step is collective (Muon's
    owners, LAMB's shard sums), its offloaded sub-groups are whole buckets ([Note: sub-groups of whole buckets] in
    offload/optimizer_state.py)."""
    mixed = compute != FP32
    buckets, units, whole = plan_buckets(model, policy, world, rank, experts, ep, expert_world, float8)
    st = RankState(buckets=buckets, bucket_names=[[s.name for s in b.slots] for b in buckets])
    opt_dev, par_dev = offload.optimizer.device, offload.param.device

    # parameters (Engine.state_bytes)
    unit_of = {i: name for name, idx in units for i in idx}
    resident, mapped = 0, 0
    kept = 0
    unit_shards = {name: sum(buckets[i].shard_numel for i in idx) for name, idx in units}
    mapped_units = set()
    if par_dev == "nvme":  # the first units (layout order) stay in memory up to max_in_cpu elements
        for name, _ in units:
            if kept + unit_shards[name] <= offload.param.max_in_cpu:
                kept += unit_shards[name]
            else:
                mapped_units.add(name)
    # on a GPU the unit shards parameter offload does not put in files wait in host memory ([Note: parameter uploads])
    uploaded = device_type == "cuda" and par_dev != "none"
    on_host = 0
    for b in buckets:
        size = _itemsize(b.dtype, compute)
        n = b.padded_numel if b.gather_after_step else b.shard_numel
        if unit_of.get(b.index) in mapped_units:
            mapped += n * size
        elif uploaded and b.index in unit_of:
            on_host += n * size
        else:
            resident += n * size
    resident += sum(p.numel() * _itemsize(p.dtype, compute) for _, p in whole)
    st.params = {"device": resident, "nvme": mapped}
    if on_host:
        st.params["host"] = on_host

    # gradients (GradientReducer)
    grads = 0
    for b in buckets:
        if not b.requires_grad:
            continue
        size = _itemsize(b.dtype, compute)
        acc = accum.itemsize if size < 4 else size
        grads += (b.shard_numel if policy.shard_gradients else b.padded_numel) * acc
    st.grads = {"device": 0, "nvme": grads} if grads_in_files else {"device": grads}

    # optimizer (ShardedOptimizer.state_bytes and offload/optimizer_state.py)
    slots = [(s, f) for b in buckets if b.requires_grad for s, f in zip(b.slots, b.fragments)]
    stepped = [f.length if policy.shard_optimizer_state else s.numel for s, f in slots]
    by_muon = [muon is not None and muon(s.name, s.shape) for s, _ in slots]
    masters_per = [4 * n if mixed else 0 for n in stepped]
    moments_per = [4 * (1 if m else moments) * n for n, m in zip(stepped, by_muon)]
    steps = 4 * by_muon.count(False) if step_scalars else 0
    opt: dict[str, int] = {}
    if opt_dev == "nvme":
        groups = _sub_groups(
            buckets, stepped, offload.optimizer.sub_group_size, offload.optimizer.ratio, collective_step
        )
        on_disk = [i for g in groups if g.offloaded for i in g.members]
        in_mem = [i for g in groups if not g.offloaded for i in g.members]
        opt["nvme"] = sum(masters_per[i] + moments_per[i] for i in on_disk)
        opt["host" if device_type == "cuda" else "device"] = sum(masters_per[i] + moments_per[i] for i in in_mem)
        # buffers: ``buffer_count`` of them, each sized to the sub-group it holds (state files, and the gradients
        # when they are in files, each ALIGN-ed in it): at most the ``buffer_count`` largest sub-groups at once
        keys = moments + (1 if mixed else 0) + (1 if grads_in_files else 0)
        sizes = [sum(keys * (-(-4 * stepped[i] // ALIGN) * ALIGN) for i in g.members) for g in groups if g.offloaded]
        opt["offload_buffers"] = sum(sorted(sizes)[-offload.optimizer.buffer_count :])
        # the pool keeps each buffer at the size of the last sub-group it held (within FRAME_SLACK), which sub-groups
        # those are depends on when the writes finish: between steps at least the smallest ones
        st.offload_buffers_least = sum(sorted(sizes)[: offload.optimizer.buffer_count])
    elif offload.optimizer.zenflow is not None:
        st.zenflow = _zenflow_bytes(offload, slots, stepped, moments, device_type)
        opt["device"] = sum(masters_per)  # S: the fp32 masters stay where the step runs
        steps *= 2  # each twin counts its steps
    elif opt_dev == "cpu" and device_type == "cuda":
        # host masters: fp32 copies of the fragments, in fp32 training too; state made on the host
        opt["host"] = sum(4 * n for n in stepped) + sum(moments_per)
    else:  # in memory (on a CPU-only machine 'cpu' offload is where the state already is)
        opt["device"] = sum(masters_per) + sum(moments_per)
    opt["steps"] = steps
    st.optimizer = opt
    if device_type == "cuda" and opt_dev != "none" and offload.optimizer.zenflow is None:
        # the host step's gradients: each reduced shard copied into a page-locked fp32 buffer ([Note: overlapped
        # offload]), one element per element stepped there
        on_host = range(len(stepped))  # nvme: every master is on the host, in a file or resident
        if opt_dev == "cpu":  # partial offload (ratio): the other sub-groups step on the device
            groups = _sub_groups(
                buckets, stepped, offload.optimizer.sub_group_size, offload.optimizer.ratio, collective_step
            )
            on_host = [i for g in groups if g.offloaded for i in g.members]
        st.grads["host"] = sum(4 * stepped[i] for i in on_host)

    # stage 3: gathered units
    for name, idx in units:
        in_float8 = sum(buckets[i].padded_numel for i in idx if buckets[i].float8 is not None)
        nbytes = in_float8 + sum(
            buckets[i].padded_numel * _itemsize(buckets[i].dtype, compute) for i in idx if buckets[i].float8 is None
        )
        numel = sum(buckets[i].padded_numel for i in idx)
        st.units.append(UnitSize(name, nbytes, numel, name == "<root>", in_float8))
    return st


def _zenflow_bytes(
    offload: OffloadPolicy, slots: list, stepped: list[int], moments: int, device_type: str
) -> dict[str, int]:
    """[Note: ZenFlow in the estimate]
    What :class:`~shardtrain.offload.zenflow.ZenFlowStep` (on a GPU :class:`~shardtrain.offload.zenflow_device.
    DeviceZenFlowStep`) holds besides ``S`` (the fp32 masters, counted as without offload): the selected elements in
    fp32 and the device twin's ``moments`` of them (``selected``); host masters ``H`` and the host twin's moments
    (``host_state``); the accumulator ``A`` and its twin, and on a GPU two staging buffers (``host_grads``), all
    fp32 (the dtype the step's gradients arrive in, checked against the engine in a test). A 2-D weight's selected
    elements are ``max(1, int(columns * topk_ratio))`` columns of every row; a rank's fragment holds its share of
    them (exact where the rank holds whole weights, the expected share otherwise: the gradients decide which columns
    are selected); other parameters are selected whole.
    Transient on a GPU: each step's gradient snapshots and, at a landing, an fp32 buffer of ``S``'s size."""
    ratio = offload.optimizer.zenflow.topk_ratio
    selected = 0
    for (s, _), n in zip(slots, stepped):
        shape = s.shape
        if len(shape) == 2 and shape[1]:
            selected += n * max(1, int(shape[1] * ratio)) // shape[1]
        else:
            selected += n
    total = sum(stepped)
    staging = 2 * 4 * total if device_type == "cuda" else 0
    return {
        "selected": 4 * (1 + moments) * selected,
        "host_state": 4 * (1 + moments) * total,
        "host_grads": 2 * 4 * total + staging,
    }


def _sub_groups(buckets: list, stepped: list[int], size: int, ratio: float, collective_step: bool) -> list[SubGroup]:
    """The optimizer offload's sub-groups over the trainable buckets' ``stepped`` sizes, as
    ``build_optimizer_offload`` cuts them."""
    if not collective_step:
        return make_sub_groups(stepped, size, ratio)
    trainable = [b for b in buckets if b.requires_grad]
    where = tuple(k for k, b in enumerate(trainable) for _ in b.slots)
    return whole_bucket_sub_groups(stepped, WholeBuckets(where, tuple(b.shard_numel for b in trainable)), size, ratio)
