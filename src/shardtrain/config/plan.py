"""A validated config becomes the typed :class:`~shardtrain.plan.Plan`: here, once, without a process group.

:func:`resolve_plan` is the only place a config's parallel sizes become :class:`~shardtrain.plan.dims.ParallelDims`
and its sections become the policies the core packages take; every refusal of a layout (a size that does not fit
the world: :class:`~shardtrain.errors.LayoutError`) or of a combination that is not built
(:class:`~shardtrain.errors.ConfigError`, of which ``LayoutError`` is a kind) is raised here. ``initialize``,
``shardtrain config check`` and ``shardtrain estimate`` call it the same way, so they give one verdict in one
wording.
"""

from __future__ import annotations

import torch

from shardtrain.config.deepspeed_keys import is_auto
from shardtrain.config.sections import SPLIT_BACKWARD_SCHEDULES, Config
from shardtrain.errors import ConfigError
from shardtrain.plan import Plan
from shardtrain.plan.dims import ParallelDims
from shardtrain.plan.policies import (
    ActivationPolicy,
    Float8Policy,
    GraphPolicy,
    LossScalePolicy,
    OffloadPolicy,
    OptimizerOffloadPolicy,
    ParamOffloadPolicy,
    PipelinePolicy,
    PrecisionPolicy,
    PrefetchPolicy,
    TilingPolicy,
    ZenFlowPolicy,
    ZeroPolicy,
)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_plan(cfg: Config, world: int, device_type: str | None = None) -> Plan:
    """The plan ``cfg`` gives at ``world`` ranks; ``device_type`` (``"cpu"``/``"cuda"``): also what is not built on
    such devices (``config check`` without ``--device`` leaves it None). Values written ``"auto"`` pass through as
    they are: ``initialize`` resolves them before it builds its plan."""
    dims = parallel_dims(cfg, world)
    refuse_unbuilt(cfg, dims, device_type)
    zcfg = cfg.zero_optimization
    zero = ZeroPolicy.for_stage(
        zcfg.stage,
        reduce_bucket_size=zcfg.reduce_bucket_size,
        allgather_bucket_size=zcfg.allgather_bucket_size,
        overlap_comm=zcfg.overlap_comm,
        persistence_threshold=zcfg.stage3_param_persistence_threshold,
        unit_classes=tuple(zcfg.stage3_unit_classes) if zcfg.stage3_unit_classes else None,
        gather_check=zcfg.stage3_gather_check,
    )
    opt, par = zcfg.offload_optimizer, zcfg.offload_param
    offload = OffloadPolicy(
        OptimizerOffloadPolicy(
            # page-locked memory speeds GPU copies only; on the CPU it would make a CUDA context where one exists
            opt.device,
            opt.nvme_path,
            opt.pin_memory and device_type == "cuda",
            opt.buffer_count,
            opt.ratio,
            zcfg.sub_group_size,
            zenflow_policy(cfg),
        ),
        ParamOffloadPolicy(
            par.device, par.nvme_path, par.buffer_count, par.max_in_cpu, par.pin_memory and device_type == "cuda"
        ),
    )
    g = cfg.graph
    return Plan(
        dims=dims,
        zero=zero,
        precision=precision_policy(cfg),
        offload=offload,
        prefetch=PrefetchPolicy(zcfg.stage3_prefetch_bucket_size),
        graph=GraphPolicy(g.enabled, g.strict, g.cache_size, g.compiler, g.dynamic_shapes),
        pipeline=PipelinePolicy(
            cfg.pipeline.schedule_name, cfg.pipeline.stages_per_rank, cfg.pipeline.activation_checkpoint_interval
        ),
        tiling=TilingPolicy(
            cfg.tiled_logits_loss, cfg.tiled_logits_loss_shards, cfg.tiled_mlp_compute, cfg.tiled_mlp_shards
        ),
        activations=activation_policy(cfg),
        fp8=Float8Policy(
            cfg.fp8.enabled, cfg.fp8.recipe, cfg.fp8.emulate, tuple(cfg.fp8.filter.exclude), cfg.fp8.gather_in_float8
        ),
        device=cfg.device,
        timeout_s=cfg.collective_timeout_s,
    )


