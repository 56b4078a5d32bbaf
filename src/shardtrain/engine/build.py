"""How an :class:`~shardtrain.engine.engine.Engine` is put together.

``initialize`` (:mod:`.engine`) checks what the user passed, places the model and splits it for tensor parallelism;
:func:`build_parts` then makes the engine's parts, in the order each needs the ones before it:

====================  ==========================================================================================
communicators         ZeRO's groups, tensor/sequence parallelism, the desync check (no collective yet)
refusals              ranks agreeing on config and model (a collective), swap directories checked on every rank
layout                where every parameter lives (``zero/build.py``); from here on the model is changed
precision             fp32 masters of each fragment, then parameters and buffers cast to the compute dtype
parameter offload     stage-3 shards in swap files (``offload_param.device: nvme``)
eager runtime         the units and their hooks, with the gather service that the parameter offload and hpZ's
                      secondary shards are handed to ([Note: one gather service] in ``zero/gather.py``)
gradient sinks        where complete gradient shards go besides memory: swap files or host copies (optimizer offload)
reducer               gradient hooks and reductions per bucket, handed the gradient sinks
optimizer             the user's optimizer over this rank's fragments, made with its optimizer offload
runtime               eager or graph ([Note: one runtime, two implementations] in ``zero/runtime.py``)
monitor               metrics on rank 0
====================  ==========================================================================================

Each part is handed the parts it uses when it is made; none is attached afterwards.

Every refusal a user can cause happens before the layout, so a refused ``initialize`` leaves the model as it was
(``initialize`` refuses its own before the tensor-parallel split). What can fail after it is a resource (a full
disk, a peer lost); the swap directories made for offload are then removed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from shardtrain.config.schema import (
    Config,
    ZeroConfig,
    check_expert_layout,
    gradient_predivide,
    optimizer_class_and_kwargs,
)
from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.desync import PhaseCheck
from shardtrain.distributed.mesh import Topology
from shardtrain.engine.monitor import TrainingMonitor
from shardtrain.errors import ConfigError, OptimizerError, RankMismatchError
from shardtrain.offload import host_copies
from shardtrain.offload.optimizer_state import (
    GradientSinks,
    OptimizerOffload,
    build_gradient_sinks,
    build_optimizer_offload,
    host_masters,
    ineffective_offload_keys,
)
from shardtrain.offload.parameters import ParamOffload
from shardtrain.offload.swap import ScratchDir, SwapFiles, on_every_rank, prepare_scratch
from shardtrain.optim.schedulers import build_scheduler
from shardtrain.sequence_parallel import (
    PatchSplitter,
    Seq2SeqSplitter,
    SequenceSplitter,
    install_ulysses,
    make_splitter,
    refuse_unbuilt_sequence_parallel,
)
from shardtrain.sequence_parallel.tiling import install as install_tiling
from shardtrain.zero.build import build_layout, laid_out_whole
from shardtrain.zero.hpz import SecondaryShards, refuse_unbuilt_hpz
from shardtrain.zero.init import is_under_construction
from shardtrain.zero.layout import Bucket, ShardLayout, cast_bucket
from shardtrain.zero.optimizer import ShardedOptimizer, TensorParallelNorm, make_masters
from shardtrain.zero.policy import ZeroPolicy
from shardtrain.zero.precision import LossScaler, PrecisionPolicy, policy_from_config
from shardtrain.zero.reducer import GradientReducer, accumulation_dtype
from shardtrain.zero.runtime import Runtime
from shardtrain.zero.unit_runtime import EagerRuntime
from shardtrain.zero.units import find_unit_modules

log = logging.getLogger("shardtrain")

OptimizerArg = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None
SchedulerArg = LRScheduler | Callable[[torch.optim.Optimizer], LRScheduler] | None


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
    """What :func:`build_parts` returns; the engine holds each under the same name."""

    comms: Comms
    # sequence parallelism: the all-to-alls and the split of the sequence (or of an encoder-decoder's two)
    sp: SequenceSplitter | PatchSplitter | Seq2SeqSplitter | None
    phase_check: PhaseCheck  # [Note: phase agreement]
    scratch: dict[str, ScratchDir]  # offload's swap directories by config section
    layout: ShardLayout
    precision: PrecisionPolicy
    scaler: LossScaler | None
    param_offload: ParamOffload | None
    reducer: GradientReducer
    optimizer: ShardedOptimizer
    runtime: Runtime
    monitor: TrainingMonitor


def make_comms(topology: Topology, tp_comm: Communicator | None, ep_comm: Communicator | None = None) -> Comms:
    shard = Communicator(topology.shard_group, topology.timeout_s)
    # see [Note: the hybrid mesh] in shardtrain/mesh.py: gradient shards are all-reduced across the replicas and
    # what must reach every data-parallel rank goes over the dp axis
    replica = Communicator(topology.replicate_group, topology.timeout_s) if topology.hybrid else None
    dp = Communicator(topology.zero_group, topology.timeout_s) if topology.hybrid else shard
    world = dp if topology.tp == 1 else Communicator(topology.world_group, topology.timeout_s)
    hpz = Communicator(topology.hpz_group, topology.timeout_s) if topology.hpz_group is not None else None
    ep = edp = None
    if topology.ep > 1:  # see [Note: the expert axis] in shardtrain/distributed/mesh.py
        ep = ep_comm if ep_comm is not None else Communicator(topology.ep_group, topology.timeout_s)
        edp = Communicator(topology.edp_group, topology.timeout_s)
    return Comms(shard, replica, dp, world, tp_comm, hpz, ep, edp)


def build_parts(
    module: nn.Module,
    config: Config,
    topology: Topology,
    optimizer: torch.optim.Optimizer,
    tp_placements: Mapping[str, Any] | None,
    tp_comm: Communicator | None,
    experts: tuple[frozenset[int], Communicator] | None = None,
) -> Parts:
    """The engine's parts, in the order of the module docstring. Collective. ``experts``: under expert parallelism,
    the ids of the expert parameters and the expert group's communicator (the one their token exchange uses)."""
    comms = make_comms(topology, tp_comm, experts[1] if experts is not None else None)
    expert_ids = experts[0] if experts is not None else frozenset()
    # every rank says where it is before each call that communicates ([Note: phase agreement]); its own
    # Communicator over the world group, so that comm_stats() keeps only the traffic of the ZeRO formulas
    phase_check = PhaseCheck(
        Communicator(topology.host_world_group, topology.timeout_s) if config.desync_check else None,
        topology.tp,
        topology.device,
        sp=topology.sp,
    )
    _check_ranks_agree(comms.world, module, config)
    # swap directories are checked on every rank before the model is touched (see docs/offload.md); a failure
    # of the rest of the construction (a full disk, a peer lost) leaves none behind
    scratch = _prepare_offload(config.zero_optimization, topology, comms.world)
    try:
        return _build(module, config, topology, optimizer, tp_placements, comms, phase_check, scratch, expert_ids)
    except BaseException:
        for s in scratch.values():
            s.remove()
        raise


