"""How ``initialize`` applies the plan to a model: one named step per axis, in the order :func:`parallelize` reads.

====================  ==========================================================================================
apply_pp              the model pruned to this rank's pipeline stages, each stage's forward a module of its own
apply_construction    a model built deferred (``zero.Init(config)``, ``meta``) records its initialization; any other
                      moves to the device what stays whole there ([Note: stage 3 from the host])
apply_tp              the layers split over the tensor-parallel axis (Megatron), before anything is laid out
apply_ep              each rank keeps its experts; their token exchange is installed
(materialize)         a deferred model's parameters made as each rank's chunk, after the splits
communicators         ZeRO's groups and the desync check; ranks agree on config and model; swap directories
apply_sp              Ulysses (or context-parallel attention) around the model's attention; the tiled loss and MLP
apply_fp8             the linear layers torchao's float8 training converts, by policy; the rest kept by name
apply_zero            the layout: where every parameter lives (``zero/build.py``); from here on the model is changed
apply_precision       fp32 masters of each fragment, then parameters and buffers cast to the compute dtype
apply_units           stage 3's eager runtime: units, hooks and the gather service, handed the parameter offload
                      and hpZ's secondary shards ([Note: one gather service] in ``zero/gather.py``)
apply_activation_checkpointing   the blocks (ZeRO-3's units) recomputed in backward by policy, their inputs kept in
                      host memory with ``cpu_checkpointing`` (after the runtime: [Note: the order of a checkpointed
                      block's hooks])
apply_step            gradient sinks (optimizer offload), the reducer and the optimizer over this rank's fragments
apply_graph           graph mode around the eager runtime ([Note: one runtime, two implementations])
monitor               metrics on rank 0
====================  ==========================================================================================

Before the first, ``initialize`` resolves what DeepSpeed's pipeline keys ask of this model
(:func:`apply_checkpoint_interval`). Each step is handed what the steps before it made; nothing is attached
afterwards. Every refusal a user can cause
happened before: the plan's (:func:`shardtrain.config.plan.resolve_plan`) and ``initialize``'s own checks, so a
refused ``initialize`` leaves the model as it was. What can fail after the layout is a resource (a full disk, a
peer lost); the swap directories made for offload are then removed again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from shardtrain.activations import HostOffload, TPPartition, apply_checkpointing
from shardtrain.config.sections import Config, gradient_predivide, resolve_batch_sizes
from shardtrain.construction.sharded_init import (
    ExpertRows,
    expert_rows_cut,
    is_deferred,
    is_under_construction,
    materialize_deferred,
    record_initialization,
)
from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.desync import PhaseCheck
from shardtrain.distributed.mesh import Topology
from shardtrain.distributed.placement import TPPlacement
from shardtrain.engine.monitor import TrainingMonitor
from shardtrain.engine.pipeline_sequence import SequenceInPipeline
from shardtrain.errors import ConfigError, LayoutError, RankMismatchError, ShardtrainError
from shardtrain.estimate.activation_budget import choose_checkpointing, source_of_module
from shardtrain.estimate.planner import fmt_bytes
from shardtrain.expert_parallel import expert_weights, install_expert_parallel
from shardtrain.offload import host_copies, param_uploads, zenflow_device
from shardtrain.offload.optimizer_state import (
    GradientSinks,
    OptimizerOffload,
    WholeBuckets,
    build_gradient_sinks,
    build_optimizer_offload,
    host_masters,
)
from shardtrain.offload.parameters import ParamOffload
from shardtrain.offload.swap import ScratchDir, SwapFiles, on_every_rank, prepare_scratch
from shardtrain.offload.zenflow import ZenFlowStep
from shardtrain.pipeline_parallel import Pipeline, cut_model, stage_ids_of_rank, tied_across_stages
from shardtrain.pipeline_parallel.cut import BuiltAsStage, check_can_split_sequence
from shardtrain.plan import Plan
from shardtrain.plan.policies import (
    ActivationPolicy,
    Float8Policy,
    OffloadPolicy,
    PrecisionPolicy,
    ZenFlowPolicy,
    ZeroPolicy,
)
from shardtrain.precision.float8 import Float8Conversion, convert_to_float8
from shardtrain.precision.loss_scaler import LossScaler
from shardtrain.runtime.eager import EagerRuntime
from shardtrain.runtime.interface import Runtime
from shardtrain.sequence_parallel import (
    ContextSplitter,
    PatchSplitter,
    Seq2SeqSplitter,
    SequenceSplitter,
    install_context_attention,
    install_ulysses,
    make_splitter,
)
from shardtrain.sequence_parallel.tiling import install as install_tiling
from shardtrain.tensor_parallel import parallelize as split_tensor_parallel
from shardtrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardtrain.tensor_parallel.parallelize import check_plan_matches, check_replicated_gradients
from shardtrain.zero.build import build_layout, laid_out_whole
from shardtrain.zero.float8_gather import take_precast_weights
from shardtrain.zero.gather import ShardSource
from shardtrain.zero.hpz import SecondaryShards
from shardtrain.zero.layout import Bucket, ShardLayout, cast_bucket
from shardtrain.zero.optimizer import MakeOffload, MakeZenFlow, ShardedOptimizer, TensorParallelNorm, make_masters
from shardtrain.zero.reducer import GradientReducer
from shardtrain.zero.units import find_unit_modules

log = logging.getLogger("shardtrain")


@dataclass(frozen=True)
class Comms:
    """The engine's communicators (see the table in docs/architecture.md)."""

    shard: Communicator  # ZeRO's collectives: the dp axis, or its shard groups with hybrid sharding
    replica: Communicator | None  # hybrid sharding: the gradient shards' all-reduce across replicas
    dp: Communicator  # every data-parallel rank (``shard`` itself without hybrid sharding)
    world: Communicator  # every rank: checkpoint protocols, agreement checks, the gradient norm on a (dp, tp) mesh
    tp: Communicator | None  # tensor-parallel layers' collectives (None without tensor parallelism)
    hpz: Communicator | None = None  # ZeRO++ hpZ at stage 3: backward gathers within a node (None without it)
    ep: Communicator | None = None  # expert parallelism: the expert group's token exchange (None without it)
    edp: Communicator | None = None  # expert parallelism: the ranks holding the same experts, their buckets' group