def zenflow_policy(cfg: Config) -> ZenFlowPolicy | None:
    """``zero_optimization.zenflow`` as a policy. The epoch strategies select once: an epoch has no length without
    a data loader, and ``initialize`` takes none (DeepSpeed's ZenFlow does the same without one)."""
    zf = cfg.zero_optimization.zenflow
    if zf is None:
        return None
    every = zf.select_interval if zf.select_strategy == "step" and isinstance(zf.select_interval, int) else 0
    update = 0 if zf.update_interval == "auto" else zf.update_interval  # 0: [Note: update_interval "auto"]
    return ZenFlowPolicy(zf.topk_ratio, update, every, zf.overlap_step, zf.full_warm_up_rounds, zf.auto_ratio)


def refuse_unbuilt_zenflow(cfg: Config, dims: ParallelDims) -> None:
    """What stall-free offload (``zero_optimization.zenflow``) is not built with, refused by name."""
    zcfg, gas = cfg.zero_optimization, cfg.gradient_accumulation_steps
    refused = [
        (dims.tp > 1, f"tensor parallelism (tensor_parallel.size {dims.tp}; a column's gradient is split)"),
        (dims.sp > 1, f"sequence parallelism (sequence_parallel_size {dims.sp})"),
        (dims.cp > 1, f"context parallelism (context_parallel_size {dims.cp})"),
        (dims.ep > 1, f"expert parallelism (expert_parallel_size {dims.ep})"),
        (dims.pp > 1, f"pipeline parallelism (pipeline_parallel_size {dims.pp})"),
        (dims.replicas > 1, f"hybrid sharding (zero_optimization.mics_shard_size {zcfg.mics_shard_size})"),
        (bool(cfg.graph.enabled), "graph mode (graph.enabled)"),
        (bool(cfg.fp8.enabled), "fp8 (fp8.enabled)"),
        (cfg.optimizer is not None and cfg.optimizer.type.lower() not in ("adam", "adamw"), _non_adam(cfg)),
        (
            isinstance(gas, int) and gas > 1,
            f"gradient_accumulation_steps {gas} (DeepSpeed replaces it by update_interval under ZenFlow: every "
            "micro-step is a step; set gradient_accumulation_steps to 1)",
        ),
    ]
    _refuse_first(
        refused, "zero_optimization.zenflow", "remove zenflow or turn the other feature off (docs/offload.md)"
    )


def _non_adam(cfg: Config) -> str:
    return f"optimizer.type {cfg.optimizer.type!r} (ZenFlow's two updates are Adam's)" if cfg.optimizer else ""


def parallel_dims(cfg: Config, world: int) -> ParallelDims:
    """The config's parallel sizes at ``world`` ranks (:class:`~shardtrain.errors.LayoutError` for one that does not
    fit). hpZ's size counts at stage 3 only: below it the key has no effect, as in DeepSpeed."""
    zcfg = cfg.zero_optimization
    return ParallelDims(
        world,
        tp=cfg.tensor_parallel.degree,
        sp=cfg.sequence_parallel_size,
        cp=cfg.context_parallel_size,
        ep=cfg.expert_parallel_size,
        pp=cfg.pipeline_parallel_size,
        shard_size=zcfg.mics_shard_size,
        hpz_size=zcfg.zero_hpz_partition_size if zcfg.stage == 3 else 1,
    )


def check_layout(cfg: Config, world: int) -> int:
    """The data-parallel size of ``cfg`` at ``world`` ranks; the plan's refusal (a
    :class:`~shardtrain.errors.ConfigError`) otherwise."""
    return resolve_plan(cfg, world).dims.dp


