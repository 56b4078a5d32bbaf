"""The policies the core packages take instead of the config: plain frozen data, built by
:func:`shardtrain.config.plan.resolve_plan` (as FSDP2's core takes a ``MixedPrecisionPolicy`` and an
``OffloadPolicy``). Each says what its package does; none knows a config key.

:class:`ZeroPolicy`: what ZeRO shards, as a frozen policy instead of a stage number compared in many places.

=====  ==========================  =================  ===================
stage  optimizer state (+ masters)  gradients          parameters
=====  ==========================  =================  ===================
0      replicated                  all-reduced        replicated
1      sharded                     reduce-scattered   replicated
2      sharded                     sharded (staged)   replicated
3      sharded                     sharded (staged)   sharded in units
=====  ==========================  =================  ===================

Each stage shards everything the previous one does; :meth:`ZeroPolicy.for_stage` is where a stage number is
turned into behaviour for the ZeRO components (layout, reducer, optimizer wrapper, units, checkpoint code), which
read the policy's fields. The stage number itself remains in user-facing places: the config, error messages,
``check_optimizer`` (stages 1-3 step fragments) and Hugging Face helpers that mirror DeepSpeed's ``stage == 3``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass(frozen=True)
class ZeroPolicy:
    stage: int
    shard_optimizer_state: bool
    """Each data-parallel rank steps only its fragment of every parameter (moments and masters sharded)."""
    shard_gradients: bool
    """Gradients are reduce-scattered bucket by bucket during backward; no full gradient buffer survives."""
    shard_parameters: bool
    """Parameters live as shards of units, gathered just in time for forward and backward."""
    reduce_bucket_size: int = 500_000_000
    """Elements per gradient bucket; also the unit parameters are laid out (and all-gathered) in."""
    allgather_bucket_size: int = 500_000_000
    """At most this many elements of parameter all-gathers in flight at once after a step."""
    overlap_comm: bool = True
    """Launch each bucket's reduction as soon as its gradients are ready during backward."""
    persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer elements stay whole on every rank."""
    unit_classes: tuple[str, ...] | None = None
    """Stage 3: module class names gathered and released as units (None: repeated blocks)."""
    gather_check: bool = True
    """Stage 3: ranks exchange unit ids before gathers until two passes of a kind gathered alike."""

    @staticmethod
    def for_stage(stage: int, **knobs: object) -> ZeroPolicy:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        return ZeroPolicy(
            stage=stage,
            shard_optimizer_state=stage >= 1,
            shard_gradients=stage >= 2,
            shard_parameters=stage >= 3,
            **knobs,  # type: ignore[arg-type]
        )

    @property
    def gradient_reduction(self) -> str:
        """``all_reduce`` (whole gradients), ``reduce_scatter`` at the boundary into full buffers, or ``staged``."""
        if not self.shard_optimizer_state:
            return "all_reduce"
        return "staged" if self.shard_gradients else "reduce_scatter"


@dataclass(frozen=True)
class LossScalePolicy:
    """fp16's loss scaling, with DeepSpeed's meaning (:class:`shardtrain.precision.loss_scaler.LossScaler`)."""

    static_scale: float = 0.0
    """0: dynamic scaling; a positive value is a static scale."""
    initial_scale_power: int = 16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype computes, which reduces gradients, which the optimizer steps ([Note: mixed precision] in
    :mod:`shardtrain.precision.mixed`)."""

    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    accum_dtype: torch.dtype = torch.float32
    """What the gradients of compute-dtype parameters accumulate in over micro-steps: the compute dtype (DeepSpeed's
    default) or fp32 (exact). Gradients of fp32 and fp64 parameters accumulate in their own dtype."""
    loss_scale: LossScalePolicy | None = None
    """fp16 only: how the loss is scaled (None: not scaled)."""
    cast_inputs: bool = False
    """fp16's ``auto_cast``: floating positional inputs of ``forward`` cast to fp16."""
    skip_nonfinite: bool = False
    """Without a loss scale (bf16): skip a step whose global gradient norm is inf or NaN, as DeepSpeed's
    ``bf16.check_grad_overflow`` does (fp16's scaler always skips one)."""

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.master_dtype

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of ``dtype`` parameters are accumulated in (see ``accum_dtype``)."""
        return self.accum_dtype if dtype in (torch.bfloat16, torch.float16) else dtype

    def casts(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a parameter or buffer) is cast to the compute dtype: fp32 floating tensors only."""
        return self.mixed and t.dtype == torch.float32


