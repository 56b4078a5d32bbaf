"""Activation checkpointing chosen by memory: ``policy: "budget"`` (:func:`choose_checkpointing`, which ``initialize``
runs) and the setting that makes a layout fit (:func:`fitting_checkpointing`, ``shardtrain estimate``'s advice).

[Note: checkpointing by budget]
The choices are a ladder, in order of more recompute and less memory kept, as torchtitan and Megatron count
checkpointed blocks: nothing; the first k blocks selective (k = 1..n), the rest none; every block selective and the
first k of them full (k = 1..n). Selective recomputes pointwise operations only, so every selective step is cheaper
than any full one. Each rung is measured, not interpolated: the same fake-tensor run ``shardtrain estimate`` makes,
with the checkpointing the engine applies (:func:`shardtrain.activations.apply_checkpointing` on the same blocks),
and the peak compared is the estimate's (model state and buffers included: device memory, on a machine without
accelerator the process's). The lowest rung that fits is chosen, found by bisection (the peak falls along the
ladder); only a measured rung is ever chosen, so the predicted peak of the choice is at most the budget. Every rank
measures the same fake run and so chooses the same blocks, without communicating. When no rung fits, the last one's
peak (every block full) is the smallest reachable without offload, and the error says it, and, when
``cpu_checkpointing`` is off, what it would reach.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from shardtrain.config.plan import resolve_plan
from shardtrain.config.sections import load_config
from shardtrain.errors import ConfigError
from shardtrain.estimate.compute import checkpointed_blocks
from shardtrain.estimate.planner import (
    Candidate,
    MemoryEstimate,
    _estimate,
    describe_blocks,
    fmt_bytes,
    layout_from_config,
    read_config,
)
from shardtrain.estimate.source import ModelSource, resolve_source
from shardtrain.plan.policies import BlockRecompute


def budget_ladder(blocks: int) -> list[tuple[BlockRecompute, ...]]:
    """The rungs of [Note: checkpointing by budget], least recompute first."""
    rungs: list[tuple[BlockRecompute, ...]] = [("none",) * blocks]
    rungs += [("selective",) * k + ("none",) * (blocks - k) for k in range(1, blocks + 1)]
    rungs += [("full",) * k + ("selective",) * (blocks - k) for k in range(1, blocks + 1)]
    return rungs


def predicted_peak(est: MemoryEstimate) -> int:
    """The peak a budget is compared with: device memory, or on a machine without accelerator the process's."""
    return est.peak["device"] if est.device_type == "cuda" else est.memory_peak


@dataclass(frozen=True)
class CheckpointingChoice:
    """A rung of the ladder and its estimate."""

    per_block: tuple[BlockRecompute, ...]
    offload_inputs: bool
    peak: int
    """Predicted peak (:func:`predicted_peak`)."""
    host_bytes: int
    """Host memory of the checkpointed blocks' inputs (``cpu_checkpointing``; 0 without)."""
    estimate: MemoryEstimate

    @property
    def setting(self) -> str:
        """The config's words for it: a policy when every block has the same recompute, else ``budget``."""
        kinds = set(self.per_block)
        policy = kinds.pop() if len(kinds) == 1 else "budget"
        return policy + (", cpu_checkpointing" if self.offload_inputs and policy != "none" else "")

    def describe(self) -> str:
        return f"{self.setting} ({describe_blocks(self.per_block)}): predicted peak {fmt_bytes(self.peak)}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "setting": self.setting,
            "per_block": list(self.per_block),
            "cpu_checkpointing": self.offload_inputs,
            "peak": self.peak,
            "host_bytes": self.host_bytes,
        }


class _Ladder:
    """Measures rungs of one model and layout, each once (the fake models shared through one cache)."""

    def __init__(
        self,
        source: ModelSource,
        raw: Mapping[str, Any],
        layout: Candidate,
        device_type: str,
        tp_plan: Any,
        optimizer: str | None,
    ) -> None:
        self.source, self.raw, self.layout, self.device_type = source, raw, layout, device_type
        self.tp_plan, self.optimizer = tp_plan, optimizer
        self.cache: dict = {"fast": True}
        self.measured: dict[tuple, CheckpointingChoice] = {}

    def measure(self, per_block: tuple[BlockRecompute, ...], offload: bool) -> CheckpointingChoice:
        key = (per_block, offload)
        if key not in self.measured:
            layout = replace(self.layout, checkpointing=per_block, offload_activations=offload)
            est = _estimate(self.source, self.raw, layout, self.optimizer, self.device_type, self.tp_plan, self.cache)
            host = est.compute.host_activations if est.compute is not None else 0
            self.measured[key] = CheckpointingChoice(per_block, offload, predicted_peak(est), host, est)
        return self.measured[key]

    def lowest_fitting(self, rungs: list[tuple[BlockRecompute, ...]], budget: int, offload: bool):
        """The first rung whose peak is at most ``budget`` (bisection: the peak falls along the ladder), or None.
        The ends first: a loose budget needs one fake run, an impossible one two."""
        if self.measure(rungs[0], offload).peak <= budget:
            return self.measure(rungs[0], offload)
        if self.measure(rungs[-1], offload).peak > budget:
            return None
        lo, hi = 1, len(rungs) - 1  # rungs[hi] fits, rungs[lo - 1] does not
        while lo < hi:
            mid = (lo + hi) // 2
            if self.measure(rungs[mid], offload).peak <= budget:
                hi = mid
            else:
                lo = mid + 1
        return self.measure(rungs[hi], offload)