@dataclass(frozen=True)
class Parts:
    """What :func:`parallelize` returns; the engine holds each under the same name."""

    comms: Comms
    # sequence parallelism: the all-to-alls and the split of the sequence (or of an encoder-decoder's two)
    sp: SequenceSplitter | PatchSplitter | Seq2SeqSplitter | ContextSplitter | None
    phase_check: PhaseCheck  # [Note: phase agreement]
    scratch: dict[str, ScratchDir]  # offload's swap directories by config section
    layout: ShardLayout
    precision: PrecisionPolicy
    scaler: LossScaler | None
    param_offload: ParamOffload | param_uploads.ParamUploads | None
    reducer: GradientReducer
    optimizer: ShardedOptimizer
    runtime: Runtime
    monitor: TrainingMonitor
    activation_offload: HostOffload | None = None  # the host copies of checkpointed blocks' inputs (cpu_checkpointing)
    pipeline: Pipeline | None = None  # pipeline parallelism: this rank's stages and their schedule
    fp8: Float8Conversion | None = None  # fp8.enabled: the layers converted to torchao's Float8Linear, and those kept


@dataclass(frozen=True)
class _Split:
    """What the model-splitting steps made: the tensor-parallel communicator and placements, and under expert
    parallelism the ids of the expert parameters with the expert group's communicator."""

    tp_comm: Communicator | None = None
    placements: Mapping[str, TPPlacement] | None = None
    experts: tuple[frozenset[int], Communicator] | None = None


def parallelize(
    model: nn.Module,
    plan: Plan,
    topology: Topology,
    optimizer: torch.optim.Optimizer,
    config: Config,
    tp_plan: Mapping[str, str] | None = None,
) -> Parts:
    """Apply ``plan`` to ``model`` in the order of the module docstring and return the engine's parts. Collective.
    ``config``: only what is not a policy: the ranks' agreement check hashes it, the monitor reads its sections."""
    # refused before the model is touched; found in the whole model, whose layer list a pipeline's cut turns into a
    # ModuleDict of this rank's layers ([Note: stages keep the model's names] in pipeline_parallel/cut.py)
    blocks = checkpointed_blocks(model, plan)
    if plan.dims.pp > 1 and topology.tp > 1 and tp_plan is not None:  # a stage holds only some of its patterns
        check_plan_matches(model, tp_plan)
    pipeline = apply_pp(model, plan, topology, optimizer)
    if pipeline is not None:
        kept = {id(m) for m in model.modules()}
        blocks = [b for b in blocks if id(b) in kept]
    else:  # found again once the model is laid out, as they always were
        blocks = None
    deferred = apply_construction(model, plan, topology)
    split = apply_tp(model, plan, topology, tp_plan, deferred)
    split = apply_ep(model, topology, split, deferred)
    comms = make_comms(topology, split.tp_comm, split.experts[1] if split.experts is not None else None)
    # every rank says where it is before each call that communicates ([Note: phase agreement]); its own
    # Communicator over the world group, so that comm_stats() keeps only the traffic of the ZeRO formulas
    phase_check = PhaseCheck(
        Communicator(topology.host_world_group, topology.timeout_s) if config.desync_check else None,
        topology.tp,
        topology.device,
        sp=topology.sp,
        cp=topology.cp,
    )
    _check_ranks_agree(comms.world, model, config)
    if pipeline is not None:  # the stages hold other layers, but their configs must agree too
        _check_ranks_agree(Communicator(topology.world_group, topology.timeout_s), model, config, ("config",))
    # swap directories are checked on every rank before the model is touched (see docs/offload.md); a failure of
    # the rest (a full disk, a peer lost) leaves none behind
    scratch = _prepare_offload(plan.offload, topology, comms.world)
    try:
        sp = apply_sp(model, plan, topology)
        if pipeline is not None and sp is not None:  # [Note: a sequence split in a pipeline]
            pipeline.share_sequence(SequenceInPipeline(sp, model.config))
        fp8 = apply_fp8(model, plan.fp8, tensor_parallel=split.tp_comm is not None)
        float8 = float8_weights(model, plan, fp8)
        # graph mode gathers the units as operations of its captured graphs, and hpZ cuts its secondary shards from
        # the gathered compute-dtype buffers: both in the compute dtype
        in_float8 = plan.fp8.gather_in_float8 and not plan.graph.enabled and not plan.dims.hpz_asked
        layout = apply_zero(model, plan.zero, topology, comms, split, float8, in_float8)
        fp8 = with_float8_gathers(model, fp8, layout)
        masters = apply_precision(model, layout, plan.precision)
        param_offload = _param_offload(layout, plan.offload, scratch, comms.world, topology.rank, topology.device)
        eager = apply_units(model, plan, topology, comms, layout, param_offload, phase_check)
        activation_offload = apply_activation_checkpointing(
            blocks if blocks is not None else checkpointed_blocks(model, plan), plan, topology, split.tp_comm
        )
        # a weight tied across the first and last stage counts in the norm on the first ([Note: weights tied
        # across stages] in pipeline_parallel/cut.py)
        counted_elsewhere = frozenset(id(p) for p in pipeline.tied) if pipeline and not pipeline.first else frozenset()
        reducer, sharded = apply_step(
            model, plan, topology, comms, layout, masters, eager, split, optimizer, scratch, config, counted_elsewhere
        )
        runtime = apply_graph(model, plan, eager, comms, reducer, layout, param_offload, pipeline)
        # metrics, monitors (TensorBoard/CSV/wandb) and wall-clock breakdown: rank 0 only, never communicates
        monitor = TrainingMonitor(config, topology.rank, topology.device, topology.dp)
    except BaseException:
        for s in scratch.values():
            s.remove()
        raise
    for comm in (comms.shard, comms.replica, comms.dp, comms.hpz, comms.ep, comms.edp):  # comm_stats() counts from here
        if comm is not None:
            comm.reset_stats()
    scaler = LossScaler.from_policy(plan.precision.loss_scale, topology.device)
    return Parts(
        comms, sp, phase_check, scratch, layout, plan.precision, scaler, param_offload, reducer, sharded, runtime,
        monitor, activation_offload, pipeline, fp8,
    )  # fmt: skip