def _build(
    module: nn.Module,
    config: Config,
    topology: Topology,
    optimizer: torch.optim.Optimizer,
    tp_placements: Mapping[str, Any] | None,
    comms: Comms,
    phase_check: PhaseCheck,
    scratch: dict[str, ScratchDir],
    expert_ids: frozenset[int] = frozenset(),
) -> Parts:
    zcfg = config.zero_optimization
    sp = _install_sequence_parallel(module, topology)
    install_tiling(module, config)  # ALST's tiled loss and MLP, when configured
    # where every parameter lives (see [Note: the layout]); built before anything else touches the model
    layout = build_layout(
        module,
        zcfg,
        comms.shard,
        tp_placements,
        tp=topology.tp,
        tp_rank=topology.tp_rank,
        dp_comm=comms.dp,
        device=topology.device,
        experts=(expert_ids, comms.edp) if comms.edp is not None else None,
        ep=topology.ep,
        ep_rank=topology.ep_rank,
    )
    policy = layout.policy
    precision = policy_from_config(config)
    masters = None
    trainable = layout.trainable_buckets  # frozen buckets (stage-3 units) are never reduced nor stepped
    if precision.mixed:  # masters from the fp32 values, then compute-dtype parameters
        masters = make_masters(trainable, policy)
        _cast_to_compute_dtype(module, layout, precision)
    # the gather service's two collaborators, built before the runtime that hands them to it ([Note: one gather
    # service] in zero/gather.py), after the cast: the swap files hold the compute-dtype shards
    param_offload = _param_offload(layout, zcfg, scratch, comms.world, topology.rank)
    secondary = None
    if comms.hpz is not None and layout.unit_buckets:  # see [Note: secondary shards]
        secondary = SecondaryShards(comms.hpz)
    eager = EagerRuntime(
        module,
        layout.unit_buckets,
        comms.shard,
        zcfg.stage3_prefetch_bucket_size,
        zcfg.stage3_gather_check,
        check_group=topology.host_shard_group,
        secondary=secondary,
        source=param_offload,
        expert_comm=comms.edp,
        phase_checked=phase_check.comm is not None,
    )
    offload = zcfg.offload_optimizer
    streams = host_copies.copy_streams(topology.device) if offload.device != "none" else None
    if streams is not None:  # a device run: the step runs on the host (see [Note: overlapped offload])
        masters = _host_masters(masters, trainable, policy, zcfg)
    # the optimizer offload's swap files, and where the reducer sends complete gradient shards: built before the
    # reducer from the tensors the optimizer wrapper will step (the masters, else the fragments)
    files = SwapFiles(scratch["offload_optimizer"], topology.rank) if "offload_optimizer" in scratch else None
    sinks = GradientSinks()
    if offload.device != "none":
        sinks = build_gradient_sinks(
            trainable,
            masters,
            files,
            streams,
            sharded_state=policy.shard_optimizer_state,
            sharded_grads=policy.shard_gradients,
            grad_dtypes=[accumulation_dtype(b.dtype) for b in trainable],
            read_in_memory=topology.tp > 1 or (comms.replica is not None and comms.replica.size > 1),
        )
    partial_grads = frozenset(id(r.param) for r in layout.records if r.tp is not None and r.tp.partial_grad)
    tp_comm = comms.tp
    reducer = GradientReducer(
        trainable,
        policy,
        comms.shard,
        zcfg.overlap_comm,
        on_grad_ready=eager.on_grad_ready if eager.units else None,
        reduce_dtype=precision.reduce_dtype if precision.mixed else None,
        tp_partial=(tp_comm, partial_grads) if partial_grads and tp_comm is not None else None,
        predivide=gradient_predivide(config, topology.shard_size),
        replicate=comms.replica,
        order_comm=comms.dp,
        experts=(comms.edp, topology.ep) if comms.edp is not None else None,
        grad_files=sinks.files,
        host_copies=sinks.copies,
    )
    tp_norm = None
    if topology.tp > 1:
        split = frozenset(id(r.param) for r in layout.records if r.tp_split)
        tp_norm = TensorParallelNorm(
            comms.world,
            split,
            topology.zero_rank,
            topology.tp_rank,
            replica_rank=topology.replica_rank,
            expert=expert_ids,
            ep=topology.ep,
        )
    make_offload = _offload_factory(optimizer, zcfg, topology, files, comms.world, sinks)
    sharded_optimizer = ShardedOptimizer(
        optimizer,
        module,
        trainable,
        reducer,
        policy,
        comms.shard,
        zcfg.allgather_bucket_size,
        masters=masters,
        tp_norm=tp_norm,
        dp_comm=comms.dp,
        replica_rank=topology.replica_rank,
        overlap_gathers=not config.graph.enabled,  # a captured graph must see plain parameters
        make_offload=make_offload,
        experts=(comms.edp, comms.ep) if comms.edp is not None and comms.ep is not None else None,
    )
    tp_partial = (tp_comm, partial_grads) if tp_comm is not None else None
    runtime = _runtime(module, config, eager, comms.shard, reducer, precision, tp_partial, param_offload)
    # metrics, monitors (TensorBoard/CSV/wandb) and wall-clock breakdown: rank 0 only, never communicates
    monitor = TrainingMonitor(config, topology.rank, topology.device, topology.dp)
    for comm in (comms.shard, comms.replica, comms.dp, comms.hpz, comms.ep, comms.edp):  # comm_stats() counts from here
        if comm is not None:
            comm.reset_stats()
    return Parts(
        comms,
        sp,
        phase_check,
        scratch,
        layout,
        precision,
        LossScaler.from_config(config, topology.device),
        param_offload,
        reducer,
        sharded_optimizer,
        runtime,
        monitor,
    )