def precision_policy(cfg: Config) -> PrecisionPolicy:
    """Compute, reduction and master dtypes; fp16's loss scaling and input cast."""
    if cfg.bf16.enabled is True:
        compute = torch.bfloat16
    elif cfg.fp16.enabled is True:
        compute = torch.float16
    else:
        compute = torch.float32
    # DeepSpeed's defaults: reduce and accumulate in the compute dtype (see [Note: DeepSpeed's defaults])
    reduce = _DTYPES[cfg.communication_data_type] if cfg.communication_data_type else compute
    accum = _DTYPES[cfg.data_types.grad_accum_dtype] if cfg.data_types.grad_accum_dtype else compute
    f = cfg.fp16
    scale = None
    if f.enabled is True:
        scale = LossScalePolicy(
            f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale
        )
    # DeepSpeed's ZeRO 1-2 optimizer reads bf16.check_grad_overflow; its stage 0 and stage 3 bf16 paths always skip
    skip = compute == torch.bfloat16 and (cfg.bf16.check_grad_overflow or cfg.zero_optimization.stage in (0, 3))
    return PrecisionPolicy(
        compute_dtype=compute,
        reduce_dtype=reduce,
        accum_dtype=accum,
        loss_scale=scale,
        cast_inputs=f.enabled is True and f.auto_cast,
        skip_nonfinite=skip,
    )


def activation_policy(cfg: Config) -> ActivationPolicy:
    """What ``activation_checkpointing`` recomputes, and whether the inputs kept wait in host memory (only when
    something is checkpointed: DeepSpeed's keys alone checkpoint nothing)."""
    ac = cfg.activation_checkpointing
    budget = round(ac.memory_budget_gib * 2**30) if ac.memory_budget_gib is not None else None
    return ActivationPolicy(
        ac.policy,
        offload_inputs=ac.cpu_checkpointing and ac.policy != "none",
        partition_inputs=ac.partition_activations and ac.policy != "none",
        memory_budget=budget,
        budget_seq_len=ac.budget_seq_len,
    )


