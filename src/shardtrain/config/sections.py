"""Typed, validated configuration that accepts DeepSpeed-style keys.

``load_config`` takes a dict, a path to a JSON or YAML file, or a :class:`Config`, and returns a
:class:`Config`. Every mistake raises :class:`ConfigError` naming the full key path, the bad value and what
is allowed. What shardtrain does with each DeepSpeed key (supported, accepted without effect, refused) is one
table in :mod:`shardtrain.config.deepspeed_keys`; nothing is silently ignored.

Validation is pydantic's (types, ranges, enumerations); the key walk of
:func:`shardtrain.config.deepspeed_keys.classify` runs first so that unknown keys get a "did you mean" and DeepSpeed
keys get their own message. :func:`inspect_config` collects every problem instead of raising at the first.
Values written ``"auto"`` stay ``"auto"`` (type :data:`Auto`) until ``initialize`` resolves them
(:mod:`shardtrain.config.auto`).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from typing import Annotated, Any, Literal

import torch
import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, ValidationError, model_validator

from shardtrain.config.deepspeed_keys import (
    AUTO,
    Auto,
    Findings,
    classify,
    is_auto,
    no_effect_here,
    unknown_key_message,
)
from shardtrain.errors import ConfigError
from shardtrain.optim.adam import DeepSpeedAdam
from shardtrain.optim.deepspeed_muon import CONFIG_KEYS as MUON_CONFIG_KEYS
from shardtrain.optim.deepspeed_muon import NS_METHODS, DeepSpeedMuon

log = logging.getLogger("shardtrain")


def _integral(v: Any) -> Any:
    """DeepSpeed configs write sizes as ``5e8``; accept integral floats as ints, refuse 1.5 and "5"."""
    if isinstance(v, bool):
        raise ValueError("expected a whole number, got a boolean")
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _stage(v: Any) -> Any:
    """DeepSpeed reads ``"stage": "2"`` as 2."""
    return int(v) if isinstance(v, str) and v in ("0", "1", "2", "3") else v


# [Note: bounded config values]
# A value `config check` accepts must not fail later inside torch: whole numbers are sizes and counts that reach
# torch as int64 (a tensor's numel, a bucket), so they stay below 2**63; floats are finite everywhere (Infinity and
# NaN parse from JSON and YAML, and an infinite or NaN factor, rate or scale is never meaningful);
# collective_timeout_s is bounded by what a process group takes (MIN_TIMEOUT_S, MAX_TIMEOUT_S).
INT64_MAX = 2**63 - 1

MIN_TIMEOUT_S = 0.001
"""Below 1 ms torch rounds the timeout to 0 ms: every wait, the store connection first, fails at once."""
MAX_TIMEOUT_S = 1e9
"""About 31.7 years. torch's store client adds the timeout to a steady clock in int64 nanoseconds, which overflows
near 9.2e9 s (``init_process_group`` then fails with "timed out after ...ms", or a gloo enforce for larger values;
above 8.64e13 s ``datetime.timedelta`` itself overflows); 1e9 stays well inside."""

Count = Annotated[int, BeforeValidator(_integral), Field(strict=True, ge=1, le=INT64_MAX)]
Size = Annotated[int, BeforeValidator(_integral), Field(strict=True, ge=0, le=INT64_MAX)]


def _count_or_never(v: Any) -> int | None:
    """A whole number >= 1, or never: ``inf`` or ``null`` (None, DeepSpeed's default). accelerate writes
    ``"steps_per_print": inf`` into every DeepSpeed config it builds, and DeepSpeed takes it (its ``global_steps %
    steps_per_print`` is then never 0); the one infinite value accepted ([Note: bounded config values]), for an
    interval only, never for a size, and read as None."""
    if v is None or (isinstance(v, float) and v == math.inf):
        return None
    v = _integral(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= INT64_MAX:
        raise ValueError("expected a whole number >= 1, or inf to never print")
    return v


CountOrNever = Annotated[int | None, PlainValidator(_count_or_never)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def _device(v: Any) -> Any:
    """DeepSpeed writes ``device: null`` for no offload."""
    return "none" if v is None else v


OffloadDevice = Annotated[Literal["none", "cpu", "nvme"], BeforeValidator(_device)]


class _OffloadSection(_Section):
    device: OffloadDevice = "none"
    """Where the state lives between uses: ``none`` (where it is used), ``cpu`` (host memory), ``nvme`` (files)."""
    nvme_path: str | None = None
    """Directory for the swap files (device ``nvme``); each rank makes its own scratch directory in it."""

    @model_validator(mode="after")
    def _path_with_nvme(self) -> _OffloadSection:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device 'nvme' needs nvme_path: the directory the swap files go in (a local fast disk)")
        return self


class OffloadOptimizerConfig(_OffloadSection):
    """DeepSpeed's ``offload_optimizer``: optimizer state (and fp32 masters) in host memory or in files."""

    pin_memory: bool = True
    """Page-locked host buffers (CUDA: faster copies to and from the GPU; no effect on a CPU-only machine). On by
    default, as in DeepSpeed."""
    buffer_count: Count = 4
    """Device ``nvme``: sub-group buffers in flight (one being stepped, the others read ahead or written back)."""
    ratio: float = Field(default=1.0, gt=0, le=1)
    """Fraction of the rank's optimizer-state elements offloaded (the first sub-groups): ``nvme``, the share in swap
    files; ``cpu`` on CUDA, the share stepped on the host (the rest on the GPU)."""


class OffloadParamConfig(_OffloadSection):
    """DeepSpeed's ``offload_param`` (stage 3): parameter shards of units in host memory or in files. Below stage 3
    it has no effect (as in DeepSpeed): the validated config says device ``none``."""

    buffer_count: Count = 5
    """Device ``nvme``: units read ahead of their gather at most (the next read waits until one is gathered)."""
    max_in_cpu: Size = 1_000_000_000
    """Device ``nvme``: parameter elements kept in host memory (the first units) instead of on disk."""
    pin_memory: bool = True
    """Page-locked host shards (CUDA: their copies to the GPU overlap compute; no effect on a CPU-only machine). On
    by default, as ``offload_optimizer.pin_memory``."""


class ZenFlowConfig(_Section):
    """DeepSpeed 0.19.8's ``zero_optimization.zenflow``: stall-free optimizer offload, see [Note: the ZenFlow rule]
    in :mod:`shardtrain.offload.zenflow` and docs/offload.md. Defaults are DeepSpeed's; its ``offload``,
    ``auto_ratio`` and ``pt_reserved_cores_perc`` are classified in the key table (refused or without effect)."""

    topk_ratio: float = Field(default=0.1, gt=0, lt=1)
    """Fraction of each 2-D weight's columns (by gradient magnitude) updated every step."""
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    """When the columns are reselected: every ``select_interval`` steps (``step``) or epochs (``epoch``; ``auto``:
    every epoch). Without a data loader in ``initialize`` an epoch has no length: selected once, as DeepSpeed does."""
    select_interval: Count | Auto | None = None
    """Steps (or epochs) between reselections; ``"auto"`` (or absent) only with ``select_strategy`` ``"auto"``."""
    update_interval: Count | Auto = "auto"
    """Steps between host updates of the other columns (their gradients averaged over them); ``"auto"`` (DeepSpeed's
    default): when the other columns' gradients outweigh the selected ones' ([Note: update_interval "auto"] in
    :mod:`shardtrain.offload.zenflow`)."""
    overlap_step: bool = False
    """The host update runs in a thread while the next ``update_interval`` steps train; it lands one interval late."""
    full_warm_up_rounds: Size = 0
    """Steps of plain full updates before the split starts."""
    auto_ratio: float = Field(default=0.99, ge=0, le=1)
    """With ``update_interval`` ``"auto"``: the fraction of 2-D weights whose other columns must outweigh the
    selected ones for a host update."""

    @model_validator(mode="after")
    def _intervals(self) -> ZenFlowConfig:
        if self.select_strategy == "auto" and self.select_interval not in (None, "auto"):
            raise ValueError(
                f'select_interval {self.select_interval} with select_strategy "auto" (which selects once per epoch, '
                'as DeepSpeed does); set select_strategy "step" to reselect every select_interval steps'
            )
        if self.select_strategy != "auto" and self.select_interval in (None, "auto"):
            raise ValueError(
                f'select_strategy "{self.select_strategy}" needs a whole number select_interval (DeepSpeed\'s rule), '
                'got "auto"'
            )
        if self.select_strategy == "step" and self.update_interval != "auto":
            every, update = self.select_interval, self.update_interval
            if every < update or every % update:
                raise ValueError(
                    f"select_interval {every} is not a multiple of update_interval {update}: columns are reselected "
                    "right after a host update, so that no gradient waits in the accumulator for a column that "
                    "changes side; give a multiple of update_interval"
                )
        return self


class ZeroConfig(_Section):
    stage: Annotated[Literal[0, 1, 2, 3], BeforeValidator(_stage)] = 0
    reduce_bucket_size: Size | Auto = 500_000_000
    """Elements per gradient bucket; also the unit parameters are laid out (and all-gathered) in."""
    allgather_bucket_size: Count = 500_000_000
    """At most this many elements of parameter all-gathers are in flight at once after a step."""
    overlap_comm: bool = True
    """Launch each bucket's reduction as soon as its gradients are ready during backward."""
    stage3_param_persistence_threshold: Size | Auto = 100_000
    """Stage 3: parameters with fewer elements stay whole on every rank."""
    stage3_prefetch_bucket_size: Size | Auto = 50_000_000
    """Stage 3: elements of upcoming units gathered ahead of use (0 disables prefetch)."""
    stage3_unit_classes: list[str] | None = None
    """Stage 3 (shardtrain key): module class names to gather/release as units, instead of repeated blocks."""
    stage3_gather_16bit_weights_on_model_save: bool | Auto = False
    """Stage 3: ``save_16bit_model`` gathers and writes the full weights; without it, as in DeepSpeed, it writes
    nothing and returns False (``"auto"``: true, what Hugging Face's Trainer wants for its saves)."""
    stage3_gather_check: bool = True
    """Stage 3 (shardtrain key): catch ranks on different module paths before a gather mixes them: unit ids exchanged
    before each gather until two passes of a kind gathered alike, none after while every rank follows that order."""
    sub_group_size: Size = 1_000_000_000
    """With optimizer offload: the optimizer steps this rank's fragments in sub-groups of about this many elements."""
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    zenflow: ZenFlowConfig | None = None
    """Stall-free optimizer offload (DeepSpeed's ZenFlow; with ``offload_optimizer.device`` ``cpu``)."""
    mics_shard_size: Annotated[int, BeforeValidator(_integral), Field(strict=True, le=INT64_MAX)] = -1
    """Hybrid sharding (DeepSpeed's MiCS key): shard parameters, gradients and optimizer state within groups of this
    many adjacent data-parallel ranks and replicate them across groups (-1: one group of every data-parallel rank);
    see docs/hybrid-sharding.md."""
    zero_hpz_partition_size: Size = 1
    """ZeRO++ hpZ (stage 3): after a unit's forward gather each rank keeps its share of the unit within groups of
    this many adjacent data-parallel ranks, and backward re-gathers the unit there; 0 or 1: off (as in DeepSpeed);
    see docs/hybrid-sharding.md."""

    @model_validator(mode="after")
    def _offload_stages(self) -> ZeroConfig:
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise ValueError(
                f"offload_optimizer.device {self.offload_optimizer.device!r} needs ZeRO stage 1, 2 or 3 (the "
                "optimizer state is offloaded per rank's shard); set stage >= 1 or device 'none'"
            )
        if self.zenflow is not None and (self.stage not in (1, 2) or self.offload_optimizer.device != "cpu"):
            raise ValueError(
                f"zenflow needs ZeRO stage 1 or 2 with offload_optimizer.device 'cpu' (as DeepSpeed's ZenFlow for "
                f"stages 1-2), got stage {self.stage} with device {self.offload_optimizer.device!r}; its stage-3 "
                "form is not built"
            )
        if self.offload_param.device != "none" and self.stage != 3:
            # DeepSpeed hands offload_param to stage 3 only and ignores it below (it has no parameter shards to
            # offload there): dropped the same way, its keys still marked given so that `config check` names it
            dropped = self.offload_param.model_copy(update={"device": "none"})
            object.__setattr__(self, "offload_param", dropped)
        if self.mics_shard_size == 0 or self.mics_shard_size < -1:
            raise ValueError(
                f"mics_shard_size {self.mics_shard_size} is not a group size: give a number of data-parallel ranks "
                "(>= 1) that divides the data-parallel size, or -1 to shard over all of them"
            )
        if self.mics_shard_size != -1 and self.stage == 0:
            raise ValueError(
                f"mics_shard_size {self.mics_shard_size} shards state within groups of ranks, but ZeRO stage 0 "
                "shards nothing; set stage 1, 2 or 3, or remove mics_shard_size"
            )
        if self.zero_hpz_partition_size > 1 and self.mics_shard_size != -1 and self.stage == 3:
            raise ValueError(
                f"zero_hpz_partition_size {self.zero_hpz_partition_size} with mics_shard_size {self.mics_shard_size}: "
                "the two are alternatives (hpZ keeps state sharded over every rank and a second copy of the "
                "parameters within a node; MiCS shards everything within the group), and hpZ over MiCS groups is "
                "not built; keep one of them"
            )
        return self


class TensorParallelConfig(_Section):
    """Megatron-style tensor parallelism over groups of ``size`` adjacent ranks (see docs/tensor-parallel.md)."""

    size: Count = 1
    """Ranks each layer is split across; the data-parallel size is the world size divided by it."""
    autotp_size: Size | None = None
    """DeepSpeed's name for ``size`` (AutoTP; 0 means off); give one of them."""

    @model_validator(mode="after")
    def _one_size(self) -> TensorParallelConfig:
        if self.autotp_size is not None and "size" in self.model_fields_set and self.degree != self.size:
            raise ValueError(f"size {self.size} and autotp_size {self.autotp_size} disagree; give one of them")
        return self

    @property
    def degree(self) -> int:
        """The tensor-parallel size in effect."""
        return max(1, self.autotp_size) if self.autotp_size is not None else self.size


PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
"""The schedules of ``torch.distributed.pipelining`` built here. The zero-bubble ones (``InterleavedZeroBubble``,
``ZBVZeroBubble``, ``DualPipeV``) split each backward into an input and a weight pass, which the gradient reducer is
handed ([Note: the weight pass reaches the reducer] in pipeline_parallel/schedule.py); the V-shaped ones place
stages ``r`` and ``2 pp - 1 - r`` on pipeline rank ``r``, two per rank."""
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""The zero-bubble schedules (``pipeline_parallel/order.py`` names the same; config imports no axis)."""
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules that run several stages per rank (``stages_per_rank`` >= 2; exactly 2 for the V-shaped ones)."""


class PipelineConfig(_Section):
    """Pipeline parallelism's schedule (see docs/pipeline-parallel.md); the size is ``pipeline_parallel_size``."""

    schedule: str = "1F1B"
    """A schedule name ``torch.distributed.pipelining.schedules.get_schedule_class`` accepts, among those built here:
    ``GPipe``, ``1F1B`` (the default), and with ``stages_per_rank`` > 1 ``Interleaved1F1B``, ``LoopedBFS``,
    ``InterleavedZeroBubble``, or (exactly 2) ``ZBVZeroBubble`` and ``DualPipeV``."""
    stages_per_rank: Count = 1
    """Stages each pipeline rank holds: the model is cut into ``pipeline_parallel_size * stages_per_rank`` stages."""
    stages: Count | Auto | None = None
    """DeepSpeed's key: the pipeline's size, which must be ``pipeline_parallel_size`` (a PipelineModule's
    ``num_stages``); ``"auto"`` is resolved to it at ``initialize``, unset it is not checked (see [Note: DeepSpeed's
    pipeline keys])."""
    activation_checkpoint_interval: Size = 0
    """DeepSpeed's PipelineEngine key: checkpoint the layers in runs of this many (0: none). A ``PipelineModule``
    checkpoints its layers so, as DeepSpeed's; a model cut here checkpoints each block on its own, so only 1 (each
    block recomputed whole, ``activation_checkpointing.policy`` full) is built for it ([Note: DeepSpeed's checkpoint
    interval] in engine/parallelize.py)."""

    @model_validator(mode="after")
    def _schedule(self) -> PipelineConfig:
        known = {name.lower(): name for name in PIPELINE_SCHEDULES}
        name = known.get(self.schedule.lower())
        if name is None:
            raise ValueError(f"pipeline.schedule {self.schedule!r} is not built; use one of {list(PIPELINE_SCHEDULES)}")
        multi = name in MULTI_STAGE_SCHEDULES
        if multi != (self.stages_per_rank > 1):
            raise ValueError(
                f"pipeline.schedule {name!r} with stages_per_rank {self.stages_per_rank}: "
                + (
                    "a multi-stage schedule needs stages_per_rank of 2 or more"
                    if multi
                    else "GPipe and 1F1B run one stage per rank; use Interleaved1F1B for several"
                )
            )
        if name in ("ZBVZeroBubble", "DualPipeV") and self.stages_per_rank != 2:
            raise ValueError(
                f"pipeline.schedule {name!r} with stages_per_rank {self.stages_per_rank}: a V-shaped schedule holds "
                "exactly 2 stages per rank (r and 2 pp - 1 - r); set stages_per_rank 2, or use InterleavedZeroBubble"
            )
        return self

    @property
    def schedule_name(self) -> str:
        """``schedule`` spelled as ``PIPELINE_SCHEDULES`` spells it (the name is matched without case)."""
        return {name.lower(): name for name in PIPELINE_SCHEDULES}[self.schedule.lower()]


class GraphConfig(_Section):
    """Graph mode (shardtrain section): capture the forward and backward per input schema (docs/graph-mode.md)."""

    enabled: bool = False
    strict: bool = False
    """A construct that cannot be captured is an error instead of a warning and an eager fallback."""
    cache_size: Count = 8
    """Captured graphs kept (one per input schema); the least recently used is evicted."""
    compiler: Literal["aot_eager", "inductor"] = "aot_eager"
    """How captured graphs run: as traced (exact eager numerics) or compiled by Inductor (fused kernels)."""
    dynamic_shapes: bool = True
    """Graphs generic in the inputs' sizes (a new batch size or sequence length reuses the graph); ``False``: one
    graph per set of sizes, specialized on them (less memory and capture work for fixed-shape training)."""


class FP8FilterConfig(_Section):
    """Which ``nn.Linear`` layers stay in high precision besides those the fp8 kernels cannot take."""

    exclude: list[str] = Field(default_factory=list)
    """Module-name patterns (``fnmatch``: ``*`` and ``?``, matched against the whole name, e.g.
    ``"blocks.0.*"``) of linear layers that keep computing in the compute dtype."""


class FP8Config(_Section):
    """FP8 training (shardtrain section): the model's ``nn.Linear`` layers compute their matmuls in float8 through
    torchao's ``convert_to_float8_training`` (docs/fp8.md)."""

    enabled: bool = False
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao's float8 training recipe (``Float8LinearConfig.from_recipe_name``): one scale per tensor, one per row,
    or one per row with the weight gradient's matmul in high precision."""
    emulate: bool = False
    """torchao's emulation: the same casts and scales, the matmuls on dequantized values, on devices without fp8
    matmuls (the CPU, CUDA below capability 8.9)."""
    filter: FP8FilterConfig = Field(default_factory=FP8FilterConfig)
    gather_in_float8: bool = True
    """ZeRO-3 with the tensorwise recipe: forward and backward gather the converted weights in float8, 1 byte per
    element, cast with the whole weight's scale (the same numerics as gathering them in the compute dtype)."""


class ActivationCheckpointingConfig(_Section):
    """Activation checkpointing of the model's blocks (DeepSpeed's section, with shardtrain's ``policy``; see
    docs/activation-checkpointing.md). The blocks are the modules ZeRO-3 makes units of, at every stage."""

    policy: Literal["none", "full", "selective", "budget"] = "none"
    """``none``: nothing is recomputed (DeepSpeed's behaviour: its section only configures the model's own calls);
    ``full``: each block keeps only its inputs and runs again in backward; ``selective``: each block also keeps its
    matmul and attention outputs and recomputes the rest; ``budget``: the planner picks per block (none, selective
    or full) at ``initialize``, the least recompute whose predicted peak fits ``memory_budget_gib``."""
    memory_budget_gib: float | None = Field(default=None, gt=0)
    """``budget``: GiB one rank's predicted peak must fit (device memory; on a CPU the process's)."""
    budget_seq_len: Count | None = None
    """``budget``: tokens per sequence the budget is planned for (one micro-batch of it is run on fake tensors)."""
    cpu_checkpointing: bool = False
    """The inputs checkpointed blocks keep wait in host memory between forward and backward."""
    partition_activations: bool = False
    """With tensor parallelism each rank keeps 1/tp of a checkpointed block's inputs, all-gathered before the
    recompute (not with ``cpu_checkpointing``); without it there is nothing to partition."""

    contiguous_memory_optimization: bool = False
    """DeepSpeed copies its checkpoints into one preallocated buffer: not built, refused with a policy."""
    synchronize_checkpoint_boundary: bool = False
    """DeepSpeed synchronizes the device around each checkpoint (a timing aid): not built, refused with a policy."""
    profile: bool = False
    """DeepSpeed times its checkpoint calls: not built, refused with a policy."""

    @model_validator(mode="after")
    def _policy_built(self) -> ActivationCheckpointingConfig:
        unbuilt = {
            "contiguous_memory_optimization": "the copy of the checkpoints into one preallocated buffer (the caching "
            "allocator holds them here)",
            "synchronize_checkpoint_boundary": "a device synchronize around every checkpoint",
            "profile": "timers around the checkpoint calls (use flops_profiler or torch's profiler)",
        }
        for key, what in unbuilt.items():
            if getattr(self, key) and self.policy != "none":
                raise ValueError(
                    f"{key}: true with policy {self.policy!r}: {what} is not built; remove it or set it to false"
                )
        budget_keys = [k for k in ("memory_budget_gib", "budget_seq_len") if getattr(self, k) is not None]
        if self.policy == "budget" and len(budget_keys) < 2:
            raise ValueError(
                "policy 'budget' needs memory_budget_gib (the GiB one rank's peak must fit) and budget_seq_len (the "
                "tokens per sequence it is planned for), e.g. "
                '{"policy": "budget", "memory_budget_gib": 70, "budget_seq_len": 8192}'
            )
        if self.policy != "budget" and budget_keys:
            raise ValueError(
                f"{' and '.join(budget_keys)} with policy {self.policy!r}: read by policy 'budget' only; set "
                "policy to 'budget' or remove them"
            )
        return self


class BF16Config(_Section):
    enabled: bool | Auto = False
    check_grad_overflow: bool = True
    """Skip a step whose gradients hold inf or NaN (DeepSpeed's default); ``false``: apply it. DeepSpeed honours
    ``false`` at ZeRO stages 1 and 2 only (its stage 0 and stage 3 bf16 optimizers always skip), and so does this."""


class FP16Config(_Section):
    enabled: bool | Auto = False
    loss_scale: float = Field(default=0.0, ge=0)
    """0 = dynamic loss scaling; a positive value is a static scale."""
    initial_scale_power: int = Field(default=16, ge=0, le=64)
    loss_scale_window: Count = 1000
    hysteresis: Count = 2
    min_loss_scale: float = Field(default=1.0, ge=0)
    auto_cast: bool = False
    """Cast the floating tensors among ``forward``'s positional arguments to fp16 (:func:`cast_inputs_half`)."""

    @model_validator(mode="after")
    def _dynamic_floor(self) -> FP16Config:
        if self.enabled is True and self.loss_scale == 0 and self.min_loss_scale <= 0:
            raise ValueError(
                f"min_loss_scale {self.min_loss_scale:g} with dynamic loss scaling (loss_scale 0): the scale's floor "
                "must be > 0 (DeepSpeed refuses it too); give a positive min_loss_scale, e.g. 1"
            )
        return self


def cast_inputs_half(inputs: Any) -> Any:
    """DeepSpeed's ``fp16.auto_cast``: every floating tensor in ``inputs`` (walking lists, tuples and dicts) as fp16,
    everything else as it is. The engine applies it to ``forward``'s positional arguments only, as DeepSpeed does."""
    if isinstance(inputs, (list, tuple)) and not hasattr(inputs, "_fields"):
        return type(inputs)(cast_inputs_half(v) for v in inputs)
    if isinstance(inputs, tuple):  # a named tuple is built from its fields
        return type(inputs)(*(cast_inputs_half(v) for v in inputs))
    if isinstance(inputs, dict):
        return {k: cast_inputs_half(v) for k, v in inputs.items()}
    if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        return inputs.half()
    return inputs


class OptimizerConfig(_Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(_Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class WarmupLRParams(_Section):
    warmup_min_lr: float = Field(default=0.0, ge=0)
    warmup_max_lr: float | None = Field(default=None, ge=0)
    """None: the optimizer's lr (DeepSpeed's default for WarmupLR)."""
    warmup_num_steps: Count = 1000
    warmup_type: Literal["log", "linear"] = "log"


class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: Count
    warmup_max_lr: float = Field(default=0.001, ge=0)  # DeepSpeed's default for WarmupDecayLR


class LRRangeTestParams(_Section):
    """DeepSpeed's LRRangeTest (see :class:`shardtrain.optim.schedulers.LRRangeTest`)."""

    lr_range_test_min_lr: float = Field(default=0.001, ge=0)
    lr_range_test_step_size: Count = 2000
    lr_range_test_step_rate: float = Field(default=1.0, ge=0)
    lr_range_test_staircase: bool = False


class WarmupCosineLRParams(_Section):
    """DeepSpeed's WarmupCosineLR: ratios of the optimizer's own lr
    (:class:`shardtrain.optim.schedulers.WarmupCosineLR`)."""

    total_num_steps: Count
    warmup_min_ratio: float = Field(default=0.0, ge=0)
    warmup_num_steps: Count = 1000
    cos_min_ratio: float = Field(default=0.0001, ge=0)
    warmup_type: Literal["log", "linear"] = "log"


class OneCycleParams(_Section):
    """DeepSpeed's OneCycle (see :class:`shardtrain.optim.schedulers.OneCycle`)."""

    cycle_min_lr: float = Field(ge=0)
    cycle_max_lr: float = Field(ge=0)
    decay_lr_rate: float = Field(default=0.0, ge=0)
    cycle_first_step_size: Count = 2000
    cycle_second_step_size: Size | None = None
    """None: the same as ``cycle_first_step_size``."""
    cycle_first_stair_count: Size = 0
    cycle_second_stair_count: Size | None = None
    """None: the same as ``cycle_first_stair_count``."""
    decay_step_size: Size = 0
    cycle_momentum: bool = True
    cycle_min_mom: float = Field(default=0.8, ge=0, lt=1)
    cycle_max_mom: float = Field(default=0.9, ge=0, lt=1)
    decay_mom_rate: float = Field(default=0.0, ge=0)


class FlopsProfilerConfig(_Section):
    """DeepSpeed's flops profiler: rank 0 counts the model's forward FLOPs at one step (``torch.utils.flop_counter``)
    and the monitor turns them into TFLOP/s per rank and MFU (see [Note: model FLOPs and MFU])."""

    enabled: bool = False
    profile_step: Size = 1
    """The optimizer step whose forwards are counted (DeepSpeed's: after ``profile_step`` steps)."""
    module_depth: Annotated[int, Field(ge=-1, le=INT64_MAX)] = -1
    """Depth of the per-module table in the report; -1: every level."""
    detailed: bool = True
    """Write the per-module table in the report."""
    output_file: str | None = None
    """Write the report to this file instead of the log."""
    recompute_fwd_factor: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Share of the forward recomputed in backward (activation checkpointing): hardware FLOPs are
    ``(3 + factor) x forward``, model FLOPs stay ``3 x forward``."""
    peak_tflops: Annotated[float, Field(gt=0, le=1e9)] | None = None
    """shardtrain's own key: the device's peak TFLOP/s for MFU; default the dense 16-bit peak of known GPUs."""


class MonitorConfig(_Section):
    """DeepSpeed's ``tensorboard`` and ``csv_monitor`` sections (written by :mod:`shardtrain.engine.monitor`)."""

    enabled: bool = False
    output_path: str = ""
    """Directory for the monitor's files; empty: the working directory (DeepSpeed's: ``./<job_name>``)."""
    job_name: str = "DeepSpeedJobName"
    """Subdirectory of ``output_path`` for this run."""


class WandbConfig(_Section):
    """DeepSpeed's ``wandb`` section; needs the ``wandb`` package when enabled."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class DataTypesConfig(_Section):
    """DeepSpeed's ``data_types`` section."""

    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    """dtype the gradients of compute-dtype parameters are accumulated in over micro-steps; default the compute dtype,
    as in DeepSpeed; ``"fp32"``: exact accumulation, for 2 bytes per parameter more (see [Note: mixed precision])."""


class CheckpointWriterConfig(_Section):
    decoupled: bool = False
    """DeepSpeed's key: save checkpoints in the background, as ``save_checkpoint(..., async_save=True)`` (the default
    of its ``async_save``; see [Note: asynchronous checkpoints])."""


class CheckpointConfig(_Section):
    writer: CheckpointWriterConfig = Field(default_factory=CheckpointWriterConfig)


class Config(_Section):
    """The whole configuration. Field names are DeepSpeed's where DeepSpeed has the same concept."""

    train_batch_size: Count | Auto | None = None
    train_micro_batch_size_per_gpu: Count | Auto | None = None
    gradient_accumulation_steps: Count | Auto | None = None
    gradient_clipping: Annotated[float, Field(ge=0)] | Auto = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping. DeepSpeed's default, 1.0, when absent (see
    [Note: DeepSpeed's defaults])."""
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    sequence_parallel_size: Count = 1
    """Ulysses sequence parallelism: ranks sharing one sequence, each holding 1/size of it (DeepSpeed's key;
    docs/sequence-parallel.md)."""
    context_parallel_size: Count = 1
    """Context parallelism (ring attention, shardtrain key): ranks sharing one sequence, each holding two of its
    ``2 * size`` chunks (a head and a tail, so causal work is equal); docs/context-parallel.md."""
    expert_parallel_size: Count = 1
    """Expert parallelism: ranks of one expert group, each holding num_experts / size whole experts of every MoE layer
    (DeepSpeed-MoE's ``ep_size``, one size for every layer; docs/expert-parallel.md)."""
    pipeline_parallel_size: Count = 1
    """Pipeline parallelism: stages the model is cut into by layers, each held by world / size ranks; micro-batches
    per step are ``gradient_accumulation_steps`` (docs/pipeline-parallel.md)."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    tiled_logits_loss: bool = False
    """ALST's tiled loss (shardtrain key): the causal-LM cross-entropy computed over tiles of the tokens, each tile's
    logits recomputed in backward, so the whole logits never exist (docs/sequence-parallel.md)."""
    tiled_logits_loss_shards: Count | None = None
    """Tiles of the tiled loss; default ALST's: the fp32 logits in tiles of at most 1 GiB."""
    tiled_mlp_compute: bool = False
    """ALST's tiled MLP (ArcticTraining's key): every MLP run over tiles of the tokens, recomputed in backward."""
    tiled_mlp_shards: Count | None = None
    """Tiles of the tiled MLP; default ALST's: ``ceil(tokens / hidden size)``."""
    graph: GraphConfig = Field(default_factory=GraphConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    fp8: FP8Config = Field(default_factory=FP8Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    fp16: FP16Config = Field(default_factory=FP16Config)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    communication_data_type: Literal["fp32", "bf16", "fp16"] | None = None
    """dtype gradients are reduced in; default the compute dtype, as in DeepSpeed (see [Note: mixed precision])."""
    prescale_gradients: bool = False
    """Divide gradients by the data-parallel size before a summing reduction (:func:`gradient_predivide`)."""
    gradient_predivide_factor: float = Field(default=1.0, gt=0)
    """Divide gradients by this before a summing reduction, by dp / this after (:func:`gradient_predivide`)."""
    steps_per_print: CountOrNever = None
    """Rank 0 logs loss, lr and grad norm every this many optimizer steps; absent (DeepSpeed's default) or ``inf``
    (what accelerate writes): never. The monitors write every step whatever it says."""
    wall_clock_breakdown: bool = False
    """Log forward/backward/step wall-clock times every ``steps_per_print`` steps (rank 0)."""
    tensorboard: MonitorConfig = Field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = None
    """numpy's seeds are 0 to 2**32 - 1."""
    zero_allow_untested_optimizer: bool = False
    """Accept at stages 1-3 an optimizer not known to be element-wise (see [Note: element-wise optimizers])."""
    device: Literal["cpu", "cuda"] | None = None
    """shardtrain's own key: where the engine trains; unset, ``SHARDTRAIN_DEVICE`` decides, then CUDA when available
    (see [Note: choosing the device])."""
    collective_timeout_s: float = Field(default=1800.0, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
    """shardtrain's own key: seconds a collective may wait before failing with a named error; from 0.001 (1 ms) to
    1e9 (about 31.7 years; torch's process group overflows near 9.2e9), see [Note: bounded config values]."""
    desync_check: bool = True
    """shardtrain's own key: ranks exchange where they are before every engine call that communicates, so that a
    rank that diverges fails at once on every rank, naming each (see [Note: phase agreement])."""

    @model_validator(mode="after")
    def _sequence_parallel_graph(self) -> Config:
        # a rule that needs no world size: refused when the config is loaded (`config check` says it too)
        if self.sequence_parallel_size != 1 and self.graph.enabled:
            raise ValueError(
                f"graph.enabled with sequence_parallel_size {self.sequence_parallel_size}: the Ulysses all-to-alls do "
                "not run in captured graphs yet; turn graph mode off (docs/sequence-parallel.md)"
            )
        return self

    @model_validator(mode="after")
    def _context_parallel_graph(self) -> Config:
        if self.context_parallel_size != 1 and self.graph.enabled:
            raise ValueError(
                f"graph.enabled with context_parallel_size {self.context_parallel_size}: the ring attention's "
                "collectives do not run in captured graphs yet; turn graph mode off (docs/context-parallel.md)"
            )
        return self

    @model_validator(mode="after")
    def _activation_checkpointing_graph(self) -> Config:
        if self.activation_checkpointing.policy != "none" and self.graph.enabled:
            raise ValueError(
                f"activation_checkpointing.policy {self.activation_checkpointing.policy!r} with graph.enabled: the "
                "recompute runs module hooks in backward, outside the captured graphs; turn graph mode off, or "
                "set policy 'none'"
            )
        return self

    @model_validator(mode="after")
    def _flops_profiler_graph(self) -> Config:
        if self.flops_profiler.enabled and self.graph.enabled:
            raise ValueError(
                "flops_profiler.enabled with graph.enabled: the FLOP counter is a dispatch mode, which captured graphs "
                "do not run under; profile the same model and batch with graph mode off (the FLOPs are the same)"
            )
        return self

    @model_validator(mode="after")
    def _precision(self) -> Config:
        if self.bf16.enabled is True and self.fp16.enabled is True:
            raise ValueError("bf16.enabled and fp16.enabled are both true; enable one of them")
        if is_auto(self.bf16.enabled) or is_auto(self.fp16.enabled):
            return self  # checked again once "auto" is resolved
        compute = "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"
        if compute == "fp32" and self.communication_data_type not in (None, "fp32"):
            raise ValueError(
                "communication_data_type applies to mixed precision only; enable bf16 or fp16, or remove it"
            )
        if self.communication_data_type not in (None, "fp32", compute):
            raise ValueError(
                f"communication_data_type {self.communication_data_type!r} with {compute} compute; use 'fp32' "
                f"or {compute!r} (the default)"
            )
        if self.fp8.enabled and compute == "fp16":
            raise ValueError(
                "fp8.enabled with fp16: torchao's float8 training keeps its high-precision side in bf16 or fp32 "
                "(fp16's range cannot hold what a float8 scale undoes); use bf16 with fp8"
            )
        accum = self.data_types.grad_accum_dtype
        if accum not in (None, "fp32", compute):
            raise ValueError(
                f"data_types.grad_accum_dtype {accum!r} with {compute} compute is not built (DeepSpeed refuses most "
                f"such mixes too); use 'fp32' or {compute!r}, the compute dtype (the default)"
            )
        return self


# -- optimizer and scheduler validation ----------------------------------------------------------

_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
_SCHEDULERS: dict[str, type[_Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}


def _deepspeed_muon_params(cfg: OptimizerConfig, allow_auto: bool) -> dict[str, Any]:
    """DeepSpeed's Muon type's keys, checked; the optimizer is built by ``DeepSpeedMuon.from_config`` (it needs the
    model's parameter names). See [Note: DeepSpeed's Muon is not torch's] in optim/deepspeed_muon.py."""
    autos = [k for k, v in cfg.params.items() if is_auto(v)]
    if autos and not allow_auto:
        raise ConfigError(f'optimizer.params.{autos[0]}: "auto" was not resolved; give a value')
    params = {k: v for k, v in cfg.params.items() if not is_auto(v)}
    for key in [*params, *autos]:
        if key not in MUON_CONFIG_KEYS:
            raise ConfigError(unknown_key_message(f"optimizer.params.{key}", key, sorted(MUON_CONFIG_KEYS)))
    for key, value in params.items():
        if key in ("adam_w_mode", "torch_adam", "per_head_muon"):
            if not isinstance(value, bool):
                raise ConfigError(f"optimizer.params.{key}: expected true or false, got {value!r}")
        elif key == "ns_method":
            if value not in NS_METHODS:
                raise ConfigError(f"optimizer.params.ns_method: expected one of {list(NS_METHODS)}, got {value!r}")
        elif key == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(_is_finite(b) for b in value):
                raise ConfigError(f"optimizer.params.betas: expected two numbers [beta1, beta2], got {value!r}")
        elif not _is_finite(value):
            raise ConfigError(f"optimizer.params.{key}: expected a finite number, got {value!r}")
    if params.get("per_head_muon"):
        raise ConfigError(
            "optimizer.params.per_head_muon: DeepSpeed's per-head orthogonalization of attention projections is not "
            "served (docs/muon.md); leave it false (each matrix orthogonalized whole)"
        )
    params.pop("torch_adam", None)  # which of DeepSpeed's Adam implementations: the same formula
    return params


def optimizer_class_and_kwargs(
    cfg: OptimizerConfig, allow_auto: bool = False
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Map a DeepSpeed optimizer section onto a torch optimizer class and keyword arguments.

    As in DeepSpeed, ``type: Adam`` has ``adam_w_mode: true`` by default, i.e. decoupled weight decay
    (torch's AdamW); ``adam_w_mode: false`` gives torch's Adam (L2 penalty). ``bias_correction: false`` (DeepSpeed's
    fused Adam argument) gives :class:`shardtrain.optim.adam.DeepSpeedAdam` in the same weight-decay mode.
    ``allow_auto``: check the other values of a section that still has ``"auto"`` ones (``load_config``); otherwise
    ``"auto"`` is an error.
    """
    kind = cfg.type.lower()
    if kind == "muon":
        return DeepSpeedMuon, _deepspeed_muon_params(cfg, allow_auto)
    if kind not in _OPTIMIZERS:
        raise ConfigError(
            f"optimizer.type: {cfg.type!r} is not supported; allowed: Adam, AdamW, SGD "
            "(or pass a torch optimizer to initialize(optimizer=...))"
        )
    autos = [k for k, v in cfg.params.items() if is_auto(v)]
    if autos and not allow_auto:
        raise ConfigError(f'optimizer.params.{autos[0]}: "auto" was not resolved; give a value')
    params = {k: v for k, v in cfg.params.items() if not is_auto(v)}
    if kind in ("adam", "adamw"):  # DeepSpeed reads adam_w_mode for both; AdamW is AdamW whatever it says
        adam_w_mode = params.pop("adam_w_mode", True)
        bias_correction = params.pop("bias_correction", True)
        for key, flag in (("adam_w_mode", adam_w_mode), ("bias_correction", bias_correction)):
            if not isinstance(flag, bool):
                raise ConfigError(f"optimizer.params.{key}: expected true or false, got {flag!r}")
        decoupled = adam_w_mode or kind == "adamw"
        if bias_correction:
            cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        else:  # torch's Adam always corrects the moments' bias: DeepSpeed's fused update without it
            cls = DeepSpeedAdam
            params.update(bias_correction=False, adam_w_mode=decoupled)
    else:
        cls = _OPTIMIZERS[kind]
    signature = inspect.signature(cls).parameters
    allowed = [p for p in signature if p != "params"]
    for key in [*params, *autos]:
        if key not in allowed:
            raise ConfigError(unknown_key_message(f"optimizer.params.{key}", key, allowed))
    for key, value in params.items():  # the type the default has, before torch compares a dict with a float
        default = signature[key].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"optimizer.params.{key}: expected true or false, got {value!r}")
        if _is_number(default) and not _is_number(value):
            raise ConfigError(f"optimizer.params.{key}: expected a number, got {value!r}")
        if _is_number(value) and not math.isfinite(value):  # see [Note: bounded config values]
            raise ConfigError(f"optimizer.params.{key}: expected a finite number, got {value!r}")
    if "betas" in params:
        betas = params["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(_is_finite(b) for b in betas):
            raise ConfigError(f"optimizer.params.betas: expected two numbers [beta1, beta2], got {betas!r}")
        params["betas"] = tuple(betas)
    try:  # let torch validate values (negative lr, betas out of range) on a throwaway tensor
        cls([torch.zeros(1, requires_grad=True)], **params)
    except Exception as err:  # whatever torch's checks raise (ValueError, TypeError, ...) is a bad value
        raise ConfigError(f"optimizer.params: {err} (got {cfg.params!r})") from err
    return cls, params


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    return _is_number(v) and math.isfinite(v)


def scheduler_params(cfg: SchedulerConfig, allow_auto: bool = False) -> _Section | None:
    """The validated params of a scheduler section; None when ``allow_auto`` and some are still ``"auto"``."""
    if cfg.type not in _SCHEDULERS:
        raise ConfigError(
            f"scheduler.type: {cfg.type!r} is not supported; allowed: {', '.join(_SCHEDULERS)} "
            "(or pass a torch LR scheduler to initialize(lr_scheduler=...))"
        )
    model = _SCHEDULERS[cfg.type]
    autos = {k for k, v in cfg.params.items() if is_auto(v)}
    if autos and not allow_auto:
        raise ConfigError(f'scheduler.params.{sorted(autos)[0]}: "auto" was not resolved; give a value')
    for key in cfg.params:
        if key not in model.model_fields:
            raise ConfigError(unknown_key_message(f"scheduler.params.{key}", key, list(model.model_fields)))
    try:
        params = model.model_validate({k: v for k, v in cfg.params.items() if k not in autos})
    except ValidationError as err:
        # a required value written "auto" is not missing: it is filled in at initialize
        errors = [e for e in err.errors() if not (e["type"] == "missing" and e["loc"][0] in autos)]
        if errors:
            raise ConfigError("\n".join(_format_errors(errors, "scheduler.params"))) from None
        return None
    return None if autos else params


# -- loading ----------------------------------------------------------------------------------------


@dataclass
class ConfigReport:
    """Everything :func:`inspect_config` found in one config, every problem included."""

    config: Config | None
    """The validated config (``"auto"`` values kept); None when there are problems."""
    problems: list[str] = field(default_factory=list)
    """``key.path: what is wrong and what to do``."""
    no_effect: list[str] = field(default_factory=list)
    """``key.path: why``, for keys accepted without effect."""
    autos: dict[str, str] = field(default_factory=dict)
    """key path -> what ``initialize`` resolves that ``"auto"`` from."""
    warnings: list[str] = field(default_factory=list)
    """``key.path: what to use instead``, for diagnostics the config turns on that are not built (accepted)."""

    @property
    def ok(self) -> bool:
        return not self.problems


def load_config(source: Config | Mapping[str, Any] | str | Path | None) -> Config:
    """A validated :class:`Config`; :class:`ConfigError` listing every problem (each with its key path)."""
    if source is None:
        return Config()
    if isinstance(source, Config):
        return source
    report = inspect_config(source)
    if report.problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(report.problems))
    for line in report.warnings:
        log.warning("config: %s", line)
    assert report.config is not None
    return report.config


def inspect_config(source: Mapping[str, Any] | str | Path) -> ConfigReport:
    """Validate ``source`` collecting every problem, the keys accepted without effect and the "auto" values."""
    try:
        if isinstance(source, (str, Path)):
            data = _read_file(Path(source))
        elif isinstance(source, Mapping):
            data = dict(source)
        else:
            raise ConfigError(
                "config must be a dict, a path to a .json/.yaml file or a shardtrain.Config; "
                f"got {type(source).__name__}"
            )
    except ConfigError as err:
        return ConfigReport(None, [str(err)])
    clean, found = classify(data, Config)
    return _validate(clean, found)


def _validate(clean: Mapping[str, Any], found: Findings) -> ConfigReport:
    problems = list(found.problems)
    cfg = None
    try:
        cfg = Config.model_validate(clean)
    except ValidationError as err:
        problems += _format_errors(err.errors(), "")
    if cfg is not None:
        for check, section in ((optimizer_class_and_kwargs, cfg.optimizer), (scheduler_params, cfg.scheduler)):
            if section is not None:
                try:
                    check(section, allow_auto=True)
                except ConfigError as err:
                    problems.append(str(err))
    problems = [found.as_written(line) for line in problems]
    no_effect = list(found.no_effect)
    if cfg is not None:  # supported keys that do nothing in the combination this config gives
        no_effect += [found.as_written(line) for line in no_effect_here(cfg)]
    return ConfigReport(None if problems else cfg, problems, no_effect, dict(found.autos), list(found.warnings))


MAX_CONFIG_BYTES = 64 << 20
"""A DeepSpeed config is a few kilobytes; a larger file is not one (and is not read whole)."""


MAX_YAML_ALIASES = 100
"""Aliases (``*name``) a YAML config may hold. A few nested anchors expand to billions of nodes (the "billion laughs"
document), which every later walk of the config would visit; a real config uses a handful."""


class _BoundedYamlLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing a document with more than :data:`MAX_YAML_ALIASES` aliases."""

    aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                raise yaml.YAMLError(
                    f"more than {MAX_YAML_ALIASES} aliases (*name): a document that expands, not a config"
                )
        return super().compose_node(parent, index)


def _read_file(path: Path) -> dict[str, Any]:
    """The mapping in a .json/.yaml file; any file a user can hand in that is not one is a ConfigError naming it."""
    name = str(path)
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"config file {name!r}: unknown extension; use .json, .yaml or .yml")
    try:
        # O_NONBLOCK: a FIFO opens at once and is refused below instead of blocking until a writer comes
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ConfigError(f"config file {name!r} does not exist") from None
    except OSError as err:
        raise ConfigError(f"config file {name!r} cannot be read: {err.strerror}") from None
    if not S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"config file {name!r} is not a regular file (a directory, a FIFO, a device)")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {name!r} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a config")
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not content
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {name!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    kind = path.suffix[1:].upper().replace("YML", "YAML")
    try:
        data = yaml.load(text, Loader=_BoundedYamlLoader) if kind == "YAML" else json.loads(text)  # a safe loader
    except RecursionError:
        raise ConfigError(f"config file {name!r} is not valid {kind}: nested too deeply") from None
    except (ValueError, yaml.YAMLError) as err:
        raise ConfigError(f"config file {name!r} is not valid {kind}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {name!r} must hold a mapping at the top, got {type(data).__name__}")
    return data


def _is_schema_tag(part: Any) -> bool:
    """Parts of a pydantic error location that name a union member or a validator, not a key."""
    text = str(part)
    return isinstance(part, str) and (
        "[" in text or text.startswith(("function-", "constrained-")) or text in ("bool", "int", "float", "str")
    )


def _format_errors(errors: list[Any], prefix: str) -> list[str]:
    lines: list[str] = []
    for e in errors:
        if any(str(p) == f"literal[{AUTO!r}]" for p in e["loc"]):
            continue  # the other member of "value | auto" says what is wrong
        loc = ".".join(str(p) for p in e["loc"] if not _is_schema_tag(p))
        loc = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        msg = e["msg"].removeprefix("Value error, ")
        if not loc:  # a rule about several keys: the message names them, the input is the whole config
            line = f"config: {msg}"
        else:
            line = f"{loc}: {msg} (got {e.get('input')!r})"
        if line not in lines:
            lines.append(line)
    return lines


def gradient_predivide(cfg: Config, dp: int) -> float | None:
    """What the gradient reductions divide by before summing, as DeepSpeed's ``allreduce_bucket``: the data-parallel
    size with ``prescale_gradients``, else ``gradient_predivide_factor`` when it is not 1 (the rest of the average,
    dp / factor, is divided after); None: they average (``"avg"``), the default."""
    if cfg.prescale_gradients:
        return float(dp)
    if cfg.gradient_predivide_factor != 1:
        return cfg.gradient_predivide_factor
    return None


def resolve_batch_sizes(cfg: Config, dp: int) -> tuple[int, int, int]:
    """Return (train_batch_size, micro_batch_per_rank, accumulation_steps) consistent with ``dp`` ranks.

    Follows DeepSpeed: any two determine the third; one alone leaves accumulation at 1; none gives
    micro batch 1 and accumulation 1.
    """
    tb, mb, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    where = f"with {dp} data-parallel rank(s)"
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * dp:
            raise ConfigError(
                f"train_batch_size ({tb}) must equal train_micro_batch_size_per_gpu ({mb}) x "
                f"gradient_accumulation_steps ({gas}) x data-parallel size ({dp}) = {mb * gas * dp}"
            )
    elif tb is not None and mb is not None:
        if tb % (mb * dp):
            raise ConfigError(
                f"train_batch_size ({tb}) is not divisible by train_micro_batch_size_per_gpu ({mb}) x "
                f"data-parallel size ({dp}); pick sizes so that the accumulation steps are a whole number"
            )
        gas = tb // (mb * dp)
    elif tb is not None and gas is not None:
        if tb % (gas * dp):
            raise ConfigError(
                f"train_batch_size ({tb}) is not divisible by gradient_accumulation_steps ({gas}) x "
                f"data-parallel size ({dp}) {where}"
            )
        mb = tb // (gas * dp)
    elif tb is not None:
        gas = 1
        if tb % dp:
            raise ConfigError(f"train_batch_size ({tb}) is not divisible by the data-parallel size ({dp})")
        mb = tb // dp
    else:
        mb = mb or 1
        gas = gas or 1
        tb = mb * gas * dp
    assert tb is not None and mb is not None and gas is not None
    return tb, mb, gas