def _install_sequence_parallel(module: nn.Module, topology: Topology) -> Any:
    """The batch splitter of sequence parallelism, with the Ulysses exchange installed around the model's
    attention (docs/sequence-parallel.md); None without it."""
    if topology.sp == 1:
        return None
    sp = make_splitter(module, Communicator(topology.sp_group, topology.timeout_s))
    install_ulysses(
        module,
        sp.comm,
        tp=topology.tp,
        key_limit=getattr(sp, "key_limit", None),
        whole_inputs=getattr(sp, "whole_inputs", None),
    )
    return sp


def _param_offload(
    layout: ShardLayout, zcfg: ZeroConfig, scratch: dict[str, ScratchDir], world: Communicator, rank: int
) -> ParamOffload | None:
    """Stage 3's unit shards in mapped swap files (``offload_param.device: nvme``), made on every rank or on none;
    None otherwise."""
    if zcfg.offload_param.device != "nvme" or not layout.unit_buckets:
        return None
    return on_every_rank(
        world,
        "parameter swap files",
        lambda: ParamOffload(
            layout.unit_buckets,
            scratch["offload_param"],
            rank,
            zcfg.offload_param.max_in_cpu,
            zcfg.offload_param.buffer_count,
        ),
    )


def _host_masters(masters: Any, trainable: list[Bucket], policy: ZeroPolicy, zcfg: ZeroConfig) -> Any:
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
    offload = zcfg.offload_optimizer
    ratio = offload.ratio if offload.device == "cpu" else 1.0  # nvme: resident sub-groups stay on the host
    return host_masters(masters, fragments, offload.pin_memory, zcfg.sub_group_size, ratio)