def make_comms(topology: Topology, tp_comm: Communicator | None, ep_comm: Communicator | None = None) -> Comms:
    shard = Communicator(topology.shard_group, topology.timeout_s)
    # see [Note: the hybrid mesh] in shardtrain/mesh.py: gradient shards are all-reduced across the replicas and
    # what must reach every data-parallel rank goes over the dp axis
    replica = Communicator(topology.replicate_group, topology.timeout_s) if topology.hybrid else None
    dp = Communicator(topology.zero_group, topology.timeout_s) if topology.hybrid else shard
    # the ranks of one model: under pipeline parallelism one stage's ([Note: tensor parallelism in a pipeline stage])
    world = dp if topology.tp == 1 else Communicator(topology.model_group, topology.timeout_s)
    hpz = Communicator(topology.hpz_group, topology.timeout_s) if topology.hpz_group is not None else None
    ep = edp = None
    if topology.ep > 1:  # see [Note: the expert axis] in shardtrain/distributed/mesh.py
        ep = ep_comm if ep_comm is not None else Communicator(topology.ep_group, topology.timeout_s)
        edp = Communicator(topology.edp_group, topology.timeout_s)
    return Comms(shard, replica, dp, world, tp_comm, hpz, ep, edp)


# -- the steps, in order ---------------------------------------------------------------------------------------


def apply_pp(model: nn.Module, plan: Plan, topology: Topology, optimizer: torch.optim.Optimizer) -> Pipeline | None:
    """Pipeline parallelism: ``model`` pruned in place to this rank's stages (``pp_rank``, ``pp_rank + pp``, ...
    of ``pp * stages_per_rank``, torch's loop placement), their names kept ([Note: stages keep the model's names] in
    ``pipeline_parallel/cut.py``); the engine builds the schedule over them, once it knows the micro-batches. The
    optimizer's param groups keep only this rank's parameters: the others' memory is freed with the model's."""
    if plan.dims.pp == 1:
        return None
    num_stages = plan.dims.pp * plan.pipeline.stages_per_rank
    stage_ids = stage_ids_of_rank(plan.pipeline.schedule, plan.dims.pp, plan.pipeline.stages_per_rank, topology.pp_rank)
    tied = [p for p in tied_across_stages(model) if p.requires_grad]  # read before the cut prunes the model
    # [Note: tensor parallelism in a pipeline stage] torch cannot infer a tensor-parallel stage's shapes on meta
    # tensors: they are given ([Note: stage shapes given, not inferred] in pipeline_parallel/schedule.py). The ranks
    # of one stage hold one model as the world's do without pipelining: they broadcast it, agree on it and sum the
    # tensor-parallel norm over ``Topology.model_group``; a stage's full_state_dict joins its blocks over tp.
    splits_sequence = topology.sp > 1 or topology.cp > 1  # [Note: a sequence split in a pipeline]
    if splits_sequence:
        check_can_split_sequence(model, topology.sp, topology.cp)
    # refused by name before the model is touched; given where a stage's exchanges cannot run on meta tensors
    width = activation_width(model) if topology.tp > 1 or splits_sequence else None
    parts, loss_fn = cut_model(model, num_stages, stage_ids)
    kept = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in kept]
    tied = [p for p in tied if id(p) in kept]
    if 0 in stage_ids and num_stages - 1 in stage_ids:
        tied = []  # a V-shaped schedule's first and last stage: one parameter on one rank, nothing to sum across
    if tied and not any(p.is_meta for p in tied):
        # the last stage starts from the first stage's values, as DeepSpeed's _synchronize_tied_weights: a
        # PipelineModule builds its tied module once per stage ([Note: weights tied across stages])
        ends = Communicator(topology.pp_ends_group, topology.timeout_s)
        for p in tied:
            value = p.detach().to(topology.device, copy=True)
            ends.broadcast(value, 0, what="weights tied across stages (the first stage's initial values)")
            with torch.no_grad():
                p.copy_(value)
    return Pipeline(
        parts, stage_ids, num_stages, loss_fn, tied, activation_width=width, weights=list(model.parameters())
    )


def apply_checkpoint_interval(model: nn.Module, plan: Plan) -> Plan:
    """[Note: DeepSpeed's checkpoint interval] DeepSpeed's PipelineEngine sets its ``PipelineModule``'s
    ``activation_checkpoint_interval`` from ``pipeline.activation_checkpoint_interval`` > 0, and the module then
    checkpoints its layers in runs of that many (those holding parameters). A shim ``PipelineModule`` (a model built
    as its stage) is given the interval likewise and checkpoints as DeepSpeed's. A model cut here checkpoints each
    block (ZeRO-3's units) on its own, whole: an interval of 1 is ``activation_checkpointing.policy`` ``full`` (the
    returned plan's), as DeepSpeed checkpoints one layer per run; a longer run is not built and refused by name, as
    is an interval beside another ``policy``. Before the model is touched."""
    interval = plan.pipeline.checkpoint_interval
    if interval == 0:
        return plan
    if isinstance(model, BuiltAsStage):
        if not hasattr(model, "activation_checkpoint_interval"):
            raise ConfigError(
                f"pipeline.activation_checkpoint_interval {interval}: {type(model).__name__} is built as its stage "
                "but has no activation_checkpoint_interval to set (a PipelineModule's); remove the key"
            )
        model.activation_checkpoint_interval = interval
        return plan
    if interval > 1:
        raise ConfigError(
            f"pipeline.activation_checkpoint_interval {interval} on {type(model).__name__}: shardtrain checkpoints "
            "each block of a model it cuts on its own, not runs of several; set it to 1 (each block recomputed in "
            'backward, as activation_checkpointing.policy "full") or use activation_checkpointing.policy'
        )
    if plan.activations.recompute not in ("none", "full"):
        raise ConfigError(
            f"pipeline.activation_checkpoint_interval 1 (each block recomputed whole) and activation_checkpointing."
            f"policy {plan.activations.recompute!r} ask for two checkpointings; give one of them"
        )
    return dataclasses.replace(plan, activations=dataclasses.replace(plan.activations, recompute="full"))


