"""From (model, ZeRO policy, data-parallel group, tensor-parallel placements) to the
:class:`~shardtrain.zero.layout.ShardLayout`.

Runs once, at the start of ``Engine.__init__`` (after ``parallelize`` cut the tensor-parallel blocks, before the
reducer, the optimizer wrapper and the ZeRO-3 runtime are made from it), in this order:

1. parameters built under ``shardtrain.zero.Init`` that will not be unit-sharded become whole again (see
   [Note: sharded construction]);
2. at stage 3, units are planned and laid out one at a time (rank 0's values broadcast into each unit's flat
   buffer, this rank's shard cut, the full buffer freed); small parameters stay whole (persistence threshold);
3. the other trainable parameters go into size-based buckets (see [Note: bucket layout]);
4. every rank takes rank 0's values of what it holds whole (parameters and buffers), as DDP does;
5. one :class:`ParamRecord` per parameter ties it all together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardtrain.construction.sharded_init import construction_runtime, is_under_construction
from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.placement import TPPlacement
from shardtrain.plan.policies import ZeroPolicy
from shardtrain.zero.guarded import guard_of
from shardtrain.zero.layout import (
    Bucket,
    ParamRecord,
    ShardLayout,
    UnitBuckets,
    build_buckets,
    group_by_size,
    state_tensors,
)
from shardtrain.zero.units import assign_parameters, find_unit_modules


def build_layout(
    module: nn.Module,
    policy: ZeroPolicy,
    comm: Communicator,
    tp_placements: Mapping[str, Any] | None = None,
    *,
    tp: int = 1,
    tp_rank: int = 0,
    dp_comm: Communicator | None = None,
    device: torch.device | None = None,
    experts: tuple[frozenset[int], Communicator] | None = None,
    ep: int = 1,
    ep_rank: int = 0,
    float8: Mapping[int, nn.Module] | None = None,
) -> ShardLayout:
    """Lay ``module``'s parameters out over the group of ``comm`` (see the module docstring).

    ``tp_placements``: how tensor parallelism split each parameter, by its name (absent: not split). ``dp_comm``:
    with hybrid sharding, every data-parallel rank (``comm`` is then this rank's shard group, see [Note: the hybrid
    mesh] in :mod:`shardtrain.distributed.mesh`): rank 0's values are broadcast over it, so that every replica starts
    from them; None: ``comm`` is the whole data-parallel group. ``device``: where stage-3 units are laid out, their
    parameters copied there unit by unit from wherever they are (see [Note: stage 3 from the host]). ``experts``:
    under expert parallelism, the ids of the expert parameters and the expert-data-parallel group they are laid out
    over (see [Note: expert buckets]; at stage 3 each unit's expert parameters are buckets of their own in it), with
    ``ep`` and ``ep_rank`` the expert group's size and this rank's index in it: their records say which experts this
    rank holds ([Note: split parameters] in ``zero/layout.py``). ``float8``: at stage 3, the ids of the weights
    gathered in float8, each with its torchao ``Float8Linear``; they get buckets of their own in their unit
    ([Note: gathering in float8] in ``zero/float8_gather.py``)."""
    sync = dp_comm if dp_comm is not None else comm
    replicas = sync.size // comm.size
    _finish_construction(module, policy, policy.persistence_threshold)
    expert_ids, expert_comm = experts if experts is not None else (frozenset(), comm)
    units: list[UnitBuckets] = []
    if policy.shard_parameters:
        units, outside = _plan_units(module, policy, comm, sync, device, (expert_ids, expert_comm), float8 or {})
        buckets = [b for u in units for b in u.buckets]
    else:
        outside = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        buckets = []
    # below stage 3 every trainable parameter, at stage 3 the persistent ones: size-based buckets
    dense = [(n, p) for n, p in outside if id(p) not in expert_ids]
    buckets += build_buckets(
        group_by_size(dense, policy.reduce_bucket_size), comm.size, comm.rank, first_index=len(buckets)
    )
    moe = [(n, p) for n, p in outside if id(p) in expert_ids]
    if moe:  # see [Note: expert buckets]
        grouped = group_by_size(moe, policy.reduce_bucket_size)
        for b in build_buckets(grouped, expert_comm.size, expert_comm.rank, first_index=len(buckets)):
            b.expert = True
            buckets.append(b)
    _sync_initial_state(module, buckets, sync, experts)
    where = {id(s.param): (b, i) for b in buckets for i, s in enumerate(b.slots)}
    placements = dict(tp_placements or {})
    expert_ids = experts[0] if experts is not None else frozenset()
    records = []
    for names, t in state_tensors(module):
        if not isinstance(t, nn.Parameter):
            continue
        placement = next((placements[n] for n in names if n in placements), None)
        bucket, slot = where.get(id(t), (None, -1))
        shape = tuple(placement.global_shape) if placement is not None else tuple(t.shape)
        split = None
        if id(t) in expert_ids and ep > 1:  # this rank's experts, rows [ep_rank * n/E, (ep_rank + 1) * n/E)
            if placement is not None:  # whole on every tp rank: the tp block is this rank's experts
                placement = dataclasses.replace(placement, global_shape=tuple(t.shape))
            shape = (t.shape[0] * ep, *t.shape[1:])
            split = TPPlacement(0, 1, shape)
        records.append(ParamRecord(tuple(names), t, shape, placement, bucket, slot, ep=split))
    return ShardLayout(
        policy, sync.size, sync.rank, buckets, units, records, tp=tp, tp_rank=tp_rank, replicas=replicas, ep=ep,
        ep_rank=ep_rank,
    )  # fmt: skip


def _finish_construction(module: nn.Module, policy: ZeroPolicy, threshold: int) -> None:
    """Parameters built under ``shardtrain.zero.Init`` that will not be unit-sharded become whole again;
    the others stay sharded until :func:`_plan_units` lays them out (see [Note: sharded construction])."""
    built = [p for p in module.parameters() if is_under_construction(p)]
    if not built:
        return
    runtime = construction_runtime(built[0])
    runtime.settle()
    for p in built:
        if not policy.shard_parameters or p.numel() < threshold:
            runtime.materialize(p)


def _plan_units(
    module: nn.Module,
    policy: ZeroPolicy,
    comm: Communicator,
    sync: Communicator,
    device: torch.device | None = None,
    experts: tuple[frozenset[int], Communicator] | None = None,
    float8: Mapping[int, nn.Module] | None = None,
) -> tuple[list[UnitBuckets], list[tuple[str, nn.Parameter]]]:
    """Stage 3: each unit's buckets in expected backward order, and the persistent parameters.

    Units are ordered last block first and the root last, the order their gradients complete in backward,
    because reductions are launched in bucket order (see [Note: collective order]). ``experts``: the expert
    parameters' ids and their expert-data-parallel group; a unit's expert parameters get buckets of their own in it,
    sharded over, gathered within and reduced over that group (see [Note: expert buckets])."""
    expert_ids, expert_comm = experts if experts is not None else (frozenset(), comm)
    unit_modules = find_unit_modules(module, policy.unit_classes)
    groups = assign_parameters(module, unit_modules)
    threshold = policy.persistence_threshold
    # small parameters stay whole: trainable ones are reduced like stage 2, frozen ones are left alone
    persistent = [(n, p) for g in groups for n, p in g if p.numel() < threshold and p.requires_grad]
    named = [*unit_modules[::-1], ("<root>", module)]
    params_of = [*groups[:-1][::-1], groups[-1]]
    specs: list[UnitBuckets] = []
    index = 0
    for (name, m), params in zip(named, params_of):
        by_kind: dict[tuple[torch.dtype, bool, bool, bool], list[tuple[str, nn.Parameter]]] = {}
        # trainable and frozen, dense, expert and float8-gathered parameters in buckets of their own
        for n, p in params:
            if p.numel() >= threshold:
                kind = (p.dtype, p.requires_grad, id(p) in expert_ids, id(p) in (float8 or {}))
                by_kind.setdefault(kind, []).append((n, p))
        if not by_kind:
            continue
        # one unit at a time: its full buffer exists only until rank 0's values are in and the shard is cut
        dense = [g for (_, _, moe, _), g in by_kind.items() if not moe]
        moe = [g for (_, _, moe, _), g in by_kind.items() if moe]
        buckets = build_buckets(dense, comm.size, comm.rank, first_index=index, device=device)
        if moe:  # see [Note: expert buckets]
            for b in build_buckets(
                moe, expert_comm.size, expert_comm.rank, first_index=index + len(dense), device=device
            ):
                b.expert = True
                buckets.append(b)
        for b in buckets:
            # expert parameters from the first rank holding the same experts: the others of sync hold other experts
            (expert_comm if b.expert else sync).broadcast(b.flat_param, 0, what=f"initial parameters of unit {name!r}")
            lo, hi = b.shard_range
            b.shard = b.flat_param[lo:hi].clone()
            b.gather_after_step = False
            b.flat_param.untyped_storage().resize_(0)
            if float8 and id(b.slots[0].param) in float8:  # see [Note: gathering in float8]
                b.float8 = {i: float8[id(slot.param)] for i, slot in enumerate(b.slots)}
                b.float8_data = torch.empty(b.padded_numel, dtype=torch.uint8, device=b.flat_param.device)
                b.float8_data.untyped_storage().resize_(0)
        _retire_construction([p for _, p in params if is_under_construction(p)])
        index += len(buckets)
        specs.append(UnitBuckets(name, m, buckets))
    built = [p for p in module.parameters() if is_under_construction(p)]
    if built:
        construction_runtime(built[0]).settle()
    return specs, persistent


def laid_out_whole(module: nn.Module, policy: ZeroPolicy) -> list[torch.Tensor]:
    """The tensors that stay whole on their device: every parameter and buffer below stage 3; at stage 3 the
    buffers and the parameters below the persistence threshold, the others going into units (see [Note: stage 3
    from the host])."""
    buffers = list(module.buffers())
    if not policy.shard_parameters:
        return [*module.parameters(), *buffers]
    return [p for p in module.parameters() if p.numel() < policy.persistence_threshold] + buffers


def _retire_construction(params: list[nn.Parameter]) -> None:
    """Free the construction chunks of parameters just laid out into a unit (their values are in its shard now):
    kept until ``initialize`` ends, every rank would hold its part of the model twice at its peak."""
    if not params:
        return
    construction_runtime(params[0]).settle()  # the last one touched is whole: take its chunk back first
    for p in params:
        for b in guard_of(p).unit.buckets:
            b.shard = b.shard.new_empty(0)


def _sync_initial_state(
    module: nn.Module,
    buckets: list[Bucket],
    comm: Communicator,
    experts: tuple[frozenset[int], Communicator] | None = None,
) -> None:
    """Every rank starts from rank 0's parameters and buffers (as DDP does); expert parameters, trainable or frozen,
    from the first rank of their expert-data-parallel group (``experts``: their ids and that group), which holds the
    same experts: the other ranks of ``comm`` hold other experts of the same shape."""
    expert_ids, expert_comm = experts if experts is not None else (frozenset(), comm)
    for b in buckets:
        if b.gather_after_step:  # stage-3 units were synchronized while they were built
            over = expert_comm if b.expert else comm
            over.broadcast(b.flat_param, 0, what=f"initial parameters of bucket {b.index}")
    bucketed = {id(s.param) for b in buckets for s in b.slots}
    for name, p in module.named_parameters():
        if id(p) not in bucketed:
            over = expert_comm if id(p) in expert_ids else comm
            over.broadcast(p.data, 0, what=f"initial value of frozen parameter {name!r}")
    for name, buf in module.named_buffers():
        comm.broadcast(buf, 0, what=f"initial value of buffer {name!r}")