def _offload_factory(
    optimizer: torch.optim.Optimizer,
    zcfg: ZeroConfig,
    topology: Topology,
    files: SwapFiles | None,
    world: Communicator,
    sinks: GradientSinks,
) -> Callable[[list[torch.Tensor], list[torch.Tensor] | None], OptimizerOffload] | None:
    """What makes the optimizer offload from the tensors :class:`ShardedOptimizer` steps (it takes the optimizer
    state over in its constructor); None without optimizer offload."""
    offload = zcfg.offload_optimizer
    if offload.device == "none":
        return None

    def make_offload(stepped: list[torch.Tensor], fragments: list[torch.Tensor] | None) -> OptimizerOffload:
        return build_optimizer_offload(
            optimizer,
            stepped,
            offload.device,
            zcfg.sub_group_size,
            offload.buffer_count,
            offload.ratio,
            offload.pin_memory and topology.device.type == "cuda",  # pinning would make a CUDA context
            files,
            world,
            fragments=fragments,
            sinks=sinks,
        )

    return make_offload


def _runtime(
    module: nn.Module,
    config: Config,
    eager: EagerRuntime,
    comm: Communicator,
    reducer: GradientReducer,
    precision: PrecisionPolicy,
    tp_partial: tuple[Communicator, frozenset[int]] | None,
    param_offload: ParamOffload | None = None,
) -> Runtime:
    """The eager runtime, or with ``graph.enabled`` the graph runtime around it."""
    gcfg = config.graph
    if not gcfg.enabled:
        return eager
    from shardtrain.graph.runtime import GraphRuntime  # imports TorchDynamo: only when graph mode is on

    return GraphRuntime(
        module,
        eager,
        comm,
        reducer,
        strict=gcfg.strict,
        cache_size=gcfg.cache_size,
        compiler=gcfg.compiler,
        dynamic_shapes=gcfg.dynamic_shapes,
        wire_dtype=precision.reduce_dtype if precision.mixed else None,
        tp_partial=tp_partial,
        param_offload=param_offload,
    )


def move_whole_parts(model: nn.Module, zcfg: ZeroConfig, topology: Topology) -> None:
    """Move to the engine's device what stays whole there; at stage 3 the units' parameters stay where they are
    until :func:`~shardtrain.zero.build.build_layout` copies them into their unit, one unit at a time.

    [Note: stage 3 from the host]
    A model built on the host without ``zero.Init`` (or on another device) is not moved whole to the device before
    it is sharded: at stage 3 the device peak of ``initialize`` would be the whole model, and a model that only fits
    sharded would run out of memory while ``shardtrain estimate`` says it fits. At stage 3 only the buffers and the
    parameters below ``stage3_param_persistence_threshold`` are moved first. Each unit's parameters
    are copied into the unit's flat buffer, made on the device (``build_buckets(device=...)``), when the unit is laid
    out. The buffer then holds rank 0's values (broadcast), this rank's shard is cut from it, and it is freed before
    the next unit. The device peak of ``initialize`` is the shards laid out so far plus one unit; the host keeps
    each parameter until its unit is laid out. With tensor parallelism the model is still moved whole: the
    tensor-parallel split runs before the layout, on the device.
    """
    device = topology.device
    tensors = [*model.parameters(), *model.buffers()] if topology.tp > 1 else laid_out_whole(model, zcfg)
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


# -- what initialize() checks and builds before the parts -----------------------------------------------------------


def refuse_on_device(cfg: Config, device_type: str) -> None:
    """What is not built on devices of ``device_type`` (``config check --device`` asks the same)."""
    param = cfg.zero_optimization.offload_param
    if param.device != "none" and device_type == "cuda":
        raise ConfigError(
            f"zero_optimization.offload_param.device {param.device!r} is not built on CUDA yet; use "
            "offload_optimizer (optimizer state, and fp32 masters, in host memory or on disk) and set "
            "offload_param.device to 'none' (docs/offload.md)"
        )