def refuse_unbuilt(cfg: Config, dims: ParallelDims, device_type: str | None = None) -> None:
    """Combinations that are not built, refused by name before anything is touched (the layouts' sizes were
    checked by :class:`~shardtrain.plan.dims.ParallelDims`; rules that need no world size are the validators of
    :mod:`shardtrain.config.sections`, which ``load_config`` runs: sequence parallelism with graph mode, offload at
    stage 0, hpZ with hybrid sharding)."""
    if device_type is not None:
        refuse_on_device(cfg, device_type)
        refuse_fp8_on_device(cfg, device_type)
    stages = cfg.pipeline.stages
    if stages is not None and not is_auto(stages) and stages != dims.pp:  # [Note: DeepSpeed's pipeline keys]
        raise ConfigError(
            f"pipeline.stages {stages} but the pipeline has {dims.pp} stage(s) (pipeline_parallel_size, or a "
            "PipelineModule's num_stages, which DeepSpeed reads the stages from): write "
            f'"auto" or {dims.pp}, or remove pipeline.stages'
        )
    zcfg = cfg.zero_optimization
    hpz = zcfg.zero_hpz_partition_size
    if dims.pp > 1:
        refuse_unbuilt_pipeline(cfg, dims)
    elif cfg.pipeline.activation_checkpoint_interval > 0:
        raise ConfigError(
            f"pipeline.activation_checkpoint_interval {cfg.pipeline.activation_checkpoint_interval} is DeepSpeed's "
            "PipelineEngine key, and there is no pipeline here (pipeline_parallel_size 1); checkpoint with "
            'activation_checkpointing.policy ("full" or "selective") instead'
        )
    if dims.ep > 1:
        refused = [
            (zcfg.stage == 3 and hpz > 1, f"ZeRO++ hpZ (zero_optimization.zero_hpz_partition_size {hpz})"),
            (bool(cfg.graph.enabled), "graph mode (graph.enabled)"),
        ]
        for hit, what in refused:
            if hit:
                raise ConfigError(
                    f"expert_parallel_size (ep_size) {dims.ep} with {what} is not built; set expert_parallel_size to 1 "
                    "or turn the other feature off (docs/expert-parallel.md)"
                )
    if dims.hpz_asked:  # hpZ (stage 3) with what it is not built with
        what = None
        if dims.tp > 1:
            what = f"tensor parallelism (tensor_parallel.size {dims.tp})"
        elif dims.sp > 1:
            what = f"sequence parallelism (sequence_parallel_size {dims.sp})"
        elif zcfg.offload_param.device != "none":
            what = f"offload_param.device {zcfg.offload_param.device!r}"
        elif cfg.graph.enabled:
            what = "graph mode (graph.enabled)"
        if what is not None:
            raise ConfigError(
                f"zero_optimization.zero_hpz_partition_size {hpz} (ZeRO++ hpZ) with {what} is not built; remove "
                "zero_hpz_partition_size (plain ZeRO-3: the same values, backward gathers over every data-parallel "
                "rank) or turn the other feature off (docs/hybrid-sharding.md)"
            )
    ac = cfg.activation_checkpointing
    if ac.partition_activations and ac.cpu_checkpointing and ac.policy != "none" and dims.tp > 1:
        raise ConfigError(
            f"activation_checkpointing.partition_activations with cpu_checkpointing and tensor_parallel.size "
            f"{dims.tp} is not built (the partitioned inputs are not moved to host memory); use one of them"
        )
    if ac.policy == "budget" and dims.pp > 1:
        raise ConfigError(
            f"activation_checkpointing.policy 'budget' with pipeline_parallel_size {dims.pp} is not built (the "
            "planner chooses for the whole model's blocks, a stage holds some); use 'selective' or 'full'"
        )
    if cfg.fp8.enabled:
        refuse_unbuilt_fp8(cfg, dims)
    if zcfg.zenflow is not None:
        refuse_unbuilt_zenflow(cfg, dims)
    if (cfg.tiled_logits_loss or cfg.tiled_mlp_compute) and cfg.graph.enabled:
        raise ConfigError(
            "tiled_logits_loss / tiled_mlp_compute with graph.enabled: the tiled Functions recompute in backward "
            "outside the captured graphs; turn graph mode or tiling off"
        )


def _refuse_first(refused: list[tuple[bool, str]], feature: str, way_out: str) -> None:
    """Refuse the first combination in ``refused`` that is present: "``feature`` with <it> is not built yet; ..."."""
    what = next((what for hit, what in refused if hit), None)
    if what is not None:
        raise ConfigError(f"{feature} with {what} is not built yet; {way_out}")


