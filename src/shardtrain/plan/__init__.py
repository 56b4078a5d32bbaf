"""The plan: what a config decides, as typed plain data, resolved once and without a process group.

:class:`~shardtrain.plan.dims.ParallelDims` holds the parallel dimensions and refuses impossible layouts;
:mod:`.policies` holds the policies the core packages take instead of the config (what ZeRO shards, precision,
offload, prefetch, graph mode). :func:`shardtrain.config.plan.resolve_plan` builds a :class:`Plan` from a config;
``initialize``, ``shardtrain config check`` and ``shardtrain estimate`` all build it that way."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardtrain.plan.dims import ParallelDims
from shardtrain.plan.policies import (
    ActivationPolicy,
    Float8Policy,
    GraphPolicy,
    OffloadPolicy,
    PipelinePolicy,
    PrecisionPolicy,
    PrefetchPolicy,
    TilingPolicy,
    ZeroPolicy,
)


@dataclass(frozen=True)
class Plan:
    """Everything a config decides about how the engine is built, as plain data."""

    dims: ParallelDims
    zero: ZeroPolicy
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    prefetch: PrefetchPolicy = field(default_factory=PrefetchPolicy)
    graph: GraphPolicy = field(default_factory=GraphPolicy)
    pipeline: PipelinePolicy = field(default_factory=PipelinePolicy)
    tiling: TilingPolicy = field(default_factory=TilingPolicy)
    activations: ActivationPolicy = field(default_factory=ActivationPolicy)
    fp8: Float8Policy = field(default_factory=Float8Policy)
    device: str | None = None
    """``"cpu"``, ``"cuda"``, or None: ``SHARDTRAIN_DEVICE``, then CUDA when available ([Note: choosing the device])."""
    timeout_s: float = 1800.0
    """How long a collective may wait before it fails with a named error (``collective_timeout_s``)."""


__all__ = ["Plan"]