@dataclass(frozen=True)
class _OffloadTarget:
    device: str = "none"
    """``none`` (where it is used), ``cpu`` (host memory) or ``nvme`` (swap files in ``nvme_path``)."""
    nvme_path: str | None = None

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class ZenFlowPolicy:
    """Stall-free offload (DeepSpeed's ZenFlow, ``zero_optimization.zenflow``): the rule is [Note: the ZenFlow
    rule] in :mod:`shardtrain.offload.zenflow`."""

    topk_ratio: float = 0.1
    """Fraction of each 2-D weight's columns updated every step."""
    update_interval: int = 1
    """Steps between host updates of the other columns; 0: ``"auto"`` ([Note: update_interval "auto"] in
    :mod:`shardtrain.offload.zenflow`)."""
    select_interval: int = 0
    """Steps between reselections of the columns (a multiple of ``update_interval``); 0: selected once."""
    overlap_step: bool = False
    """The host update runs in a thread and lands ``update_interval`` steps later."""
    full_warm_up_rounds: int = 0
    """Steps of plain full updates first."""
    auto_ratio: float = 0.99
    """With ``update_interval`` 0: the fraction of 2-D parameters whose other columns must outweigh the selected
    ones for a host update."""


@dataclass(frozen=True)
class OptimizerOffloadPolicy(_OffloadTarget):
    """Where optimizer state (and fp32 masters) live between steps (``zero_optimization.offload_optimizer``)."""

    pin_memory: bool = False
    buffer_count: int = 4
    ratio: float = 1.0
    sub_group_size: int = 1_000_000_000
    """The optimizer steps this rank's fragments in sub-groups of about this many elements."""
    zenflow: ZenFlowPolicy | None = None
    """Stall-free offload (``zero_optimization.zenflow``); None: every step updates every element on the host."""


@dataclass(frozen=True)
class ParamOffloadPolicy(_OffloadTarget):
    """Where stage 3's parameter shards live between gathers (``zero_optimization.offload_param``)."""

    buffer_count: int = 5
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = False
    """Host shards page-locked (on CUDA: their uploads overlap compute only from page-locked memory)."""


@dataclass(frozen=True)
class OffloadPolicy:
    optimizer: OptimizerOffloadPolicy = field(default_factory=OptimizerOffloadPolicy)
    param: ParamOffloadPolicy = field(default_factory=ParamOffloadPolicy)


@dataclass(frozen=True)
class PrefetchPolicy:
    """How far ahead ZeRO-3 gathers units: one unit ahead, within a budget of elements (0: no prefetch).

    The one rule that eager mode (:class:`shardtrain.runtime.eager.EagerRuntime`), graph mode's schedule
    (:func:`shardtrain.graph.sharded.schedule_graph`) and the memory planner (:mod:`shardtrain.estimate.compute`)
    follow: the next distinct unit of the recorded order is gathered while the current one computes if its buffer
    has at most ``budget`` elements. One unit ahead keeps at most the current and the prefetched unit whole (plus
    the root unit), and is enough to hide a gather behind one unit's compute."""

    budget: int = 50_000_000
    """Elements of upcoming units gathered ahead of use (``stage3_prefetch_bucket_size``)."""

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def ahead(self, numel: int) -> bool:
        """Whether a unit of ``numel`` elements is gathered one unit ahead of its use."""
        return self.enabled and numel <= self.budget


NO_PREFETCH = PrefetchPolicy(budget=0)
"""Each unit gathered right before its use (a model only run forward, a test of the gathers alone)."""


@dataclass(frozen=True)
class PipelinePolicy:
    """Pipeline parallelism's schedule (``pipeline``); its size is ``ParallelDims.pp``."""

    schedule: str = "1F1B"
    """A name ``torch.distributed.pipelining.schedules.get_schedule_class`` accepts."""
    stages_per_rank: int = 1
    """Stages each pipeline rank holds: the model is cut into ``pp * stages_per_rank`` stages."""
    checkpoint_interval: int = 0
    """DeepSpeed's ``pipeline.activation_checkpoint_interval``: layers checkpointed in runs of this many (0: none)."""