def refuse_unbuilt(cfg: Config, topology: Topology, model: nn.Module) -> None:
    """Combinations that are not built, refused before the model, its parameters or the disk are touched."""
    zcfg = cfg.zero_optimization
    refuse_on_device(cfg, topology.device.type)
    if zcfg.stage == 3 and zcfg.stage3_unit_classes:
        find_unit_modules(model, zcfg.stage3_unit_classes)  # names the classes the model does not have
    refuse_unbuilt_sequence_parallel(cfg)
    check_expert_layout(cfg, topology.dp)  # expert parallelism with what it is not built with
    refuse_unbuilt_hpz(cfg, topology)  # ZeRO++ hpZ with tensor/sequence parallelism, offload_param or graph mode


def _prepare_offload(zcfg: Any, topology: Topology, world: Communicator) -> dict[str, ScratchDir]:
    """Each rank's swap directories (device ``nvme``), checked on every rank; offload keys that cannot act here are
    logged."""
    for note in ineffective_offload_keys(zcfg, topology.device.type):
        log.warning(note)
    param = zcfg.offload_param
    scratch = {}
    if param.device == "nvme":
        scratch["offload_param"] = prepare_scratch(
            param.nvme_path, topology.rank, "zero_optimization.offload_param", world
        )
    off = zcfg.offload_optimizer
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


FUSED_ON_CUDA = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""Config-built optimizers made with ``fused=True`` on CUDA (unless the section says ``fused`` or ``foreach``), as
DeepSpeed builds its fused Adam there: one kernel per step, and an fp16 overflow skipped in the kernel (see [Note: an
overflow learned a step later] in :mod:`shardtrain.engine.engine`)."""


def build_optimizer(
    model: nn.Module, cfg: Config, optimizer: OptimizerArg, device: torch.device | None = None
) -> torch.optim.Optimizer:
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError(
            "an optimizer was passed to initialize() and the config has an 'optimizer' section; keep one of them"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        built = optimizer(model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            raise OptimizerError(f"the optimizer callable returned {type(built).__name__}, not a torch optimizer")
        return built
    if optimizer is not None:
        raise OptimizerError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")
    if cfg.optimizer is None:
        raise ConfigError("no optimizer: pass initialize(optimizer=...) or add an 'optimizer' section to the config")
    cls, kwargs = optimizer_class_and_kwargs(cfg.optimizer)
    if device is not None and device.type == "cuda" and cls in FUSED_ON_CUDA and not {"fused", "foreach"} & {*kwargs}:
        kwargs["fused"] = True
    return cls([p for p in model.parameters() if p.requires_grad], **kwargs)


def build_lr_scheduler(cfg: Config, opt: torch.optim.Optimizer, lr_scheduler: SchedulerArg) -> LRScheduler | None:
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError(
            "an lr_scheduler was passed to initialize() and the config has a 'scheduler' section; keep one of them"
        )
    if isinstance(lr_scheduler, LRScheduler):
        if lr_scheduler.optimizer is not opt:
            raise OptimizerError(
                "lr_scheduler was built on a different optimizer than the one passed to initialize(); "
                "build it on that optimizer, or pass a callable optimizer -> scheduler"
            )
        return lr_scheduler
    if callable(lr_scheduler):
        built = lr_scheduler(opt)
        if not isinstance(built, LRScheduler):
            raise OptimizerError(f"the lr_scheduler callable returned {type(built).__name__}, not a torch LRScheduler")
        return built
    if lr_scheduler is not None:
        raise OptimizerError(f"lr_scheduler must be an LRScheduler or a callable, got {type(lr_scheduler).__name__}")
    if cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler, opt)
    return None


def _check_ranks_agree(comm: Communicator, module: nn.Module, cfg: Config) -> None:
    """Fail at once, naming ranks, if ranks got different configs or models (instead of hanging later)."""
    structure = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    mine = {
        "config": hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16],
        "model": hashlib.sha256(json.dumps(structure).encode()).hexdigest()[:16],
    }
    everyone = comm.all_gather_object(mine, what="config and model fingerprints")
    for key in ("config", "model"):
        values = [e[key] for e in everyone]
        if len(set(values)) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            detail = "; ".join(f"ranks {rs} have {v}" for v, rs in groups.items())
            raise RankMismatchError(f"ranks disagree on the {key} passed to initialize(): {detail}")