def activation_width(model: nn.Module) -> int:
    """The hidden size a cut model's stages send each other: a GPT's ``d_model``, a Hugging Face model's
    ``hidden_size``."""
    cfg = getattr(model, "cfg", None)
    width = getattr(cfg, "d_model", None) or getattr(getattr(model, "config", None), "hidden_size", None)
    if width is None:
        raise ConfigError(
            f"{type(model).__name__} with pipeline and tensor parallelism is not built yet: the stages' activation "
            "shapes are read from the hidden size of a GPT (cfg.d_model) or a Hugging Face model (config.hidden_size), "
            "and it has neither; set tensor_parallel.size 1 or pipeline_parallel_size 1"
        )
    return int(width)


def apply_construction(model: nn.Module, plan: Plan, topology: Topology) -> bool:
    """Whether ``model`` was built deferred (under ``zero.Init(config)`` with tensor parallelism, or on ``meta``): its
    parameters are made as chunks after the splits, and a model built on ``meta`` without ``Init`` records its
    ``reset_parameters()`` now, before the split. Any other model moves to the device what stays whole there."""
    deferred = is_deferred(model)
    if deferred:
        record_initialization(model)
    else:
        move_whole_parts(model, plan.zero, topology)
    return deferred


def apply_tp(
    model: nn.Module, plan: Plan, topology: Topology, tp_plan: Mapping[str, str] | None, deferred: bool
) -> _Split:
    """Split the layers over the tensor-parallel axis (docs/tensor-parallel.md), before anything is laid out or
    built over the parameters. A plan given at size 1 splits nothing: one script serves every layout."""
    if topology.tp == 1:
        return _Split()
    # with expert parallelism the experts stay whole on every tp rank ([Note: experts beside tensor parallelism])
    whole_experts = expert_weights(model, topology.ep) if topology.ep > 1 else None
    tp_comm = Communicator(topology.tp_group, topology.timeout_s)
    if not deferred:  # deferred values are the same on every rank by construction: nothing to broadcast
        refuse_sharded_construction(model)
        broadcast_model(model, Communicator(topology.model_group, topology.timeout_s))
    # a deferred model's gradient check needs real parameters: it runs after materialization (apply_ep)
    placements = split_tensor_parallel(
        model,
        tp_plan,
        tp_comm,
        check_replicated_grads=not deferred,
        whole_experts=whole_experts,
        compute_dtype=plan.precision.compute_dtype,
        one_stage=plan.dims.pp > 1,
    )
    if not any(p.is_split for p in placements.values()):
        raise LayoutError(
            f"tensor_parallel.size is {topology.tp} but the tensor-parallel plan splits no parameter of "
            f"{type(model).__name__}: its patterns match none of the model's module names (a model wrapped in "
            "another module has longer names; pass initialize(tp_plan=...) with the full names)"
        )
    return _Split(tp_comm, placements)


def apply_ep(model: nn.Module, topology: Topology, split: _Split, deferred: bool) -> _Split:
    """Each rank keeps its experts of rank 0's model ([Note: the expert axis]); then a deferred model's parameters
    are made as this rank's data-parallel chunk of its tensor-parallel block (or of its experts' rows)."""
    rows = None
    if topology.ep > 1:
        ep_comm = Communicator(topology.ep_group, topology.timeout_s)
        edp_comm = Communicator(topology.edp_group, topology.timeout_s)
        if not deferred:  # meta rows are cut as they are: see [Note: experts under sharded construction]
            broadcast_model(model, Communicator(topology.zero_group, topology.timeout_s), split="expert-parallel")
        ids = install_expert_parallel(model, ep_comm, expert_rows_cut(edp_comm), split.tp_comm)
        split = _Split(split.tp_comm, split.placements, (ids, ep_comm))
        rows = ExpertRows(ids, edp_comm, topology.ep_rank, topology.ep)
    if deferred:
        dp_comm = Communicator(topology.zero_group, topology.timeout_s)
        materialize_deferred(model, split.placements, dp_comm, topology.tp_rank, topology.tp, topology.device, rows)
        if split.tp_comm is not None:
            check_replicated_gradients(model, split.placements, split.tp_comm)
    return split


def apply_sp(model: nn.Module, plan: Plan, topology: Topology) -> Any:
    """Ulysses around the model's attention (docs/sequence-parallel.md), or context-parallel attention
    (docs/context-parallel.md), and ALST's tiled loss and MLP; returns the batch splitter of sequence or context
    parallelism (None without either)."""
    sp = None
    if topology.cp > 1:  # with Ulysses inside each cp rank when sp > 1 (docs/context-parallel.md)
        cp = ContextSplitter(model, Communicator(topology.seq_group, topology.timeout_s), topology.cp)
        ulysses_comm = Communicator(topology.sp_group, topology.timeout_s) if topology.sp > 1 else None
        ring_comm = Communicator(topology.cp_group, topology.timeout_s) if topology.sp > 1 else cp.comm
        install_context_attention(model, ring_comm, lambda: cp.current, ulysses_comm, topology.tp)
        sp = cp
    elif topology.sp > 1:
        sp = make_splitter(model, Communicator(topology.sp_group, topology.timeout_s))
        install_ulysses(
            model,
            sp.comm,
            tp=topology.tp,
            key_limit=getattr(sp, "key_limit", None),
            whole_inputs=getattr(sp, "whole_inputs", None),
        )
    install_tiling(model, plan.tiling)
    return sp


def apply_zero(
    model: nn.Module,
    policy: ZeroPolicy,
    topology: Topology,
    comms: Comms,
    split: _Split,
    float8: Mapping[int, nn.Module] | None = None,
    gather_in_float8: bool = True,
) -> ShardLayout:
    """Where every parameter lives ([Note: the layout]); built before anything else touches the model. ``float8``:
    the converted weights at stage 3, with their modules: buckets of their own in their units, gathered in float8
    with ``gather_in_float8`` ([Note: gathering in float8]; the modules then take the pre-cast weights), else in the
    compute dtype (the same layout: the same numerics)."""
    expert_ids = split.experts[0] if split.experts is not None else frozenset()
    layout = build_layout(
        model,
        policy,
        comms.shard,
        split.placements,
        tp=topology.tp,
        tp_rank=topology.tp_rank,
        dp_comm=comms.dp,
        device=topology.device,
        experts=(expert_ids, comms.edp) if comms.edp is not None else None,
        ep=topology.ep,
        ep_rank=topology.ep_rank,
        float8=float8,
    )
    for b in layout.buckets:
        if b.float8 is not None and not gather_in_float8:  # the same buckets, gathered in the compute dtype
            b.float8 = b.float8_data = None
        for m in (b.float8 or {}).values():
            take_precast_weights(m)
    return layout