@dataclass(frozen=True)
class GraphPolicy:
    """Graph mode (``graph``): capture the forward and backward per input schema (docs/graph-mode.md)."""

    enabled: bool = False
    strict: bool = False
    cache_size: int = 8
    compiler: str = "aot_eager"
    dynamic_shapes: bool = True


@dataclass(frozen=True)
class TilingPolicy:
    """ALST's tiled logits loss and MLP (``tiled_logits_loss``, ``tiled_mlp_compute`` and their shards)."""

    logits_loss: bool = False
    logits_loss_shards: int | None = None
    mlp: bool = False
    mlp_shards: int | None = None


@dataclass(frozen=True)
class Float8Policy:
    """FP8 training (``fp8``): which linear layers torchao converts, and how they scale (docs/fp8.md)."""

    enabled: bool = False
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao's recipe name (``Float8LinearConfig.from_recipe_name``)."""
    emulate: bool = False
    """Matmuls on dequantized values (devices without fp8 matmuls; the numerics of the casts are the same)."""
    exclude: tuple[str, ...] = ()
    """``fnmatch`` patterns of module names kept in high precision, besides the output head and the layers whose
    sizes the fp8 kernels cannot take."""
    gather_in_float8: bool = True
    """ZeRO-3 with the tensorwise recipe: forward and backward gather the converted weights in float8."""


BlockRecompute = Literal["none", "full", "selective"]
"""What one block recomputes in backward (:class:`ActivationPolicy`)."""


@dataclass(frozen=True)
class ActivationPolicy:
    """Activation checkpointing (``activation_checkpointing``): which activations of each block are recomputed in
    backward instead of kept, and where the kept block inputs wait (docs/activation-checkpointing.md). The blocks
    are the modules ZeRO-3 makes units of (``ZeroPolicy.unit_classes``, else repeated blocks), at every stage."""

    recompute: Literal["none", "full", "selective", "budget"] = "none"
    """``none``: everything a block saves is kept; ``full``: a block keeps only its inputs and runs its forward
    again in backward; ``selective``: it also keeps the outputs of matmuls and attention, and recomputes the rest
    (pointwise operations, norms); ``budget``: each block as :attr:`per_block` says, chosen at ``initialize`` by the
    planner so that the predicted peak fits :attr:`memory_budget` ([Note: checkpointing by budget] in
    ``estimate/activation_budget.py``)."""
    offload_inputs: bool = False
    """The inputs a checkpointed block keeps wait in host memory between forward and backward (DeepSpeed's
    ``cpu_checkpointing``)."""
    partition_inputs: bool = False
    """Under tensor parallelism each rank keeps ``1/tp`` of the inputs a checkpointed block keeps, all-gathered
    before the recompute (DeepSpeed's ``partition_activations``; nothing to partition at tp 1)."""
    memory_budget: int | None = None
    """``budget``: the bytes one rank's predicted peak must fit (device memory; on a machine without accelerator
    the process's)."""
    budget_seq_len: int | None = None
    """``budget``: the tokens per sequence the budget is planned for (the planner runs one micro-batch of it)."""
    per_block: tuple[BlockRecompute, ...] = ()
    """``budget``, once chosen: the recompute of each checkpointed block, in the order of the blocks; empty before."""

    @property
    def enabled(self) -> bool:
        return self.recompute != "none"

    def block_choices(self, blocks: int) -> tuple[BlockRecompute, ...]:
        """The recompute of each of ``blocks`` blocks: :attr:`per_block` for ``budget`` (it must be chosen by then),
        else :attr:`recompute` for every block."""
        if self.recompute != "budget":
            return (self.recompute,) * blocks
        if len(self.per_block) != blocks:
            raise ValueError(
                f"the budget's choice covers {len(self.per_block)} blocks, the model has {blocks}: choose it for "
                "this model (shardtrain.estimate.choose_checkpointing)"
            )
        return self.per_block