def refuse_unbuilt_pipeline(cfg: Config, dims: ParallelDims) -> None:
    """What pipeline parallelism is not built with yet (docs/pipeline-parallel.md), refused by name."""
    zcfg = cfg.zero_optimization
    split = f"sequence_parallel_size {dims.sp} x context_parallel_size {dims.cp}"
    refused = [
        # [Note: a sequence split in a pipeline] (engine/pipeline_sequence.py) is built and tested with one of the
        # two splits and without tensor parallelism beside it
        (dims.sp > 1 and dims.cp > 1, f"both sequence and context parallelism ({split})"),
        (dims.sp * dims.cp > 1 and dims.tp > 1, f"tensor parallelism ({split}, tensor_parallel.size {dims.tp})"),
        (dims.sp * dims.cp > 1 and dims.ep > 1, f"expert parallelism ({split}, expert_parallel_size {dims.ep})"),
        (dims.hpz_asked, f"ZeRO++ hpZ (zero_optimization.zero_hpz_partition_size {zcfg.zero_hpz_partition_size})"),
        # the last stage's loss is the pipeline's loss function on the head's logits, not the model's forward where
        # the tiled loss sits (tiled_mlp_compute is built: each stage's MLPs tiled)
        # to NVMe the stage's shards are read from swap files before the schedule's one gather (tested); to host
        # memory the uploads to the device ([Note: parameter uploads]) are not tested under a pipeline
        (zcfg.offload_param.device == "cpu", "parameter offload to host memory (zero_optimization.offload_param)"),
        (cfg.graph.enabled and zcfg.offload_param.device != "none", "graph mode and parameter offload"),
        (cfg.tiled_logits_loss, "tiled_logits_loss"),
        # the graph runtime's tensor-parallel handling (the replicated-gradient check's eager step, partial gradients
        # summed in ZeRO-3's graphs) is not carried to captured stages ([Note: graph mode per pipeline stage])
        (cfg.graph.enabled and dims.tp > 1, f"graph mode and tensor parallelism (tensor_parallel.size {dims.tp})"),
    ]
    schedule = cfg.pipeline.schedule_name
    if schedule in SPLIT_BACKWARD_SCHEDULES:  # [Note: the weight pass reaches the reducer]
        checkpointing = cfg.activation_checkpointing.policy != "none" or cfg.pipeline.activation_checkpoint_interval
        # a checkpointed block is recomputed in the input pass and again in the weight pass
        refused.append((bool(checkpointing), f"the zero-bubble schedule {schedule!r} and activation checkpointing"))
    _refuse_first(
        refused,
        f"pipeline_parallel_size {dims.pp}",
        "set pipeline_parallel_size to 1 or turn the other feature off (docs/pipeline-parallel.md says what composes)",
    )


def refuse_unbuilt_fp8(cfg: Config, dims: ParallelDims) -> None:
    """What FP8 training is not built with yet (docs/fp8.md says what composes), refused by name."""
    tp = f"tensor parallelism (tensor_parallel.size {dims.tp}"
    refused = [
        # [Note: float8 under tensor parallelism]: one scale per whole tensor, its amax all-reduced over tp
        (dims.tp > 1 and cfg.fp8.recipe != "tensorwise", f"{tp}) and fp8.recipe {cfg.fp8.recipe!r} (tensorwise only)"),
        (dims.tp > 1 and cfg.graph.enabled, f"{tp}) and graph mode (graph.enabled)"),
        (dims.pp > 1, f"pipeline parallelism (pipeline_parallel_size {dims.pp})"),
        (dims.cp > 1, f"context parallelism (context_parallel_size {dims.cp})"),
    ]
    _refuse_first(refused, "fp8.enabled", "turn fp8 or the other feature off (docs/fp8.md says what composes)")


def fp8_matmuls_missing(device_type: str) -> str | None:
    """Why devices of ``device_type`` cannot run float8 matmuls (None: they can, or a CUDA device is not visible
    here to ask). torch's ``_scaled_mm`` needs CUDA capability 8.9 (Ada) or above."""
    if device_type != "cuda":
        return f"the {device_type} has no float8 matmuls"
    if not torch.cuda.is_available():
        return None  # `config check --device cuda` on a machine without the GPU: initialize asks the device itself
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"{torch.cuda.get_device_name()} (CUDA capability {major}.{minor}) has no float8 matmuls (8.9 needed)"
    return None


def refuse_fp8_on_device(cfg: Config, device_type: str) -> None:
    """``fp8.enabled`` without ``fp8.emulate`` on devices of ``device_type`` without float8 matmuls (``config check
    --device`` asks the same)."""
    if cfg.fp8.enabled and not cfg.fp8.emulate:
        missing = fp8_matmuls_missing(device_type)
        if missing is not None:
            raise ConfigError(
                f"fp8.enabled without fp8.emulate: {missing}; set fp8.emulate to true (torchao's emulation: the same "
                "casts and scales, the matmuls on dequantized values, slower) or train on an H100-class GPU"
            )


