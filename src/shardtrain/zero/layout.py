"""Flat bucket layout: which parameter lives where in which flat buffer, and what this rank owns.

[Note: bucket layout]
Trainable parameters (at stage 3 also frozen ones, in buckets of their own) are grouped by dtype and laid out in
reverse registration order (roughly the order gradients become ready) into buckets of at most ``reduce_bucket_size``
elements (a larger parameter gets its own). A bucket is one flat buffer padded to a multiple of the data-parallel
size ``N``; rank ``r`` owns the chunk ``[r*S, (r+1)*S)``, ``S = padded/N``. Each parameter's storage is redirected to
its place in the flat buffer, so one reduce-scatter gives every rank exactly its chunk's gradients, and the all-gather
after the step writes straight into the parameters. A rank's *fragment* of a parameter is the intersection of its
range with chunk ``r``, recorded as offsets (:class:`Fragment`), never re-derived from padding rules. Padding is zero
in parameters and gradients and never handed to the optimizer. At stage 3 a bucket is a *unit*
(:mod:`shardtrain.zero.units`): ``shard`` has storage of its own and the full buffer's storage is freed between uses;
parameters stay views of the full buffer, so a re-gather refills the very storage autograd saved for backward.

[Note: expert buckets]
Under expert parallelism (``expert_parallel_size: E``, [Note: the expert axis] in :mod:`shardtrain.distributed.mesh`)
expert parameters, which differ between the ranks of an expert group, get buckets of their own, as in DeepSpeed-MoE:
padded to, sharded, reduced and gathered over the ``dp / E`` ranks holding the same experts; dense parameters keep
buckets over the whole data-parallel axis. At stage 3 a unit's expert parameters are buckets of their own in that unit
(persistent ones in persistent expert buckets). An expert bucket's gradient is its group's average divided by ``E``
([Note: tokens to their experts]). Fragments stay disjoint across all data-parallel ranks, so the sum of their squares
over ``dp`` counts each expert and dense gradient once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from shardtrain.plan.policies import ZeroPolicy


@dataclass(eq=False)
class ParamSlot:
    """One trainable parameter's place in its bucket."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int

    @property
    def shape(self) -> torch.Size:
        return self.param.shape


@dataclass(frozen=True)
class Fragment:
    """The part of one parameter that this rank owns: elements ``[start, start+length)`` of it flattened,
    stored at ``shard_offset`` within this rank's chunk of the bucket."""

    start: int
    length: int
    shard_offset: int


@dataclass(eq=False)
class Bucket:
    index: int
    dtype: torch.dtype
    slots: list[ParamSlot]
    numel: int
    padded_numel: int
    world: int
    rank: int
    flat_param: torch.Tensor = field(repr=False)
    shard: torch.Tensor = field(repr=False)
    """This rank's chunk: a view of ``flat_param`` (stages 0-2) or storage of its own (stage-3 units)."""
    fragments: list[Fragment] = field(default_factory=list)
    gather_after_step: bool = True
    """Whether the optimizer step is followed by an all-gather (False for stage-3 units: gathered on use)."""
    requires_grad: bool = True
    """Trainable parameters; a frozen bucket (stage-3 units only) is gathered with its unit, never reduced."""
    expert: bool = False
    """Expert parameters under expert parallelism: ``world`` and ``rank`` are the expert-data-parallel group's, and
    the bucket is reduced and gathered over that group (see [Note: expert buckets])."""
    float8: dict[int, nn.Module] | None = None
    """Stage 3 with fp8: slot index -> the torchao ``Float8Linear`` whose weight the slot is; forward and backward
    gather these weights in float8 into ``float8_data`` ([Note: gathering in float8] in ``zero/float8_gather.py``)."""
    float8_data: torch.Tensor | None = field(default=None, repr=False)
    """The float8 gather's full 1-byte buffer; its storage is freed while the unit is sharded, as ``flat_param``'s."""
    float8_scales: torch.Tensor | None = field(default=None, repr=False)
    """The scales of the float8 gather in flight or done (one per converted slot, in slot order)."""

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel


def _fragment(slot: ParamSlot, lo: int, hi: int) -> Fragment:
    a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
    if a >= b:  # this rank owns nothing of the parameter; keep an empty fragment at a stable place
        return Fragment(start=0, length=0, shard_offset=0)
    return Fragment(start=a - slot.offset, length=b - a, shard_offset=a - lo)


def group_by_size(
    named_params: list[tuple[str, nn.Parameter]], bucket_numel: int
) -> list[list[tuple[str, nn.Parameter]]]:
    """Greedy buckets of at most ``bucket_numel`` elements per dtype, in reverse registration order."""
    by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
    for name, p in reversed(named_params):
        by_dtype.setdefault(p.dtype, []).append((name, p))
    groups: list[list[tuple[str, nn.Parameter]]] = []
    for items in by_dtype.values():
        current: list[tuple[str, nn.Parameter]] = []
        size = 0
        for name, p in items:
            if current and size + p.numel() > bucket_numel:
                groups.append(current)
                current, size = [], 0
            current.append((name, p))
            size += p.numel()
        if current:
            groups.append(current)
    return groups