def with_float8_gathers(
    model: nn.Module, conversion: Float8Conversion | None, layout: ShardLayout
) -> Float8Conversion | None:
    """``conversion`` with the names of the layers whose weights ZeRO-3 gathers in float8 (what the layout made)."""
    if conversion is None:
        return None
    in_float8 = {id(m) for b in layout.buckets for m in (b.float8 or {}).values()}
    names = tuple(name for name, m in model.named_modules() if id(m) in in_float8)
    return dataclasses.replace(conversion, gathered_in_float8=names)


def float8_weights(model: nn.Module, plan: Plan, conversion: Float8Conversion | None) -> dict[int, nn.Module]:
    """The converted weights ZeRO-3 can gather in float8, by id, each with its ``Float8Linear``: at stage 3 with the
    tensorwise recipe (one scale per weight, which the gather computes)."""
    if conversion is None or not plan.zero.shard_parameters or plan.fp8.recipe != "tensorwise":
        return {}
    # a tensor-parallel layer's weight is a block: its scale is the whole weight's, over the tensor-parallel ranks
    # ([Note: float8 under tensor parallelism]); its unit gathers it in the compute dtype
    modules = [model.get_submodule(name) for name in conversion.converted if name not in conversion.tensor_parallel]
    return {id(m.weight): m for m in modules}


def apply_precision(model: nn.Module, layout: ShardLayout, precision: PrecisionPolicy) -> Any:
    """Mixed precision ([Note: mixed precision]): fp32 masters of each trainable fragment, made from the fp32 values,
    then the parameters and floating buffers cast to the compute dtype; returns the masters (None without mixed
    precision). Frozen buckets (stage-3 units) are never stepped, so they get none."""
    if not precision.mixed:
        return None
    masters = make_masters(layout.trainable_buckets, layout.policy)
    _cast_to_compute_dtype(model, layout, precision)
    return masters


def apply_units(
    model: nn.Module,
    plan: Plan,
    topology: Topology,
    comms: Comms,
    layout: ShardLayout,
    param_offload: ShardSource | None,
    phase_check: PhaseCheck,
) -> EagerRuntime:
    """The eager runtime: at stage 3 the units, their hooks and the gather service, handed its two collaborators
    (the parameter offload, made after the cast so that its swap files hold compute-dtype shards, and hpZ's
    secondary shards, [Note: secondary shards]); below stage 3 it has no units and installs nothing. Under pipeline
    parallelism it installs no hooks: ``train_batch`` gathers the stage for its whole schedule ([Note: a stage gathered
    for its schedule] in ``pipeline_parallel/schedule.py``)."""
    secondary = SecondaryShards(comms.hpz) if comms.hpz is not None and layout.unit_buckets else None
    return EagerRuntime(
        model,
        layout.unit_buckets,
        comms.shard,
        plan.prefetch,
        plan.zero.gather_check,
        check_group=topology.host_shard_group,
        secondary=secondary,
        source=param_offload,
        expert_comm=comms.edp,
        phase_checked=phase_check.comm is not None,
        module_hooks=plan.dims.pp == 1,
    )


def apply_fp8(model: nn.Module, policy: Float8Policy, tensor_parallel: bool = False) -> Float8Conversion | None:
    """With ``fp8.enabled``, the linear layers swapped for torchao's ``Float8Linear`` (``precision/float8.py``), before
    the layout: the conversion keeps every Parameter object, so what is built over them (layout, masters, units'
    hooks on the blocks around the converted layers) is built as without fp8 ([Note: no float8 state]). After
    ``apply_tp``: with ``tensor_parallel`` the column- and row-parallel layers compute their local matmul in float8
    ([Note: float8 under tensor parallelism] in ``tensor_parallel/float8.py``)."""
    if not policy.enabled:
        return None
    parallel = (ColumnParallelLinear, RowParallelLinear) if tensor_parallel else ()
    return convert_to_float8(model, policy, parallel_linears=parallel)


def apply_activation_checkpointing(
    blocks: list[nn.Module], plan: Plan, topology: Topology, tp_comm: Communicator | None = None
) -> HostOffload | None:
    """Checkpoint ``blocks`` (:func:`checkpointed_blocks`: those ZeRO-3 makes units of, at every stage; under
    pipeline parallelism this rank's) as ``plan.activations`` says; returns the host offload of their inputs (None
    without ``cpu_checkpointing``). After the stage-3 runtime, whose hooks must be outside the checkpoint's ([Note:
    the order of a checkpointed block's hooks])."""
    policy = plan.activations
    if not policy.enabled:
        return None
    offload = HostOffload(topology.device) if policy.offload_inputs else None
    partition = None
    if policy.partition_inputs and tp_comm is not None and tp_comm.size > 1:  # [Note: partitioned block inputs]
        comm = tp_comm

        def gather(chunk: torch.Tensor) -> torch.Tensor:
            return comm.all_gather_dim(chunk, 0, what="partitioned activation checkpoint")

        partition = TPPartition(comm.rank, comm.size, gather)
    apply_checkpointing(blocks, policy, offload, partition)
    return offload