def refuse_on_device(cfg: Config, device_type: str) -> None:
    """What is not built on devices of ``device_type`` (``config check --device`` asks the same). Parameter offload on
    CUDA ([Note: parameter uploads] in :mod:`shardtrain.offload.param_uploads`) is built beside optimizer offload
    (whose host step writes the host shards), in eager mode, without tensor or expert parallelism."""
    zcfg = cfg.zero_optimization
    param, opt = zcfg.offload_param, zcfg.offload_optimizer
    if param.device == "none" or device_type != "cuda" or zcfg.stage != 3:
        return
    refused = [
        (
            opt.device == "none",
            "without offload_optimizer (the host step writes the host shards); add "
            '"offload_optimizer": {"device": "cpu"} (DeepSpeed\'s ZeRO-Infinity configs set both)',
        ),
        (
            opt.device == "cpu" and opt.ratio < 1,
            f"with offload_optimizer.ratio {opt.ratio} (part of the step on the GPU); remove the ratio",
        ),
        (bool(cfg.graph.enabled), "with graph mode (graph.enabled); turn graph mode off"),
        (
            cfg.tensor_parallel.degree not in (1, "auto"),
            f"with tensor parallelism (tensor_parallel.size {cfg.tensor_parallel.degree}); set it to 1",
        ),
        (
            cfg.expert_parallel_size not in (1, "auto"),
            f"with expert parallelism (expert_parallel_size {cfg.expert_parallel_size}); set it to 1",
        ),
    ]
    for hit, what in refused:
        if hit:
            raise ConfigError(
                f"zero_optimization.offload_param.device {param.device!r} on CUDA is not built {what}, or set "
                "offload_param.device to 'none' (docs/offload.md)"
            )


def ineffective_offload_keys(cfg: Config, device_type: str) -> list[str]:
    """One sentence per offload key the user set that can have no effect in this configuration on a machine
    whose devices are ``device_type`` (the engine logs them as warnings at ``initialize``): what was set, why it
    does nothing here, what to do instead."""
    opt, param = cfg.zero_optimization.offload_optimizer, cfg.zero_optimization.offload_param
    prefix, notes = "zero_optimization.", []
    if opt.device == "cpu" and opt.ratio < 1 and device_type != "cuda":
        notes.append(
            f"{prefix}offload_optimizer.ratio {opt.ratio} has no effect with device 'cpu' on a machine without a "
            "GPU: the ratio splits the step between the host and the GPU, and here all optimizer state is in host "
            "memory anyway; remove it, or use device 'nvme' (ratio: the share of the state kept in files)"
        )
    if opt.device != "none" and opt.pin_memory and "pin_memory" in opt.model_fields_set and device_type != "cuda":
        notes.append(
            f"{prefix}offload_optimizer.pin_memory has no effect on a machine without a GPU: page-locked host "
            "memory only speeds copies to and from a GPU; remove it"
        )
    if param.device != "none" and param.pin_memory and "pin_memory" in param.model_fields_set and device_type != "cuda":
        notes.append(
            f"{prefix}offload_param.pin_memory has no effect on a machine without a GPU: page-locked host "
            "memory only speeds copies to a GPU; remove it"
        )
    if opt.device == "cpu" and "buffer_count" in opt.model_fields_set:
        notes.append(
            f"{prefix}offload_optimizer.buffer_count has no effect with device 'cpu': it counts the buffers that "
            "swap files are read into (device 'nvme'); remove it"
        )
    if param.device == "cpu" and "buffer_count" in param.model_fields_set:
        notes.append(
            f"{prefix}offload_param.buffer_count has no effect with device 'cpu': it bounds the units read ahead "
            "from their swap files (device 'nvme'); remove it"
        )
    return notes


__all__ = [
    "activation_policy",
    "check_layout",
    "fp8_matmuls_missing",
    "ineffective_offload_keys",
    "parallel_dims",
    "precision_policy",
    "refuse_fp8_on_device",
    "refuse_unbuilt_fp8",
    "resolve_plan",
]