def build_buckets(
    groups: list[list[tuple[str, nn.Parameter]]],
    world: int,
    rank: int,
    first_index: int = 0,
    own_shard: bool = False,
    device: torch.device | None = None,
) -> list[Bucket]:
    """One flat bucket per group (one dtype each); each parameter is pointed at its slice.

    Each Parameter must appear once overall (tied parameters under their first name). With ``own_shard``
    the rank's chunk is copied into storage of its own (stage-3 units). ``device``: where the flat buffer is made
    (default the first parameter's): parameters elsewhere are copied in, so that a model on the host reaches the
    device one bucket at a time (see [Note: stage 3 from the host]).
    """
    buckets = []
    for index, items in enumerate(groups, start=first_index):
        numel = sum(p.numel() for _, p in items)
        padded = -(-numel // world) * world
        first = items[0][1]
        if any(p.dtype != first.dtype or p.requires_grad != first.requires_grad for _, p in items):
            raise ValueError("a bucket holds parameters of one dtype, all trainable or all frozen")
        flat = torch.zeros(padded, dtype=first.dtype, device=device if device is not None else first.device)
        slots, offset = [], 0
        for name, p in items:
            n = p.numel()
            flat[offset : offset + n].copy_(p.detach().reshape(-1))
            with torch.no_grad():
                p.data = flat[offset : offset + n].view(p.shape)
            slots.append(ParamSlot(name=name, param=p, offset=offset, numel=n))
            offset += n
        shard_numel = padded // world
        lo, hi = rank * shard_numel, (rank + 1) * shard_numel
        shard = flat[lo:hi].clone() if own_shard else flat[lo:hi]
        bucket = Bucket(index, first.dtype, slots, numel, padded, world, rank, flat_param=flat, shard=shard)
        bucket.requires_grad = first.requires_grad
        bucket.fragments = [_fragment(s, lo, hi) for s in slots]
        buckets.append(bucket)
    return buckets


def cast_bucket(b: Bucket, dtype: torch.dtype) -> None:
    """Re-create a bucket's flat buffer (and a stage-3 unit's own shard) in ``dtype`` and re-point its
    parameters; a stage-3 unit's full buffer keeps its storage freed."""
    resident = b.flat_param.untyped_storage().nbytes() > 0
    flat = b.flat_param.to(dtype) if resident else torch.empty(b.padded_numel, dtype=dtype, device=b.flat_param.device)
    # parameters of stage-3 units guard their data (see [Note: guarded parameters]); this is layout work
    with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
        for s in b.slots:
            s.param.data = flat[s.offset : s.offset + s.numel].view(s.shape)
    if not resident:
        flat.untyped_storage().resize_(0)
    lo, hi = b.shard_range
    b.shard = flat[lo:hi] if b.gather_after_step else b.shard.to(dtype)
    b.flat_param, b.dtype = flat, dtype


def fragment_places(buckets: list[Bucket]) -> list[tuple[Bucket, int]]:
    """(bucket, slot index) of every slot of ``buckets``, bucket by bucket, slot by slot: the order of the tensors
    the optimizer wrapper steps (its *members*), by which the optimizer offload's sub-groups, gradient files and host
    copies index them."""
    return [(b, i) for b in buckets for i in range(len(b.slots))]


def fragment_tensor(b: Bucket, i: int, sharded: bool) -> torch.Tensor:
    """This rank's fragment of slot ``i`` of ``b``: a view of the bucket's shard (``sharded``: stages 1-3), or the
    parameter itself (stage 0, where whole parameters are stepped)."""
    if not sharded:
        return b.slots[i].param
    f = b.fragments[i]
    return b.shard[f.shard_offset : f.shard_offset + f.length]


@dataclass(eq=False)
class ParamRecord:
    """Everything the engine's parts need to know about one parameter (see [Note: the layout])."""

    names: tuple[str, ...]
    """Every state-dict name of the parameter (a tied parameter has several; the first is canonical)."""
    param: nn.Parameter
    global_shape: tuple[int, ...]
    """The whole tensor's shape across the tensor-parallel group, or across the expert group for an expert parameter
    (every expert of the layer); the local shape when not split."""
    tp: Any = None
    """How tensor parallelism splits it (a ``TPPlacement``); None when every tp rank holds the same tensor."""
    bucket: Bucket | None = None
    """The flat bucket it lives in; None for a parameter held whole outside every bucket (frozen below stage 3,
    frozen and under the persistence threshold at stage 3)."""
    slot: int = -1
    ep: Any = None
    """How expert parallelism splits it (a ``TPPlacement`` on dim 0 over the expert group: rank ``ep_rank`` holds
    experts ``[ep_rank * n/E, (ep_rank + 1) * n/E)``, [Note: split parameters]); None for a dense parameter."""

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def fragment(self) -> Fragment | None:
        """What this data-parallel rank owns of the (local) parameter, None outside buckets."""
        return self.bucket.fragments[self.slot] if self.bucket is not None else None

    @property
    def held_whole(self) -> bool:
        """Whether this rank holds the parameter's full (local) value between steps."""
        return self.bucket is None or self.bucket.gather_after_step

    @property
    def tp_split(self) -> bool:
        return self.tp is not None and self.tp.dim is not None

    @property
    def split(self) -> Any:
        """The placement that cuts this rank's tensor out of the whole one (tensor- or expert-parallel), or None."""
        return self.tp if self.tp_split else self.ep


class SplitBlock(NamedTuple):
    """[Note: split parameters]
    A parameter is split one of two ways, each a block of the whole tensor along one dimension: by tensor
    parallelism (``placement`` a column or row split, maybe strided, over the ``tp`` ranks) or by expert
    parallelism (dim 0, one row per expert, over the ``E`` ranks of an expert group). Either way this rank holds
    block ``index`` of ``count``, and the ``replicas`` ranks numbered ``replica`` among them (the data-parallel ranks,
    or the expert-data-parallel ranks ``dp / E``) hold the same block: the checkpoint records a block and ZeRO's
    fragments of it (``BlockFlatSlice``), weight loading reads the block, and a block held whole is written in
    ``replicas`` shares. Nothing here depends on the ZeRO stage."""

    placement: Any  # a TPPlacement: dim, stride, global_shape
    index: int
    count: int
    replica: int
    replicas: int


class UnitBuckets(NamedTuple):
    """Where one ZeRO-3 unit's parameters live: its name (``<root>`` for the root's), its module and its buckets (one
    per dtype and trainability). The runtime makes a :class:`~shardtrain.zero.units.Unit` of it."""

    name: str
    module: nn.Module
    buckets: list[Bucket]


@dataclass(eq=False)
class ShardLayout:
    """[Note: the layout]
    Where every parameter lives, built once from (model, ZeRO config, dp communicator, tp placements) by
    :func:`shardtrain.zero.build.build_layout` before any other part of the engine, and read by the gradient
    reducer (``buckets``), the optimizer wrapper (fragments), the ZeRO-3 runtime (``unit_buckets``), weight loading and
    the checkpoint code (``records``). Nothing is set on the parameters themselves: a parameter's record is found
    with :meth:`record_of`.
    """

    policy: ZeroPolicy
    dp: int
    """Data-parallel ranks (batches differ along them): with hybrid sharding ``replicas`` x the shard group size."""
    dp_rank: int
    buckets: list[Bucket]
    unit_buckets: list[UnitBuckets]
    """Each ZeRO-3 unit's buckets, in expected backward order; empty below stage 3."""
    records: list[ParamRecord]
    """Every parameter once, in ``named_parameters()`` order."""
    tp: int = 1
    tp_rank: int = 0
    replicas: int = 1
    """Hybrid sharding: copies of every bucket's shards, one per group of ``dp // replicas`` ranks (each bucket's
    ``world``); 1 when the buckets are sharded over the whole data-parallel group."""
    ep: int = 1
    """Expert parallelism: the size ``E`` of an expert group ([Note: the expert axis]); 1 without it."""
    ep_rank: int = 0

    def __post_init__(self) -> None:
        self._by_id = {id(r.param): r for r in self.records}

    def record_of(self, t: torch.Tensor) -> ParamRecord | None:
        return self._by_id.get(id(t))

    def block_of(self, record: ParamRecord | None) -> SplitBlock | None:
        """This rank's block of a split parameter ([Note: split parameters]), None for one held the same by every
        rank of its tensor-parallel and expert groups."""
        if record is None or record.split is None:
            return None
        if record.tp_split and record.ep is not None:
            raise ValueError(f"{record.name!r} is split by both tensor and expert parallelism, which is not built")
        if record.tp_split:
            return SplitBlock(record.tp, self.tp_rank, self.tp, self.dp_rank, self.dp)
        return SplitBlock(record.ep, self.ep_rank, self.ep, self.dp_rank // self.ep, self.dp // self.ep)

    @property
    def trainable_buckets(self) -> list[Bucket]:
        """Buckets that are reduced and stepped (frozen stage-3 buckets are only gathered)."""
        return [b for b in self.buckets if b.requires_grad]


def state_tensors(module: torch.nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each distinct parameter and buffer with all its state-dict names (a tied parameter has several)."""
    grouped: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        grouped.setdefault(id(t), ([], t))[0].append(name)
    return list(grouped.values())