def choose_activation_budget(
    model: nn.Module,
    plan: Plan,
    config: Config,
    topology: Topology,
    optimizer: torch.optim.Optimizer,
    tp_plan: Mapping[str, str] | None,
) -> Plan:
    """``policy: "budget"``: ``plan`` with each block's recompute chosen by the planner so that the predicted peak
    fits the budget, the least recompute that does ([Note: checkpointing by budget] in
    ``estimate/activation_budget.py``); logged on rank 0. A budget nothing fits is refused by name. Every other
    policy: ``plan`` as it is. Before the model is touched: the planner copies it onto fake tensors."""
    policy = plan.activations
    if policy.recompute != "budget":
        return plan
    assert policy.memory_budget is not None and policy.budget_seq_len is not None  # the config's section says so
    blocks = checkpointed_blocks(model, plan)  # the same refusals as the other policies, first
    if any(p.is_meta or p.numel() == 0 for p in model.parameters()):
        raise ConfigError(
            "activation_checkpointing.policy 'budget' plans on the model's shapes, and some parameters have none yet "
            "(on the meta device, or built sharded by zero.Init): build the model whole, or use 'selective' or "
            "'full' (`shardtrain estimate --memory-limit` says which fits)"
        )
    kind = type(optimizer).__name__.lower()
    choice = choose_checkpointing(
        source_of_module(model),
        config,
        world_size=topology.world_size,
        budget=policy.memory_budget,
        seq_len=policy.budget_seq_len,
        device_type=topology.device.type,
        offload_inputs=policy.offload_inputs,
        tp_plan=tp_plan,
        optimizer=kind if kind in ("adam", "adamw", "sgd") else None,
    )
    if len(choice.per_block) != len(blocks):  # the planner found the blocks the engine checkpoints
        raise ShardtrainError(f"the budget's choice covers {len(choice.per_block)} blocks, the model has {len(blocks)}")
    if topology.rank == 0:
        log.info(
            "activation checkpointing by budget: %s against a budget of %s (%d tokens per sequence)",
            choice.describe(),
            fmt_bytes(policy.memory_budget),
            policy.budget_seq_len,
        )
    return replace(plan, activations=replace(policy, per_block=choice.per_block))


def checkpointed_blocks(model: nn.Module, plan: Plan) -> list[nn.Module]:
    """The blocks ``plan.activations`` checkpoints: ZeRO-3's units without the root; a model with none, or whose
    transformers layers checkpoint themselves already, is refused."""
    policy: ActivationPolicy = plan.activations
    if not policy.enabled:
        return []
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ConfigError(
            f"activation_checkpointing.policy {policy.recompute!r} on a model whose own gradient checkpointing is on "
            "(transformers' gradient_checkpointing_enable(), or the Trainer's gradient_checkpointing): each block "
            "would be checkpointed twice; turn one of them off"
        )
    blocks = [m for _, m in find_unit_modules(model, plan.zero.unit_classes) if m is not model]
    if not blocks:
        raise ConfigError(
            f"activation_checkpointing.policy {policy.recompute!r}: {type(model).__name__} has no repeated blocks "
            "to checkpoint (a ModuleList or Sequential of two or more modules of one class); name the block class "
            "with zero_optimization.stage3_unit_classes"
        )
    return blocks


def apply_step(
    model: nn.Module,
    plan: Plan,
    topology: Topology,
    comms: Comms,
    layout: ShardLayout,
    masters: Any,
    eager: EagerRuntime,
    split: _Split,
    optimizer: torch.optim.Optimizer,
    scratch: dict[str, ScratchDir],
    config: Config,
    counted_elsewhere: frozenset[int] = frozenset(),
) -> tuple[GradientReducer, ShardedOptimizer]:
    """The reducer and the optimizer over this rank's fragments, with the optimizer offload: where the reducer sends
    complete gradient shards (swap files or host copies) is built first, from the tensors the optimizer wrapper will
    step (the masters, else the fragments); a device run whose optimizer steps on the host keeps its masters there
    ([Note: overlapped offload]). ``counted_elsewhere``: the parameters whose gradient another pipeline stage counts
    in the global norm (a tied weight's, [Note: weights tied across stages] in ``pipeline_parallel/cut.py``)."""
    policy, offload = layout.policy, plan.offload.optimizer
    trainable = layout.trainable_buckets  # frozen buckets (stage-3 units) are never reduced nor stepped
    # ZenFlow on a GPU: the masters stay on the device, what it moves it moves itself ([Note: ZenFlow on the device])
    zenflow_streams = zenflow_device.zenflow_streams(topology.device) if offload.zenflow is not None else None
    streams = host_copies.copy_streams(topology.device) if offload.enabled and zenflow_streams is None else None
    if streams is not None:
        masters = _host_masters(masters, trainable, policy, plan.offload)
    files = SwapFiles(scratch["offload_optimizer"], topology.rank) if "offload_optimizer" in scratch else None
    sinks = GradientSinks()
    if offload.enabled and zenflow_streams is None:
        sinks = build_gradient_sinks(
            trainable,
            masters,
            files,
            streams,
            sharded_state=policy.shard_optimizer_state,
            sharded_grads=policy.shard_gradients,
            grad_dtypes=[plan.precision.grad_dtype(b.dtype) for b in trainable],
            read_in_memory=topology.tp > 1 or (comms.replica is not None and comms.replica.size > 1),
            # parameter offload on the device: the fragments are host shards ([Note: parameter uploads])
            host_fragments=plan.offload.param.device != "none" and bool(layout.unit_buckets),
            pin_memory=offload.pin_memory,
        )
    partial_grads = _partial_grads(layout)
    reducer = GradientReducer(
        trainable,
        policy,
        comms.shard,
        # under pipeline parallelism a bucket is reduced once, after the schedule's last micro-batch ([Note: one
        # pipeline step] in pipeline_parallel/schedule.py), not when its first micro-batch's gradients are ready
        policy.overlap_comm and plan.dims.pp == 1,
        on_grad_ready=eager.on_grad_ready if eager.units else None,
        reduce_dtype=plan.precision.reduce_dtype if plan.precision.mixed else None,
        accum_dtype=plan.precision.accum_dtype,
        tp_partial=(comms.tp, partial_grads) if partial_grads and comms.tp is not None else None,
        predivide=gradient_predivide(config, topology.shard_size),
        replicate=comms.replica,
        order_comm=comms.dp,
        experts=(comms.edp, topology.ep) if comms.edp is not None else None,
        grad_files=sinks.files,
        host_copies=sinks.copies,
        # a pipeline step's micro-batches in one backward ([Note: one pipeline step])
        micro_batches_per_backward=resolve_batch_sizes(config, topology.dp)[2] if plan.dims.pp > 1 else 1,
    )
    tp_norm = None
    if topology.tp > 1:
        tp_norm = TensorParallelNorm(
            comms.world,
            frozenset(id(r.param) for r in layout.records if r.tp_split),
            topology.zero_rank,
            topology.tp_rank,
            replica_rank=topology.replica_rank,
            expert=split.experts[0] if split.experts is not None else frozenset(),
            ep=topology.ep,
        )
    sharded = ShardedOptimizer(
        optimizer,
        model,
        trainable,
        reducer,
        policy,
        comms.shard,
        policy.allgather_bucket_size,
        masters=masters,
        tp_norm=tp_norm,
        dp_comm=comms.dp,
        replica_rank=topology.replica_rank,
        overlap_gathers=not plan.graph.enabled,  # a captured graph must see plain parameters
        make_offload=None
        if zenflow_streams is not None
        else _offload_factory(optimizer, plan.offload, topology, files, comms.world, sinks),
        experts=(comms.edp, comms.ep) if comms.edp is not None and comms.ep is not None else None,
        stage_comm=Communicator(topology.pp_group, topology.timeout_s) if topology.pp > 1 else None,
        counted_elsewhere=counted_elsewhere,
        make_zenflow=_zenflow_factory(optimizer, offload.zenflow, comms.shard, zenflow_streams, offload.pin_memory),
        tp_blocks=(comms.tp, {id(r.param): r.tp for r in layout.records if r.tp_split})
        if comms.tp is not None
        else None,
    )
    return reducer, sharded