def _ladder_for(
    model: Any,
    config: Any,
    world_size: int,
    seq_len: int,
    device_type: str,
    tp_plan: Any,
    optimizer: str | None,
    layout: Candidate | None,
) -> tuple[_Ladder, list[tuple[BlockRecompute, ...]]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    source = resolve_source(model)
    raw = read_config(config)
    if layout is None:
        layout = layout_from_config(raw, world_size, seq_len)
    unit_classes = resolve_plan(load_config(raw), layout.world).zero.unit_classes
    with FakeTensorMode(allow_non_fake_inputs=True):
        blocks = len(checkpointed_blocks(source.build(), list(unit_classes) if unit_classes else None))
    if blocks == 0:
        raise ConfigError(
            f"activation checkpointing by budget: {source.name} has no repeated blocks to checkpoint (a ModuleList "
            "or Sequential of two or more modules of one class); name the block class with "
            "zero_optimization.stage3_unit_classes"
        )
    return _Ladder(source, raw, layout, device_type, tp_plan, optimizer), budget_ladder(blocks)


def choose_checkpointing(
    model: Any,
    config: Any,
    *,
    world_size: int,
    budget: int,
    seq_len: int,
    device_type: str,
    offload_inputs: bool = False,
    tp_plan: Any = None,
    optimizer: str | None = None,
) -> CheckpointingChoice:
    """The least recompute whose predicted peak fits ``budget`` bytes ([Note: checkpointing by budget]); a
    :class:`~shardtrain.errors.ConfigError` naming the smallest peak reachable, and the setting reaching it, when
    none fits. ``model``: what :func:`~shardtrain.estimate.estimate_memory` takes (a factory, a
    :class:`ModelSource`); ``config``: the run's config (its layout: stage, tp, sp, ep, dtype, micro-batch)."""
    ladder, rungs = _ladder_for(model, config, world_size, seq_len, device_type, tp_plan, optimizer, None)
    chosen = ladder.lowest_fitting(rungs, budget, offload_inputs)
    if chosen is not None:
        return chosen
    smallest = ladder.measure(rungs[-1], offload_inputs)
    hint = ""
    if not offload_inputs:
        offloaded = ladder.measure(rungs[-1], True)
        fits = "fits" if offloaded.peak <= budget else "does not fit either"
        hint = f"; with cpu_checkpointing: true it is {fmt_bytes(offloaded.peak)}, which {fits}"
    raise ConfigError(
        f"activation_checkpointing.memory_budget_gib {budget / 2**30:g} ({fmt_bytes(budget)}): no choice of "
        f"checkpointing fits: the smallest predicted peak is {fmt_bytes(smallest.peak)}, with every block full "
        f"(policy 'full'){hint}, at micro-batch {ladder.layout.micro_batch} x {seq_len} tokens; raise the budget, "
        "shorten budget_seq_len or the micro-batch, or shard more (ZeRO-3, more ranks)"
    )


def fitting_checkpointing(
    model: Any,
    config: Any,
    layout: Candidate,
    limit: int,
    *,
    device_type: str = "cuda",
    tp_plan: Any = None,
    optimizer: str | None = None,
) -> CheckpointingChoice | None:
    """The cheapest activation setting with which ``layout`` fits ``limit`` bytes: the lowest rung of [Note:
    checkpointing by budget] that fits, keeping the block inputs on the device; else the lowest with them in host
    memory (``cpu_checkpointing``: copies instead of recompute, bounded by the host link). None: nothing fits."""
    ladder, rungs = _ladder_for(model, config, layout.world, layout.seq_len, device_type, tp_plan, optimizer, layout)
    return ladder.lowest_fitting(rungs, limit, False) or ladder.lowest_fitting(rungs, limit, True)


def source_of_module(module: nn.Module) -> ModelSource:
    """A :class:`ModelSource` of a built model: each fake model is a copy of it on fake tensors (shapes and dtypes
    kept, no storage). What ``initialize`` plans with; the model's parameters must be whole (not yet sharded)."""
    import copy

    from torch._guards import active_fake_mode
    from torch._subclasses.fake_tensor import FakeCopyMode

    def build() -> nn.Module:
        mode = active_fake_mode()
        assert mode is not None, "the planner builds models inside its FakeTensorMode"
        try:
            with FakeCopyMode(mode):
                fake = copy.deepcopy(module)
            # the planner's batches are CPU tensors, as its own fake models are: a model already on its device too
            # (``.data``, as build_fake casts: fake parameters cannot be swapped)
            with torch.no_grad():
                for p in fake.parameters():
                    if p.device.type != "cpu":
                        p.data = p.data.to("cpu")
                for m in fake.modules():
                    for name, buf in m._buffers.items():
                        if buf is not None and buf.device.type != "cpu":
                            m._buffers[name] = buf.to("cpu")
            return fake
        except Exception as err:  # an attribute deepcopy cannot copy: said by name, not as its traceback
            raise ConfigError(
                f"activation checkpointing by budget plans on a copy of {type(module).__name__} on fake tensors, "
                f"and copying it failed ({type(err).__name__}: {err}); use policy 'selective' or 'full' "
                "(`shardtrain estimate --memory-limit` with a factory of the model says which fits)"
            ) from err

    return ModelSource(build=build, name=type(module).__name__)