def _zenflow_factory(
    optimizer: torch.optim.Optimizer,
    policy: ZenFlowPolicy | None,
    comm: Communicator,
    streams: zenflow_device.ZenFlowStreams | None = None,
    pin_memory: bool = True,
) -> MakeZenFlow | None:
    """The stall-free step over the optimizer's tensors (``zero_optimization.zenflow``), None without it; with
    ``streams`` (a GPU) its device form ([Note: ZenFlow on the device])."""
    if policy is None:
        return None
    if streams is not None:
        return lambda stepped, shapes, starts: zenflow_device.DeviceZenFlowStep(
            optimizer, stepped, shapes, starts, policy, comm, streams, pin_memory
        )
    return lambda stepped, shapes, starts: ZenFlowStep(optimizer, stepped, shapes, starts, policy, comm)


def apply_graph(
    model: nn.Module,
    plan: Plan,
    eager: EagerRuntime,
    comms: Comms,
    reducer: GradientReducer,
    layout: ShardLayout,
    param_offload: ShardSource | None,
    pipeline: Pipeline | None = None,
) -> Runtime:
    """The eager runtime, or with ``graph.enabled`` the graph runtime around it; under pipeline parallelism the
    eager runtime, each of the ``pipeline``'s stage modules captured instead ([Note: graph mode per pipeline stage]
    in ``graph/stage.py``)."""
    g = plan.graph
    if not g.enabled:
        return eager
    if pipeline is not None:
        from shardtrain.graph.stage import CapturedStage  # imports TorchDynamo: only when graph mode is on

        options = {"cache_size": g.cache_size, "compiler": g.compiler, "dynamic_shapes": g.dynamic_shapes}
        params = list(model.parameters())  # this rank's stages' (the model is pruned to them)
        pipeline.parts = [CapturedStage(p, params, strict=g.strict, **options) for p in pipeline.parts]
        return eager
    from shardtrain.graph.runtime import GraphRuntime  # imports TorchDynamo: only when graph mode is on

    precision = plan.precision
    return GraphRuntime(
        model,
        eager,
        comms.shard,
        reducer,
        strict=g.strict,
        cache_size=g.cache_size,
        compiler=g.compiler,
        dynamic_shapes=g.dynamic_shapes,
        wire_dtype=precision.reduce_dtype if precision.mixed else None,
        tp_partial=(comms.tp, _partial_grads(layout)) if comms.tp is not None else None,
        # parameter uploads on a GPU are refused with graph mode by the plan: only swap files reach here
        param_offload=param_offload if isinstance(param_offload, ParamOffload) else None,
    )


# -- what the steps share --------------------------------------------------------------------------------------


def _partial_grads(layout: ShardLayout) -> frozenset[int]:
    """The ids of the parameters whose gradients are partial sums over the tensor-parallel group."""
    return frozenset(id(r.param) for r in layout.records if r.tp is not None and r.tp.partial_grad)


def _param_offload(
    layout: ShardLayout,
    offload: OffloadPolicy,
    scratch: dict[str, ScratchDir],
    world: Communicator,
    rank: int,
    device: torch.device,
) -> ShardSource | None:
    """Stage 3's unit shards away from the device between gathers, made on every rank or on none: in mapped swap
    files (``offload_param.device: nvme``, [Note: parameter offload]); on a GPU also in page-locked host memory
    (``cpu``), uploaded per gather ([Note: parameter uploads]). None otherwise (``cpu`` on a CPU-only machine:
    the shards are in host memory already)."""
    if offload.param.device == "none" or not layout.unit_buckets:
        return None
    streams = param_uploads.upload_streams(device)
    if offload.param.device != "nvme" and streams is None:
        return None

    def make() -> ShardSource:
        files = None
        if offload.param.device == "nvme":
            files = ParamOffload(
                layout.unit_buckets,
                scratch["offload_param"],
                rank,
                offload.param.max_in_cpu,
                offload.param.buffer_count,
            )
        if streams is None:
            return files
        return param_uploads.ParamUploads(layout.unit_buckets, streams, files, offload.param.pin_memory)

    return on_every_rank(world, "parameter swap files" if offload.param.device == "nvme" else "host shards", make)


def _host_masters(masters: Any, trainable: list[Bucket], policy: ZeroPolicy, offload: OffloadPolicy) -> Any:
    """The fp32 masters on the host for a device run whose optimizer steps there (see [Note: overlapped offload]):
    of the shard's slices when the optimizer state is sharded (at stage 3 the parameters themselves are not
    there), else of the whole parameters."""
    if policy.shard_optimizer_state:
        fragments = {
            id(s.param): b.shard[f.shard_offset : f.shard_offset + f.length]
            for b in trainable
            for s, f in zip(b.slots, b.fragments)
        }
    else:
        fragments = {id(s.param): s.param.detach() for b in trainable for s in b.slots}
    opt = offload.optimizer
    ratio = opt.ratio if opt.device == "cpu" else 1.0  # nvme: resident sub-groups stay on the host
    return host_masters(masters, fragments, opt.pin_memory, opt.sub_group_size, ratio)


def _offload_factory(
    optimizer: torch.optim.Optimizer,
    offload: OffloadPolicy,
    topology: Topology,
    files: SwapFiles | None,
    world: Communicator,
    sinks: GradientSinks,
) -> MakeOffload | None:
    """What makes the optimizer offload from the tensors :class:`ShardedOptimizer` steps (it takes the optimizer
    state over in its constructor); None without optimizer offload."""
    opt = offload.optimizer
    if not opt.enabled:
        return None

    def make_offload(
        stepped: list[torch.Tensor], fragments: list[torch.Tensor] | None, whole_buckets: WholeBuckets | None = None
    ) -> OptimizerOffload:
        return build_optimizer_offload(
            optimizer,
            stepped,
            opt.device,
            opt.sub_group_size,
            opt.buffer_count,
            opt.ratio,
            opt.pin_memory and topology.device.type == "cuda",  # pinning would make a CUDA context
            files,
            world,
            fragments=fragments,
            sinks=sinks,
            whole_buckets=whole_buckets,
        )

    return make_offload


def move_whole_parts(model: nn.Module, policy: ZeroPolicy, topology: Topology) -> None:
    """Move to the engine's device what stays whole there; at stage 3 the units' parameters stay where they are
    until :func:`~shardtrain.zero.build.build_layout` copies them into their unit, one unit at a time.

    [Note: stage 3 from the host]
    At stage 3 a model built on the host without ``zero.Init`` (or on another device) is not moved whole to the device:
    ``initialize``'s device peak would be the whole model, so a model that only fits sharded would run out of memory
    while ``shardtrain estimate`` says it fits. Only buffers and parameters below ``stage3_param_persistence_threshold``
    move first; each unit's parameters are copied, when the unit is laid out, into its flat buffer made on the device,
    which takes rank 0's values (broadcast), is cut to this rank's shard and freed before the next unit (peak: the
    shards so far plus one unit). With tensor parallelism the model still moves whole: the split runs on the device,
    before the layout.
    """
    device = topology.device
    tensors = [*model.parameters(), *model.buffers()] if topology.tp > 1 else laid_out_whole(model, policy)
    if all(t.device == device for t in tensors):
        return
    if len(tensors) == len([*model.parameters(), *model.buffers()]):
        model.to(device)
        return
    moving = {id(t) for t in tensors if t.device != device}
    with torch.no_grad():
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None and id(p) in moving:
                    _move_parameter(p, device)
            for name, buf in m._buffers.items():
                if buf is not None and id(buf) in moving:
                    m._buffers[name] = buf.to(device)


def _move_parameter(p: nn.Parameter, device: torch.device) -> None:
    """``p`` on ``device``, the same object (the optimizer holds it), as ``nn.Module.to`` moves it."""
    moved = p.data.to(device)
    grad = p.grad.to(device) if p.grad is not None else None
    if torch._has_compatible_shallow_copy_type(p.data, moved):
        p.data = moved
    else:  # a device whose tensors are of another kind (as nn.Module._apply does): swap, keeping the attributes
        attributes = dict(p.__dict__)
        torch.utils.swap_tensors(p, nn.Parameter(moved, requires_grad=p.requires_grad))
        p.__dict__.update(attributes)
    p.grad = grad


def _cast_to_compute_dtype(module: nn.Module, layout: ShardLayout, policy: PrecisionPolicy) -> None:
    """See [Note: mixed precision]: buckets, other fp32 parameters and floating buffers."""
    for b in layout.buckets:
        if b.dtype == torch.float32:
            cast_bucket(b, policy.compute_dtype)
    with torch.no_grad():
        for p in module.parameters():
            record = layout.record_of(p)
            if (record is None or record.bucket is None) and policy.casts(p):
                p.data = p.data.to(policy.compute_dtype)
        for m in module.modules():
            for name, buf in m._buffers.items():
                if buf is not None and policy.casts(buf):
                    m._buffers[name] = buf.to(policy.compute_dtype)


def _prepare_offload(offload: OffloadPolicy, topology: Topology, world: Communicator) -> dict[str, ScratchDir]:
    """Each rank's swap directories (device ``nvme``), checked on every rank."""
    param = offload.param
    scratch = {}
    if param.device == "nvme":
        scratch["offload_param"] = prepare_scratch(
            param.nvme_path, topology.rank, "zero_optimization.offload_param", world
        )
    off = offload.optimizer
    if off.device == "nvme":
        scratch["offload_optimizer"] = prepare_scratch(
            off.nvme_path, topology.rank, "zero_optimization.offload_optimizer", world
        )
    return scratch


def refuse_sharded_construction(model: nn.Module) -> None:
    if any(is_under_construction(p) for p in model.parameters()):
        raise ConfigError(
            "a model built under shardtrain.zero.Init() (sharded over the world as it was built) cannot be split "
            "by tensor parallelism: build it under shardtrain.zero.Init(config) with the same config, whose "
            "tensor_parallel section makes each rank build only its blocks (docs/sharded-construction.md)"
        )


def broadcast_model(model: nn.Module, world: Communicator, split: str = "tensor-parallel") -> None:
    """Every rank starts from rank 0's full model before tensor (or expert) parallelism cuts each rank's blocks (the
    data-parallel broadcast after the split only reaches ranks holding the same block). Parameters built under
    ``zero.Init()`` are chunks of one tensor already, and stay sharded."""
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not is_under_construction(t):
                world.broadcast(t.data, 0, what=f"initial value of {name!r} before the {split} split")


def _check_ranks_agree(
    comm: Communicator, module: nn.Module, cfg: Config, keys: tuple[str, ...] = ("config", "model")
) -> None:
    """Fail at once, naming ranks, if ranks got different configs or models (instead of hanging later); ``keys``:
    which of the two are compared."""
    structure = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    mine = {
        "config": hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16],
        "model": hashlib.sha256(json.dumps(structure).encode()).hexdigest()[:16],
    }
    everyone = comm.all_gather_object(mine, what="config and model fingerprints")
    for key in keys:
        values = [e[key] for e in everyone]
        if len(set(values)) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            detail = "; ".join(f"ranks {rs} have {v}" for v, rs in groups.items())
            raise RankMismatchError(f"ranks disagree on the {key} passed to initialize(): {detail}")
