"""``estimate_memory``: one layout's bytes per rank; ``fitting_layouts``: the layouts that fit a budget.

A layout is what a config decides about memory: world size, ZeRO stage, tensor-parallel size, the ZeRO shard group
(hybrid sharding: ``zero_optimization.mics_shard_size``), ZeRO++ hpZ's group (``zero_hpz_partition_size``: the
secondary shards, a transient of forward and backward), the expert-parallel size (``expert_parallel_size``: the
experts a rank holds, [Note: experts on fake tensors] in :mod:`.experts`), the sequence-parallel size
(``sequence_parallel_size``: the slice of each sequence a rank holds, [Note: sequence parallelism on fake tensors] in
:mod:`.sequence`), the context-parallel size (``context_parallel_size``: ``1/cp`` of every sequence, the ring's keys
and values and bytes), the pipeline-parallel size (``pipeline_parallel_size``: a pipeline rank's stages, its
micro-batches in flight, the schedule's bubble, [Note: pipeline stages in the estimate] in :mod:`.axes`), fp8 (the
float8 gathers of ZeRO-3), optimizer and parameter offload, compute dtype, micro-batch, sequence length and
activation checkpointing. Model state comes from the engine's layout code
(:mod:`.state`), activations and temporaries from a fake-tensor run (:mod:`.compute`). A rank's peak is::

    model state in memory + buffers + offload buffers
      + max(forward/backward peak above the state + stage-3 gathered units, optimizer-step temporaries)

Rank 0 is reported: every ZeRO shard but the last rank's holds ``padded / N`` elements, the last rank also holds the
padding, so rank 0 holds the most optimizer state (padding is never stepped) and the same of everything else.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from shardtrain.config.plan import refuse_on_device, resolve_plan
from shardtrain.config.sections import Config, load_config
from shardtrain.errors import ConfigError, LayoutError, ShardtrainError
from shardtrain.estimate.axes import (
    attention_shape,
    bubble_fraction,
    in_flight,
    layer_list,
    pipeline_buffers,
    ring_bytes,
    ring_keys_values,
    stage_ids,
)
from shardtrain.estimate.cluster import Cluster
from shardtrain.estimate.compute import (
    BlockCheckpointing,
    ComputePeak,
    build_fake,
    measure_compute,
    model_key,
    prepare_models,
)
from shardtrain.estimate.experts import expert_counts, split_experts
from shardtrain.estimate.sequence import install_sequence_parallel
from shardtrain.estimate.source import ModelSource, resolve_source
from shardtrain.estimate.state import RankState, UnitSize, rank_state
from shardtrain.estimate.timing import MicroBatchWork, StepInputs, TimeEstimate, measure_work, step_time, zero_traffic
from shardtrain.optim.deepspeed_muon import is_deepspeed_muon_parameter
from shardtrain.pipeline_parallel.cut import check_can_split_sequence, cut_model
from shardtrain.pipeline_parallel.order import SPLIT_BACKWARD_SCHEDULES
from shardtrain.plan import Plan
from shardtrain.plan.dims import ParallelDims
from shardtrain.precision.float8 import output_heads, why_kept

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HYBRID_KEYS = ("mics_shard_size", "zero_hpz_partition_size")


@dataclass(frozen=True)
class Candidate:
    """One candidate parallel layout the planner weighs: what decides one rank's memory (a config's
    memory-relevant keys, and the batch shape). Its parallel sizes become the plan's
    :class:`~shardtrain.plan.dims.ParallelDims`; ``ShardLayout`` (:mod:`shardtrain.zero.layout`) is another thing,
    where each parameter's shard lives."""

    world: int
    stage: int = 0
    tp: int = 1
    shard_size: int | None = None
    """Ranks a ZeRO shard group spans (hybrid sharding); None: the whole data-parallel group."""
    hpz: int = 1
    """ZeRO++ hpZ's group size (stage 3): each rank holds its 1/hpz share of the units released after forward until
    their backward; 1: off."""
    ep: int = 1
    """Expert-parallel size (``expert_parallel_size``): each rank holds ``num_experts / ep`` experts of every MoE
    layer, their ZeRO shards over the ``zero / ep`` ranks holding the same experts; 1: off."""
    sp: int = 1
    """Sequence-parallel size (``sequence_parallel_size``, Ulysses): the ``sp`` ranks of a group are given the same
    sequences and each holds ``1/sp`` of their tokens; ZeRO shards over the ``dp * sp`` ranks ([Note: the sequence
    axis] in ``distributed/mesh.py``); 1: off."""
    cp: int = 1
    """Context-parallel size (``context_parallel_size``, ring attention): each rank holds ``1/cp`` of every
    sequence's tokens and, while a layer attends, the whole sequence's keys and values; ZeRO shards over
    ``dp * cp * sp``; 1: off."""
    pp: int = 1
    """Pipeline-parallel size (``pipeline_parallel_size``): each rank holds its stages' layers, laid out over the
    ``world / pp`` ranks of its stage ([Note: pipeline stages in the estimate] in :mod:`.axes`); 1: off."""
    pp_rank: int = 0
    """The pipeline rank reported (0: the first stage's, which holds the most activations under 1F1B)."""
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    micro_batches: int = 1
    """Micro-batches per step (``gradient_accumulation_steps``): the pipeline schedule's ``m``; the ring's bytes
    per step."""
    fp8: bool = False
    """FP8 training (``fp8.enabled``): at stage 3 with the tensorwise recipe the converted weights are gathered in
    float8, 1 byte per element."""
    offload_optimizer: str = "none"
    offload_param: str = "none"
    dtype: str = "fp32"
    micro_batch: int = 1
    seq_len: int = 2048
    checkpointing: bool | str | tuple[str, ...] = False
    """Activation checkpointing of every block: ``True`` (``policy: "full"``), ``"selective"`` (matmul and attention
    outputs kept, the rest recomputed), ``False`` (none); a tuple: each block's (``"none"``, ``"selective"``,
    ``"full"``, in the order of the blocks), as ``policy: "budget"`` chooses."""
    offload_activations: bool = False
    """``cpu_checkpointing``: the inputs the checkpointed blocks keep wait in host memory."""
    compile: bool = False
    """``torch.compile`` of the model: changes the predicted time only ([Note: what compile changes] in
    :mod:`.timing`), not the memory."""
    tp_style: str = "shardtrain"
    """How the tensor parallelism runs (``shardtrain``, ``sequence-parallel``, ``sequence-parallel-overlap``): the
    time only, for layouts of other stacks ([Note: how a stack runs its TP] in :mod:`.timing`)."""

    @property
    def dims(self) -> ParallelDims:
        """The candidate's parallel dimensions (:class:`~shardtrain.errors.LayoutError` for sizes that do not fit)."""
        hpz = self.hpz if self.stage == 3 else 1
        return ParallelDims(self.world, self.tp, self.sp, self.ep, self.shard_size or -1, hpz, self.pp, self.cp)

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def zero(self) -> int:
        return self.dims.zero

    @property
    def shard_group(self) -> int:
        return self.dims.shard

    def describe(self) -> str:
        parts = [f"world {self.world}", f"stage {self.stage}", f"tp {self.tp}"]
        if self.sp > 1:
            parts.append(f"sp {self.sp}")
        if self.cp > 1:
            parts.append(f"cp {self.cp}")
        if self.pp > 1:
            v = f" x {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
            parts.append(
                f"pp {self.pp}{v} ({self.schedule}, {self.micro_batches} micro-batches; pp rank {self.pp_rank})"
            )
        if self.shard_size and self.shard_size != self.zero:
            parts.append(f"shard {self.shard_size} x replicate {self.zero // self.shard_size}")
        if 1 < self.hpz < self.zero and self.stage == 3:
            parts.append(f"hpZ {self.hpz}")
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        if self.offload_optimizer != "none":
            parts.append(f"optimizer->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"params->{self.offload_param}")
        parts += [self.dtype + (" + fp8" if self.fp8 else ""), f"micro-batch {self.micro_batch} x seq {self.seq_len}"]
        if self.micro_batches > 1 and self.pp == 1:
            parts.append(f"{self.micro_batches} micro-batches")
        if isinstance(self.checkpointing, tuple):
            parts.append(f"checkpointing by block ({describe_blocks(self.checkpointing)})")
        elif self.checkpointing:
            parts.append("selective checkpointing" if self.checkpointing == "selective" else "checkpointing")
        per_block = self.checkpointing if isinstance(self.checkpointing, tuple) else (self.checkpointing,)
        if self.offload_activations and any(ac and ac != "none" for ac in per_block):
            parts.append("checkpoints in host memory")
        if self.compile:
            parts.append("compiled")
        return ", ".join(parts)


def describe_blocks(per_block: tuple[str, ...]) -> str:
    """Each block's recompute in runs of blocks, e.g. ``0-1 full, 2-3 selective``."""
    runs: list[list] = []
    for i, what in enumerate(per_block):
        if runs and runs[-1][2] == what:
            runs[-1][1] = i
        else:
            runs.append([i, i, what])
    return ", ".join(f"{a}{f'-{b}' if b > a else ''} {what}" for a, b, what in runs)


def run_checkpointing(layout: Candidate) -> bool | str | BlockCheckpointing:
    """What the fake run applies: the blocks' recompute as the engine applies it where it is per block or its inputs
    go to host memory, else the whole-model setting of before."""
    ac = layout.checkpointing
    if not isinstance(ac, tuple) and not (layout.offload_activations and ac):
        return ac
    if not isinstance(ac, tuple):
        return BlockCheckpointing("full" if ac is True else "selective", layout.offload_activations)
    return BlockCheckpointing(ac, layout.offload_activations)


def with_global_batch(layout: Candidate, global_batch: int) -> Candidate:
    """``layout`` with the micro-batches per step that make ``micro_batch x micro_batches x dp`` equal
    ``global_batch`` (:class:`~shardtrain.errors.ConfigError` where no whole number does)."""
    per_micro = layout.micro_batch * layout.dp
    if global_batch % per_micro:
        raise ConfigError(
            f"global batch {global_batch} is not a multiple of micro-batch {layout.micro_batch} x data-parallel "
            f"size {layout.dp} = {per_micro} sequences: pick a global batch, micro-batch or world that divides"
        )
    return replace(layout, micro_batches=global_batch // per_micro)


@dataclass(frozen=True)
class Row:
    component: str
    where: str  # device, host or nvme
    nbytes: int
    transient: bool = False
    note: str = ""
    """``step``: alive during the optimizer step only; ``in``: already part of the forward/backward peak row."""


@dataclass
class MemoryEstimate:
    """One rank's memory in one layout (rank 0: see the module docstring)."""

    model: str
    layout: Candidate
    parameters: int
    """Distinct parameters of the whole model (a tied weight counts once), before any split."""
    device_type: str
    rows: list[Row] = field(default_factory=list)
    state: RankState | None = None
    compute: ComputePeak | None = None
    traffic: dict[str, int] = field(default_factory=dict)
    """Bytes this rank sends per step, by what sends them (the ring, the float8 gathers); printed below the rows."""
    bubble: float | None = None
    """The pipeline schedule's idle fraction ([Note: pipeline stages in the estimate] in estimate/axes.py); None
    without pipelining or not modelled."""
    time: TimeEstimate | None = None
    """The predicted step on a cluster (``cluster=`` given; :mod:`.timing`)."""

    def total(self, where: str, transient: bool = True) -> int:
        return sum(r.nbytes for r in self.rows if r.where == where and (transient or not r.transient))

    @property
    def peak(self) -> dict[str, int]:
        """Peak bytes per place: permanent rows plus the largest transient phase (rows are not all alive at once:
        the peak is the state plus the larger of the forward/backward and the optimizer-step transients)."""
        out = {}
        for where in ("device", "host", "nvme"):
            permanent = self.total(where, transient=False)
            fwd_bwd = sum(r.nbytes for r in self.rows if r.where == where and r.transient and not r.note)
            step = sum(r.nbytes for r in self.rows if r.where == where and r.transient and r.note == "step")
            out[where] = permanent + max(fwd_bwd, step)
        return out

    @property
    def memory_peak(self) -> int:
        """Device and host bytes together (on a machine without accelerator both are the process's memory)."""
        return self.peak["device"] + self.peak["host"]

    def model_state(self) -> dict[str, int]:
        """In-memory parameter, gradient and optimizer bytes, as :meth:`Engine.state_bytes` counts them."""
        assert self.state is not None
        st = self.state
        opt = sum(v for k, v in st.optimizer.items() if k not in ("nvme", "offload_buffers"))
        return {"params": st.params.get("device", 0), "grads": st.grads["device"], "optimizer": opt}

    def format(self) -> str:
        lay = self.layout
        lines = [
            f"model: {self.model}, {self.parameters / 1e6:,.2f}M parameters",
            f"layout: {lay.describe()}",
            f"per rank (rank 0 of {lay.world // lay.pp}"
            + (f" on pipeline rank {lay.pp_rank} of {lay.pp}" if lay.pp > 1 else "")
            + f"; dp {lay.dp}"
            + (f" x cp {lay.cp}" if lay.cp > 1 else "")
            + (f" x sp {lay.sp}" if lay.sp > 1 else "")
            + f", ZeRO shard group {lay.shard_group}):",
            f"  {'component':<66} {'where':<7} {'bytes':>14}",
        ]
        for r in self.rows:
            if r.nbytes or (r.where != "nvme" and not r.transient):
                tag = " (included below)" if r.note == "in" else " (transient)" if r.transient else ""
                lines.append(f"  {r.component + tag:<66} {r.where:<7} {fmt_bytes(r.nbytes):>14}")
        peak = self.peak
        lines.append(
            f"  peak: device {fmt_bytes(peak['device'])}, host {fmt_bytes(peak['host'])}, "
            f"nvme {fmt_bytes(peak['nvme'])}"
        )
        for what, nbytes in self.traffic.items():
            lines.append(f"  sent per step: {what}: {fmt_bytes(nbytes)}")
        if lay.pp > 1:
            v, p, m = lay.stages_per_rank, lay.pp, lay.micro_batches
            formula = f"(p-1)/({'v*' if v > 1 else ''}m+p-1) = {p - 1}/({f'{v}*' if v > 1 else ''}{m}+{p - 1})"
            if lay.schedule in SPLIT_BACKWARD_SCHEDULES:  # [Note: a schedule's bubble from its own actions]
                formula = "idle slots of torch's action lists, forward = input pass = weight pass"
            told = f"{self.bubble:.4f}, {formula}" if self.bubble is not None else "not modelled for this schedule"
            lines.append(f"  pipeline bubble ({lay.schedule}, p {p}, m {m}): {told}")
        if self.time is not None:
            lines.append(self.time.format())
        return "\n".join(lines)


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def parse_bytes(text: str) -> int:
    """``16GiB``, ``16GB`` (10^9), ``512MiB``, ``1.5e9`` -> bytes."""
    s = text.strip().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    units |= {"tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "b": 1}
    for suffix in sorted(units, key=len, reverse=True):
        if s.lower().endswith(suffix):
            number, scale = s[: -len(suffix)], units[suffix]
            break
    else:
        number, scale = s, 1
    try:
        value = float(number)
    except ValueError:
        raise ShardtrainError(f"budget {text!r} is not a size; write e.g. 16GiB, 80GB or 512MiB") from None
    if value <= 0:
        raise ShardtrainError(f"budget {text!r} must be positive")
    return int(value * scale)


# -- configs -------------------------------------------------------------------------------------------


def read_config(config: Config | Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    """A config as a plain dict (a file read as JSON or YAML)."""
    if config is None:
        return {}
    if isinstance(config, Config):
        return config.model_dump(exclude_unset=True)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top")
    return data


def layout_config(raw: Mapping[str, Any], layout: Candidate) -> Config:
    """``raw`` with the layout's keys written in, validated as ``initialize`` would."""
    data = copy.deepcopy(dict(raw))
    zero = dict(data.get("zero_optimization") or {})
    for key in HYBRID_KEYS:
        zero.pop(key, None)
    if layout.shard_size is not None:
        zero["mics_shard_size"] = layout.shard_size
    if layout.hpz > 1:
        zero["zero_hpz_partition_size"] = layout.hpz
    zero["stage"] = layout.stage
    for section, device in (("offload_optimizer", layout.offload_optimizer), ("offload_param", layout.offload_param)):
        sub = dict(zero.get(section) or {})
        sub["device"] = device
        if device == "nvme" and not sub.get("nvme_path"):
            sub["nvme_path"] = "/nvme"  # never written: the planner only needs to know the state is in files
        zero[section] = sub
    data["zero_optimization"] = zero
    tp = dict(data.get("tensor_parallel") or {})
    tp.pop("autotp_size", None)
    tp["size"] = layout.tp
    data["tensor_parallel"] = tp
    data["bf16"] = {**dict(data.get("bf16") or {}), "enabled": layout.dtype == "bf16"}
    data["fp16"] = {**dict(data.get("fp16") or {}), "enabled": layout.dtype == "fp16"}
    data["expert_parallel_size"] = layout.ep
    data["sequence_parallel_size"] = layout.sp
    data["context_parallel_size"] = layout.cp
    data["pipeline_parallel_size"] = layout.pp
    pipeline = dict(data.get("pipeline") or {})
    pipeline.update(schedule=layout.schedule, stages_per_rank=layout.stages_per_rank)
    data["pipeline"] = pipeline
    data["fp8"] = {**dict(data.get("fp8") or {}), "enabled": layout.fp8}
    data["train_micro_batch_size_per_gpu"] = layout.micro_batch
    data.pop("train_batch_size", None)
    data["gradient_accumulation_steps"] = layout.micro_batches
    return load_config(data)


def layout_from_config(
    raw: Mapping[str, Any], world: int, seq_len: int, checkpointing: bool | str = False
) -> Candidate:
    """The layout a DeepSpeed-style config describes at ``world`` ranks; its ``activation_checkpointing.policy``
    turns checkpointing on as ``initialize`` would (``checkpointing``, the CLI's flag, asks for ``full``)."""
    zero = raw.get("zero_optimization") or {}
    tpc = raw.get("tensor_parallel") or {}
    tp = tpc.get("size") or tpc.get("autotp_size") or 1
    sp = raw.get("sequence_parallel_size")
    sp = int(sp) if isinstance(sp, int) and sp > 1 else 1
    cp, pp = (raw.get(key) for key in ("context_parallel_size", "pipeline_parallel_size"))
    cp, pp = (int(n) if isinstance(n, int) and n > 1 else 1 for n in (cp, pp))
    pipeline = raw.get("pipeline") or {}
    dtype = "bf16" if (raw.get("bf16") or {}).get("enabled") is True else "fp32"
    dtype = "fp16" if (raw.get("fp16") or {}).get("enabled") is True else dtype
    micro = raw.get("train_micro_batch_size_per_gpu")
    if not isinstance(micro, int):  # DeepSpeed's rule: the other two determine it; none gives 1
        tb, gas = raw.get("train_batch_size"), raw.get("gradient_accumulation_steps") or 1
        dp = max(world // (int(tp) * sp * cp * pp), 1)  # the data-parallel size, as initialize lays it out
        micro = tb // (gas * dp) if isinstance(tb, int) and isinstance(gas, int) and tb >= gas * dp else 1
    shard = zero.get("mics_shard_size")
    hpz = zero.get("zero_hpz_partition_size")
    ep = raw.get("expert_parallel_size")
    return Candidate(
        world=world,
        stage=int(zero.get("stage", 0)),
        tp=int(tp),
        shard_size=int(shard) if shard not in (None, -1, 0) else None,
        hpz=int(hpz) if isinstance(hpz, int) and hpz > 1 else 1,
        ep=int(ep) if isinstance(ep, int) and ep > 1 else 1,
        sp=sp,
        cp=cp,
        pp=pp,
        schedule=str(pipeline.get("schedule", "1F1B")),
        stages_per_rank=int(pipeline.get("stages_per_rank", 1)),
        micro_batches=_micro_batches(raw),
        fp8=(raw.get("fp8") or {}).get("enabled") is True,
        offload_optimizer=(zero.get("offload_optimizer") or {}).get("device") or "none",
        offload_param=(zero.get("offload_param") or {}).get("device") or "none",
        dtype=dtype,
        micro_batch=micro,
        seq_len=seq_len,
        checkpointing=_policy_checkpointing(raw) or checkpointing,
        offload_activations=(raw.get("activation_checkpointing") or {}).get("cpu_checkpointing") is True,
    )


def _micro_batches(raw: Mapping[str, Any]) -> int:
    """``gradient_accumulation_steps``, or what ``train_batch_size`` makes of it (1 when neither says)."""
    gas = raw.get("gradient_accumulation_steps")
    if isinstance(gas, int) and gas >= 1:
        return gas
    return 1


def _policy_checkpointing(raw: Mapping[str, Any]) -> bool | str:
    """What the config's ``activation_checkpointing.policy`` checkpoints, as :attr:`Candidate.checkpointing`."""
    policy = (raw.get("activation_checkpointing") or {}).get("policy", "none")
    return {"full": True, "selective": "selective"}.get(policy, False)


def _plan(layout: Candidate, cfg: Config, device_type: str) -> Plan:
    """The plan ``initialize`` builds for the layout, refusing what it refuses in its words (the parallel sizes and
    the combinations; the config's own validation ran in :func:`layout_config`), and what the planner does not
    plan."""
    if layout.world < 1:
        raise ConfigError(f"the world size must be at least 1, got {layout.world}")
    plan = resolve_plan(cfg, layout.world)
    if not 0 <= layout.pp_rank < plan.dims.pp:
        raise ConfigError(f"pp_rank {layout.pp_rank}: the pipeline ranks are 0 to {plan.dims.pp - 1}")
    if layout.dtype not in _DTYPES:
        raise ConfigError(f"dtype {layout.dtype!r}: use one of {', '.join(_DTYPES)}")
    if device_type is not None:  # what initialize refuses on such devices (parameter offload's companions on CUDA)
        refuse_on_device(cfg, device_type)
    return plan


# -- the estimate ----------------------------------------------------------------------------------------


def _optimizer_kind(cfg: Config, optimizer: str | None) -> tuple[int, bool]:
    """(element-wise state tensors per parameter, whether a per-parameter ``step`` tensor is kept)."""
    kind = (optimizer or (cfg.optimizer.type if cfg.optimizer else "adamw")).lower()
    if kind in ("adam", "adamw"):
        return 2, True
    if kind == "sgd":
        momentum = cfg.optimizer.params.get("momentum", 0) if cfg.optimizer and optimizer is None else 0
        return (1 if momentum else 0), False
    if kind in MUON_KINDS:  # its Adam half's; the Muon half is counted by _muon_of
        return 2, True
    if kind == "lamb":  # shardtrain.optim.lamb.Lamb: Adam's moments and step
        return 2, True
    raise ConfigError(
        f"optimizer {kind!r}: the planner knows Adam, AdamW, SGD, DeepSpeed's Muon ('muon'), shardtrain's "
        "MuonWithAdamW ('muon-adamw') and Lamb ('lamb')"
    )


MUON_KINDS = ("muon", "muon-adamw")
"""DeepSpeed's Muon config type, and :class:`~shardtrain.optim.muon.MuonWithAdamW` passed to ``initialize`` (planned
with DeepSpeed's selection: Muon for the 2-D and larger weights but embeddings and head, AdamW for the rest)."""


def _kind(cfg: Config, optimizer: str | None) -> str:
    return (optimizer or (cfg.optimizer.type if cfg.optimizer else "adamw")).lower()


def _muon_of(cfg: Config, optimizer: str | None):
    """The Muon parameters by name and shape ([Note: DeepSpeed's Muon is not torch's]), or None."""
    return is_deepspeed_muon_parameter if _kind(cfg, optimizer) in MUON_KINDS else None


def _refuse_unserved_offload(cfg: Config, optimizer: str | None, layout: Candidate, device_type: str) -> None:
    """What ``initialize`` refuses of an optimizer with a collective step under optimizer offload (zero/optimizer.py's
    ``ShardedOptimizer``), in the planner's words."""
    kind = _kind(cfg, optimizer)
    if kind not in (*MUON_KINDS, "lamb") or layout.offload_optimizer == "none" or layout.stage == 0:
        return
    if kind == "lamb" and (layout.tp > 1 or layout.ep > 1):  # Muon's offload is served with both
        raise ConfigError(
            f"optimizer {kind!r} with optimizer offload and tensor or expert parallelism is not served yet "
            "(docs/muon.md)"
        )


def lamb_sum_traffic(buckets: list, shard_group: int) -> dict[str, int]:
    """Bytes per optimizer step of LAMB's shard sums ([Note: LAMB's norms across shards] in optim/lamb.py): a
    (tensors x 2) fp32 matrix all-reduced per param group (the planner's one group), as the communicator counts a
    ring all-reduce; with offload once per sub-group (not counted here)."""
    if shard_group == 1:
        return {}
    tensors = sum(len(b.slots) for b in buckets if b.requires_grad)
    return {"LAMB's per-tensor squared sums (all-reduce, fp32)": 2 * 8 * tensors * (shard_group - 1) // shard_group}


def muon_owner_traffic(buckets: list, shard_group: int, muon) -> dict[str, int]:
    """Bytes per optimizer step of Muon's owners ([Note: one owner per matrix] in zero/muon_owners.py): every
    trainable bucket holding a Muon matrix is all-gathered and reduce-scattered once in fp32, as the engine's
    communicator counts them (the ring's (n - 1) / n of the bucket)."""
    if muon is None or shard_group == 1:
        return {}
    padded = [b.padded_numel for b in buckets if b.requires_grad and any(muon(s.name, s.shape) for s in b.slots)]
    moved = sum(4 * n * (shard_group - 1) // shard_group for n in padded)
    return {
        "Muon updates to their owners (all-gather, fp32)": moved,
        "orthogonalized Muon updates back (reduce-scatter, fp32)": moved,
    }


def estimate_memory(
    model: Any,
    config: Config | Mapping[str, Any] | str | Path | None = None,
    *,
    world_size: int | None = None,
    layout: Candidate | None = None,
    seq_len: int = 2048,
    checkpointing: bool | str = False,
    optimizer: str | None = None,
    device_type: str = "cuda",
    tp_plan: Any = None,
    activations: bool = True,
    fast: bool = True,
    progress: bool | None = False,
    cluster: Cluster | None = None,
    **overrides: Any,
) -> MemoryEstimate:
    """Bytes per rank of training ``model`` with ``config`` (see the module docstring).

    ``model``: a Hugging Face config path, ``"module:function"``, a zero-argument callable or a
    :class:`ModelSource`. ``config``: a DeepSpeed-style dict or file; ``layout`` (or the keyword ``overrides``,
    fields of :class:`Candidate`: ``stage``, ``tp``, ``shard_size``, ``offload_optimizer``, ``offload_param``,
    ``dtype``, ``micro_batch``) replaces what it says. ``device_type``: ``"cuda"`` plans for accelerators (optimizer
    offload to ``cpu`` moves state to the host), ``"cpu"`` for a machine without one (everything is host memory).
    ``activations=False``: model state only (no fake forward and backward), as DeepSpeed's estimators.
    ``tp_plan``: the tensor-parallel plan ``initialize`` would get (default: the factory module's ``tp_plan``, or a
    Hugging Face model's own). ``fast=False``: torch's ``MemTracker`` as it is (per-module peaks too; the same bytes,
    slower: the reference the fast path is tested against). ``progress``: a progress bar on stderr when the run takes
    more than :data:`PROGRESS_DELAY_S` (None: only on a terminal). ``cluster``: also predict the step's time on it
    (``est.time``, :mod:`.timing`).
    """
    source = resolve_source(model)
    raw = read_config(config)
    if layout is None:
        if world_size is None:
            raise ConfigError("estimate: give world_size (the number of ranks)")
        layout = layout_from_config(raw, world_size, seq_len, checkpointing)
    layout = replace(layout, **overrides) if overrides else layout
    cache: dict = {"fast": fast}
    with _bar(progress, 1, "estimate", "layout") as bar:
        cache["ticker"] = _ticker(bar)
        est = _estimate(source, raw, layout, optimizer, device_type, tp_plan, cache, activations, cluster)
    return est


@dataclass
class _Prepared:
    """One layout's model state and what its fake run needs (``key``: layouts with equal keys share one run)."""

    layout: Candidate
    state: RankState
    parameters: int
    buffers: int
    key: tuple
    run: dict[str, Any]
    """:func:`measure_compute`'s keyword arguments."""
    layer_share: float = 1.0
    """The share of the model's layers this rank's pipeline stages hold (1 without pipelining)."""
    shape: tuple[int, int, int] = (0, 0, 0)
    """(layers, key/value heads a rank attends with, head dimension), for the context-parallel rows."""
    hidden: int = 0
    """The model's hidden size (a pipeline boundary's activation per token), 0 when it says none."""
    step_traffic: dict[str, int] = field(default_factory=dict)
    """Bytes per optimizer step the optimizer's own collectives move (Muon's owners)."""
    owner_buffers: int = 0
    """Muon's owners' largest gathered bucket, its result and this rank's chunk (fp32), alive in the step."""
    float8_linears: frozenset[tuple[int, int]] = frozenset()
    """FP8 training: the converted linears' weight shapes (:func:`_float8_linear_shapes`)."""
    vocab: int = 0
    """The model's vocabulary size (the last pipeline stage's output per token), 0 when it says none."""


NO_COMPUTE = ComputePeak(0, 0, 0, 0, 0, 0)


def _estimate(
    source: ModelSource,
    raw: Mapping[str, Any],
    layout: Candidate,
    optimizer: str | None,
    device_type: str,
    tp_plan: Any,
    cache: dict,
    activations: bool = True,
    cluster: Cluster | None = None,
) -> MemoryEstimate:
    """One layout's estimate; ``cache`` keeps what layouts share (fake models per tensor-parallel size, the
    parameter count, fake runs whose inputs are the same) across the calls of one search, and says whether to run
    fast (``"fast"``: reuse fake models between runs, track the whole-process peak only) and where the fake run's
    progress goes (``"ticker"``)."""
    prep = _prepare(source, raw, layout, optimizer, device_type, tp_plan, cache)
    if not activations:
        comp = NO_COMPUTE
    elif ("compute", prep.key) in cache:
        comp = cache["compute", prep.key]
    else:
        comp = cache["compute", prep.key] = measure_compute(**prep.run, progress=cache.get("ticker"))
    est = _assemble(source, prep, comp, device_type, activations)
    if cluster is not None:
        est.time = time_prepared(prep, est, cluster, cache)
    return est


def time_prepared(prep: _Prepared, est: MemoryEstimate, cluster: Cluster, cache: dict) -> TimeEstimate:
    """The layout's predicted step on ``cluster`` (:mod:`.timing`): the work of one micro-batch from a fake run
    counted per operator (one per distinct model and batch, kept in ``cache``), ZeRO's traffic from the layout's
    buckets and units, the pipeline's bubble and the ring's bytes from the memory estimate."""
    layout, st, run = prep.layout, prep.state, prep.run
    work_key = ("work", *prep.key[:7], tuple(run["unit_classes"] or ()))
    if work_key not in cache:
        cache[work_key] = measure_work(**run)
    work: MicroBatchWork = cache[work_key]
    reduce = run["reduce_dtype"]
    wire_items = {b.index: reduce.itemsize for b in st.buckets} if reduce is not None else None
    traffic = zero_traffic(st, layout.stage, wire_items, replicas=layout.zero // layout.shard_group)
    trainable = [b for b in st.buckets if b.requires_grad]
    if layout.stage == 0:
        stepped = sum(b.numel for b in trainable)
        tensors = sum(len(b.slots) for b in trainable)
    else:
        stepped = sum(f.length for b in trainable for f in b.fragments)
        tensors = sum(len(b.fragments) for b in trainable)
    ring = sum(v for k, v in est.traffic.items() if k.startswith("context-parallel"))
    itemsize = _DTYPES[layout.dtype].itemsize
    inputs = StepInputs(
        world=layout.world,
        dp=layout.dp,
        micro_batch=layout.micro_batch,
        seq_len=layout.seq_len,
        micro_batches=layout.micro_batches,
        dtype=layout.dtype,
        fp8=layout.fp8,
        float8_linears=prep.float8_linears,
        compile=layout.compile,
        stage=layout.stage,
        tp=layout.tp,
        sp=layout.sp,
        cp=layout.cp,
        ep=layout.ep,
        pp=layout.pp,
        shard=layout.shard_group,
        stages_per_rank=layout.stages_per_rank,
        bubble=est.bubble,
        layer_share=prep.layer_share,
        stepped_elements=stepped,
        stepped_tensors=tensors,
        offload_optimizer=layout.offload_optimizer,
        nvme_bytes=_swap_bytes(st, layout.micro_batches),
        ring_bytes=ring,
        # a stage sends each rank's share of the sequence ([Note: a sequence split in a pipeline] in the engine)
        boundary_bytes=layout.micro_batch * (layout.seq_len // (layout.cp * layout.sp)) * prep.hidden * itemsize,
        tp_style=layout.tp_style,
        hidden=prep.hidden,
    )
    return step_time(work, traffic, inputs, cluster)


def _swap_bytes(st: RankState, micro_batches: int) -> int:
    """Bytes read and written on NVMe swap files per step ([Note: what overlaps] in :mod:`.timing`): the optimizer
    state's files read and written once, the parameter shards' read for each micro-batch's forward and backward and
    written after the step."""
    return 2 * st.optimizer.get("nvme", 0) + st.params.get("nvme", 0) * (2 * micro_batches + 1)


def _prepare(
    source: ModelSource,
    raw: Mapping[str, Any],
    layout: Candidate,
    optimizer: str | None,
    device_type: str,
    tp_plan: Any,
    cache: dict,
) -> _Prepared:
    """The layout's model state (from the engine's layout code) and the fake run it needs, not run yet."""
    cfg = layout_config(raw, layout)
    plan = _plan(layout, cfg, device_type)  # what initialize refuses, in its words (expert layouts included)
    zero, offload, precision = plan.zero, plan.offload, plan.precision
    compute = precision.compute_dtype
    moments, steps = _optimizer_kind(cfg, optimizer)
    muon = _muon_of(cfg, optimizer)
    _refuse_unserved_offload(cfg, optimizer, layout, device_type)
    collective = zero.shard_optimizer_state and (muon is not None or _kind(cfg, optimizer) == "lamb")
    # with sequence parallelism the model as initialize leaves it (Ulysses installed, refusing what it refuses): the
    # same parameters
    fake, experts = _fake_model(source, layout.tp, layout.ep, tp_plan, cache, layout.sp)
    whole = _fake_model(source, 1, 1, tp_plan, cache)[0]
    n_params = sum(p.numel() for p in whole.parameters())
    layer_share = 1.0
    if layout.pp > 1:  # [Note: pipeline stages in the estimate]
        fake, experts = _stage_model(source, layout, tp_plan, cache)
        layer_share = len(layer_list(fake)) / len(layer_list(whole))
    shape = attention_shape(whole) or (0, 0, 0)
    if layout.cp > 1 and not any(shape):
        raise ConfigError(
            f"estimate: context_parallel_size {layout.cp}: the planner reads the layers, key/value heads and head "
            f"dimension from a transformers config or the project's GPT, and {source.name!r} has neither"
        )
    layers, kv_heads, head_dim = shape
    float8 = _float8_weights(fake, plan)
    # gradient shards in swap files: as offload/optimizer_state.py's build_gradient_sinks decides
    grads_in_files = offload.optimizer.device == "nvme" and zero.shard_gradients and device_type == "cpu"
    grads_in_files = grads_in_files and precision.grad_dtype(compute) == torch.float32  # accumulated as stepped
    grads_in_files = grads_in_files and layout.tp == 1 and layout.shard_group == layout.zero
    st = rank_state(
        fake, zero, offload, layout.shard_group, 0, compute, moments, steps, device_type, grads_in_files, experts,
        layout.ep, layout.zero // layout.ep, precision.accum_dtype, float8, muon, collective,
    )  # fmt: skip
    buffers = sum(b.numel() * (compute if b.dtype == torch.float32 else b.dtype).itemsize for b in fake.buffers())
    reduce = precision.reduce_dtype if precision.mixed else None
    ran = st  # the layout the fake run replays
    if layout.pp > 1:  # it runs the whole model ([Note: pipeline stages in the estimate]): the whole model's layout
        whole_fake, whole_experts = _fake_model(source, layout.tp, layout.ep, tp_plan, cache)
        ran = rank_state(
            whole_fake, zero, offload, layout.shard_group, 0, compute, moments, steps, device_type, grads_in_files,
            whole_experts, layout.ep, layout.zero // layout.ep, precision.accum_dtype,
            _float8_weights(whole_fake, plan),
        )  # fmt: skip
    units = [(u.name, u.nbytes, u.numel) for u in ran.units]
    staged = [(b.padded_numel, b.shard_numel, len(b.slots), b.requires_grad) for b in ran.buckets]
    # under context parallelism a rank runs 1/cp of every sequence's tokens; the keys and values its ring attention
    # holds are a row of their own (_assemble)
    seq_len = layout.seq_len // layout.cp
    checkpointing = run_checkpointing(layout)
    key = (layout.tp, layout.ep, layout.sp, compute, layout.micro_batch, seq_len, checkpointing, reduce)
    key += (precision.accum_dtype,)
    # stages 0 and 1 run the same replay (a gradient kept in its flat buffer); 2 stages its buckets, 3 also gathers
    key += (max(layout.stage, 1), tuple(staged) if layout.stage >= 2 else None, tuple(units))
    key += (plan.prefetch, device_type == "cpu")
    run = {
        "source": source,
        "tp": layout.tp,
        "compute": compute,
        "micro_batch": layout.micro_batch,
        "seq_len": seq_len,
        "stage": layout.stage,
        "buckets": ran.buckets,
        "bucket_names": ran.bucket_names,
        "reduce_dtype": reduce,
        "accum_dtype": precision.accum_dtype,
        "checkpointing": checkpointing,
        "unit_classes": zero.unit_classes,
        "tp_plan": tp_plan,
        "ep": layout.ep,
        "sp": layout.sp,
        "gloo": device_type == "cpu",  # gloo's collectives' buffers (compute.py's module docstring)
        "units": units or None,
        "prefetch": plan.prefetch,
        "module_peaks": not cache.get("fast", True),
        "models": cache.setdefault("models", {}) if cache.get("fast", True) else None,
    }
    shape = (layers, max(kv_heads // (layout.tp * layout.sp), 1), head_dim)
    traffic, owners = {}, 0
    if muon is not None and zero.shard_optimizer_state:  # [Note: one owner per matrix] in zero/muon_owners.py
        traffic = muon_owner_traffic(st.buckets, layout.shard_group, muon)
        held = [b for b in st.buckets if b.requires_grad and any(muon(s.name, s.shape) for s in b.slots)]
        owners = max((4 * (2 * b.padded_numel + b.shard_numel) for b in held), default=0)
    elif collective:
        traffic = lamb_sum_traffic(st.buckets, layout.shard_group)
    prep = _Prepared(layout, st, n_params, buffers, key, run, layer_share, shape, _hidden_size(whole), traffic, owners)
    prep.vocab = _vocab_size(whole)
    prep.float8_linears = _float8_linear_shapes(fake, plan)
    return prep


def _hidden_size(model: Any) -> int:
    """A transformers config's ``hidden_size`` or the project's GPT's ``d_model`` (0: neither)."""
    for cfg, name in ((getattr(model, "config", None), "hidden_size"), (getattr(model, "cfg", None), "d_model")):
        if isinstance(getattr(cfg, name, None), int):
            return getattr(cfg, name)
    return 0


def _vocab_size(model: Any) -> int:
    """A transformers config's or the project's GPT's ``vocab_size`` (0: neither)."""
    for cfg in (getattr(model, "config", None), getattr(model, "cfg", None)):
        if isinstance(getattr(cfg, "vocab_size", None), int):
            return cfg.vocab_size
    return 0


def _stage_model(source: ModelSource, layout: Candidate, tp_plan: Any, cache: dict) -> tuple[Any, frozenset[int]]:
    """The fp32 fake model of pipeline rank ``layout.pp_rank``: its stages' pieces, cut as ``initialize`` cuts
    them (``pipeline_parallel/cut.py``, refusing what it refuses), and the ids of its expert parameters."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    key = ("stage", layout.tp, layout.ep, layout.pp, layout.stages_per_rank, layout.pp_rank)
    if key not in cache:
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = build_fake(source, layout.tp, torch.float32, tp_plan, layout.ep, split=False)
            num_stages = layout.pp * layout.stages_per_rank
            cut_model(fake, num_stages, stage_ids(layout.pp, layout.stages_per_rank, layout.pp_rank, layout.schedule))
            experts = split_experts(fake, layout.ep, layout.tp) if layout.ep > 1 else frozenset()
        cache[key] = (fake, experts)
    if layout.sp * layout.cp > 1:  # as apply_pp refuses it
        check_can_split_sequence(cache[key][0], layout.sp, layout.cp)
    return cache[key]


def _float8_linear_shapes(model: Any, plan: Plan) -> frozenset[tuple[int, int]]:
    """The weight shapes (out, in) of the linear layers torchao converts ([Note: which linears convert to float8] in
    ``precision/float8.py``), whose matmuls run at the fp8 peak ([Note: fp8 matmuls] in :mod:`.timing`)."""
    if not plan.fp8.enabled:
        return frozenset()
    heads = output_heads(model)
    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    return frozenset(tuple(m.weight.shape) for n, m in linears if why_kept(n, m, heads, plan.fp8.exclude) is None)


def _float8_weights(model: Any, plan: Plan) -> frozenset[int]:
    """The ids of the weights ZeRO-3 gathers in float8, as ``engine/parallelize.py`` picks them: the linear layers
    torchao converts ([Note: which linears convert to float8] in ``precision/float8.py``), at stage 3 with the
    tensorwise recipe, gathered in float8 unless graph mode or hpZ gathers them in the compute dtype."""
    fp8 = plan.fp8
    if not (fp8.enabled and fp8.gather_in_float8 and fp8.recipe == "tensorwise" and plan.zero.shard_parameters):
        return frozenset()
    if plan.graph.enabled or plan.dims.hpz_asked:
        return frozenset()
    heads = output_heads(model)
    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    return frozenset(id(m.weight) for n, m in linears if why_kept(n, m, heads, fp8.exclude) is None)


def _assemble(
    source: ModelSource, prep: _Prepared, comp: ComputePeak, device_type: str, activations: bool
) -> MemoryEstimate:
    """The estimate's rows from the layout's state and its fake run's peak (``NO_COMPUTE``: state only)."""
    layout, st, n_params, buffers = prep.layout, prep.state, prep.parameters, prep.buffers
    est = MemoryEstimate(source.name, layout, n_params, device_type, state=st, compute=comp)
    host = "host" if device_type == "cuda" else "device"
    rows = [
        Row("parameters", "device", st.params.get("device", 0)),
        Row("parameters in swap files", "nvme", st.params.get("nvme", 0)),
        Row("parameters (unit shards, uploaded per gather)", "host", st.params.get("host", 0)),
        Row("gradients", "device", st.grads["device"]),
    ]
    if st.grads.get("nvme"):
        rows.append(Row("gradients in swap files", "nvme", st.grads["nvme"]))
    if st.grads.get("host"):
        rows.append(Row("gradients (fp32 host copies for the host step)", "host", st.grads["host"]))
    opt = st.optimizer
    if "device" in opt:
        rows.append(Row("optimizer state (fp32 masters + moments)", "device", opt["device"]))
    if "host" in opt:
        rows.append(Row("optimizer state (fp32 masters + moments)", "host", opt["host"]))
    if "nvme" in opt:
        rows.append(Row("optimizer state in swap files", "nvme", opt["nvme"]))
    if st.zenflow:  # [Note: ZenFlow in the estimate] in estimate/state.py
        rows.append(Row("ZenFlow: selected columns (fp32 + moments)", "device", st.zenflow["selected"]))
        rows.append(Row("ZenFlow: host masters + host optimizer moments", host, st.zenflow["host_state"]))
        rows.append(Row("ZenFlow: gradient accumulators (double-buffered) + staging", host, st.zenflow["host_grads"]))
    rows.append(Row("optimizer step counters", host if opt.get("host") else "device", opt.get("steps", 0)))
    if opt.get("offload_buffers"):
        rows.append(Row("optimizer swap buffers", host, opt["offload_buffers"]))
    rows.append(Row("buffers", "device", buffers))
    # [Note: pipeline stages in the estimate]: a stage saves its share of the layers' activations; the temporaries
    # above them are the whole model's (an upper bound of a stage's)
    per_micro_batch = int(comp.activations * prep.layer_share) if layout.pp > 1 else comp.activations
    fwd_bwd_peak = max(comp.peak - comp.activations, 0) + per_micro_batch if layout.pp > 1 else comp.peak
    if activations:
        what = "activations saved for backward (end of forward" + (", this stage's layers)" if layout.pp > 1 else ")")
        rows.append(Row(what, "device", per_micro_batch, True, "in"))
    if comp.host_activations:
        what = "checkpointed blocks' inputs (cpu_checkpointing, at most)"
        rows.append(Row(what, host, comp.host_activations, True))
    if comp.gathered:
        rows.append(Row("gathered units at most (root + current + prefetched)", "device", comp.gathered, True, "in"))
    if activations:
        what = "activations, temporaries" + (", gathered units" if comp.gathered else "")
        rows.append(Row(f"{what} (forward/backward peak)", "device", fwd_bwd_peak, True))
    if activations and layout.pp > 1:  # [Note: pipeline stages in the estimate]
        held = in_flight(layout.schedule, layout.pp, layout.micro_batches, layout.pp_rank) * layout.stages_per_rank
        rows.append(
            Row(
                f"activations of {held - 1} more micro-batches in flight ({layout.schedule})",
                "device",
                per_micro_batch * (held - 1),
                True,
            )
        )
        tokens_bytes = layout.micro_batch * layout.seq_len * _DTYPES[layout.dtype].itemsize
        receive, outputs = pipeline_buffers(
            layout.pp, layout.pp_rank, layout.micro_batches, tokens_bytes * prep.hidden, tokens_bytes * prep.vocab
        )
        rows.append(Row("pipeline receive buffers (activations, their gradients; per micro-batch)", "device", receive))
        if outputs:
            rows.append(
                Row("last stage's outputs of every micro-batch (the step's merged output)", "device", outputs, True)
            )
    layers, kv_heads, head_dim = prep.shape
    itemsize = _DTYPES[layout.dtype].itemsize
    rows_per_rank = layout.micro_batch
    if activations and layout.cp > 1:  # [Note: which context attention] in sequence_parallel/ring.py
        kv = ring_keys_values(rows_per_rank, layout.seq_len, kv_heads, head_dim, itemsize, layout.cp)
        rows.append(Row("keys and values of three cp ranks' chunks of a layer (cp ring)", "device", kv, True))
    float8_units = [u for u in st.units if u.float8_numel]
    if float8_units:
        shards = [b.shard_numel for b in st.buckets if b.float8 is not None]
        rows.append(Row("float8 cast of a bucket's shard (1 byte/element)", "device", max(shards), True))
    if layout.cp > 1:
        passes = 2 if layout.checkpointing else 1
        sent = ring_bytes(rows_per_rank, layout.seq_len, kv_heads, head_dim, itemsize, layers, layout.cp, passes)
        if layout.pp > 1:
            sent = sent * round(layers * prep.layer_share) // layers
        est.traffic["context-parallel ring (keys and values)"] = sent * layout.micro_batches
    if float8_units:
        est.traffic["ZeRO-3 float8 gathers (1 byte/element)"] = layout.micro_batches * float8_gather_bytes(
            st.units, layout.shard_group
        )
    if layout.pp > 1:
        est.bubble = bubble_fraction(layout.schedule, layout.pp, layout.micro_batches, layout.stages_per_rank)
    if layout.stage == 3 and 1 < layout.hpz < layout.zero:
        # [Note: secondary shards]: at the end of a forward, 1/H of every unit it released, alive until each unit's
        # backward: all but the root (the first forward, before the unit order is recorded, releases the last block
        # too; later ones keep it gathered); counted beside the forward/backward peak
        released = sum(u.nbytes for u in st.units if not u.root)
        rows.append(
            Row(
                f"hpZ secondary shards at most (units but the root / {layout.hpz})",
                "device",
                released // layout.hpz,
                True,
            )
        )
    # the optimizer step: torch's single-tensor Adam makes one fragment-sized temporary at a time (its denominator)
    largest = max((f.length for b in st.buckets if b.requires_grad for f in b.fragments), default=0)
    if layout.stage == 0:
        largest = max((s.numel for b in st.buckets if b.requires_grad for s in b.slots), default=0)
    if prep.owner_buffers:
        rows.append(
            Row(
                "Muon owners' gathered bucket, result and chunk (fp32)",
                # the communicator's device: a GPU's host step stages its collectives there ([Note: the owners'
                # collectives on the device] in zero/owner_staging.py); a CPU run's offload steps in memory
                "device",
                prep.owner_buffers,
                True,
                "step",
            )
        )
    est.traffic.update(prep.step_traffic)
    rows.append(Row("optimizer step temporaries", host if opt.get("host") else "device", 4 * largest, True, "step"))
    est.rows = rows
    return est


def float8_gather_bytes(units: list[UnitSize], shard_group: int) -> int:
    """Bytes one rank receives in ZeRO-3's float8 gathers of one micro-batch, counted as the communicator counts an
    all-gather (``(N-1)/N`` of the buffer): each unit holding converted weights gathered for forward, and again for
    backward but the last block's, which stays gathered from its forward ([Note: kept after forward] in
    :mod:`.compute`)."""
    blocks = [u for u in units if not u.root]
    last_block = blocks[0] if blocks else None  # units are in the layout's order: last block first
    gathers = sum(u.float8_numel * (1 if u is last_block or u.root else 2) for u in units)
    return gathers * (shard_group - 1) // shard_group


# -- budgets -----------------------------------------------------------------------------------------------


def candidate_layouts(
    worlds: Iterable[int],
    base: Candidate,
    *,
    stages: Iterable[int] = (0, 1, 2, 3),
    tps: Iterable[int] | None = None,
    sps: Iterable[int] = (1,),
    pps: Iterable[int] = (1,),
    cps: Iterable[int] | None = None,
    offload: bool = True,
    param_offload: bool = True,
    host_params: bool = False,
    experts: Iterable[int] = (),
) -> list[Candidate]:
    """Every (world, stage, tp, sp, offload) combination around ``base`` (dtype, batch, checkpointing kept) whose
    tensor- and sequence-parallel sizes divide the world, and for a model whose experts modules hold ``experts``
    experts each, every expert-parallel size that divides them all and the ranks ZeRO shards over (``dp * sp``), at
    every stage and offload (``initialize`` builds expert parallelism with optimizer offload at stages 1-3 and
    parameter offload at stage 3, and the estimate lays their state out as it does), with and without tensor
    parallelism; ``host_params``: also parameter offload to host memory (a GPU machine's). Sizes the model's heads
    refuse, and combinations ``initialize`` does not build, are left to
    :func:`_prepare`, which refuses them. ``cps``: the context-parallel sizes tried (None: ``base``'s alone)."""
    experts, sps = list(experts), list(sps)
    cps = [base.cp] if cps is None else list(cps)
    out = []
    for world, pp, cp in [(w, p, c) for w in worlds for p in pps for c in cps if w % (p * c) == 0]:
        base = replace(base, pp=pp, cp=cp)
        for tp in tps or [t for t in range(1, world + 1) if world % t == 0]:
            for sp in sps:
                if world % (tp * sp * cp * pp):
                    continue
                zero = world // (tp * pp)
                eps = [e for e in range(2, zero + 1) if zero % e == 0 and all(n % e == 0 for n in experts)]
                for stage in stages:
                    options = [("none", "none")]
                    if offload and stage >= 1:
                        options += [("cpu", "none"), ("nvme", "none")]
                    if offload and stage == 3 and param_offload:
                        options.append(("nvme", "nvme"))
                    if offload and stage == 3 and host_params:  # on a GPU: shards in host memory, uploaded
                        options.append(("cpu", "cpu"))
                    for ep in [1, *(eps if experts else [])]:
                        for opt, par in options:
                            out.append(
                                replace(
                                    base,
                                    world=world,
                                    tp=tp,
                                    sp=sp,
                                    stage=stage,
                                    offload_optimizer=opt,
                                    offload_param=par,
                                    shard_size=None,
                                    ep=ep,
                                )
                            )
    return out


def fitting_layouts(
    model: Any,
    budget: int,
    config: Config | Mapping[str, Any] | str | Path | None = None,
    *,
    worlds: Iterable[int] = (1, 2, 4, 8),
    seq_len: int = 2048,
    checkpointing: bool | str = False,
    optimizer: str | None = None,
    device_type: str = "cuda",
    offload: bool = True,
    tp_plan: Any = None,
    activations: bool = True,
    fast: bool = True,
    progress: bool | None = False,
    workers: int = 1,
    sps: Iterable[int] | None = None,
    pps: Iterable[int] | None = None,
    cluster: Cluster | None = None,
    cps: Iterable[int] | None = None,
    micro_batch_sizes: Iterable[int] | None = None,
    checkpointings: Iterable[bool | str] | None = None,
    global_batch: int | None = None,
    **overrides: Any,
) -> list[MemoryEstimate]:
    """The layouts whose peak device memory per rank is at most ``budget`` bytes, fewest ranks first, then least
    device memory (a layout the model cannot take, e.g. a tensor-parallel size that does not divide its heads, is
    left out).

    ``fast`` (see :func:`estimate_memory`) also skips the fake run of a layout whose model state alone is over the
    budget: its peak is at least that (the peak is the state plus the larger transient phase), so it cannot fit
    either way. ``workers``: processes the distinct fake runs are spread over ([Note: fake runs in workers]); 1: all
    in this process. ``progress``: a bar of the layouts done, as :func:`estimate_memory`'s.

    ``sps``: the sequence-parallel sizes tried (each where it divides ``world / tp`` and the heads a rank holds);
    None: every size from 1 to the config's ``sequence_parallel_size`` (or the ``sp`` override), so 1 alone unless
    one is asked for ([Note: sequence-parallel sizes in a search]). ``pps``: the pipeline-parallel sizes tried, each
    where it divides the world (reported for pipeline rank 0, the first stage's); None: every size from 1 to the
    config's ``pipeline_parallel_size`` (or the ``pp`` override), for the same reason. ``cps``: the context-parallel
    sizes tried, each where it divides the world with the others (a cp rank runs ``1/cp`` of each sequence's tokens,
    holds the ring's keys and values and sends its bytes); None: every size from 1 to the config's
    ``context_parallel_size`` (or the ``cp`` override), for the same reason. ``cluster``: each fit also
    gets its predicted step there (``est.time``), and the fits are ranked by predicted tokens/s per GPU, fastest
    first (:func:`rank_by_speed`).

    ``micro_batch_sizes`` and ``checkpointings``: also search these micro-batch sizes and checkpointing choices
    (``False``, ``"selective"``, ``True``) around every layout (None: the base layout's only); each is a fake run of
    its own. ``global_batch``: keep only the layouts whose ``micro_batch x dp`` divides it, each with the
    micro-batches per step that make it up (:func:`with_global_batch`).

    [Note: sequence-parallel sizes in a search]
    Every sequence-parallel size is a fake run of its own per (tensor-parallel size, stage, dtype): its tokens, its
    exchange. Trying every size that divides the world by default more than doubles a search at 8 ranks (Llama-3-8B's
    shape, ``--budget 80GiB --worlds 8``: 20 s in one process without, 49 s with sizes 1, 2, 4 and 8;
    ``bench/bench_estimate.py --sp 8``, docs/estimate.md), past the 30 s a search is held to. So a search tries
    sizes up to the one the user names (``--sp P`` or the config's ``sequence_parallel_size``), which is what a user
    planning long sequences gives.
    """
    if workers < 1:
        raise ShardtrainError(f"workers must be at least 1, got {workers}")
    source = resolve_source(model)
    raw = read_config(config)
    worlds = list(worlds)
    base = replace(layout_from_config(raw, worlds[0], seq_len, checkpointing), **overrides)
    cache: dict = {"fast": fast}
    sps = range(1, base.sp + 1) if sps is None else sps
    pps = range(1, base.pp + 1) if pps is None else pps
    cps = range(1, base.cp + 1) if cps is None else cps
    layouts = candidate_layouts(
        worlds,
        base,
        sps=sps,
        pps=pps,
        cps=cps,
        offload=offload,
        host_params=device_type == "cuda",
        experts=_expert_counts(source, cache),
    )
    layouts = _batch_variants(layouts, micro_batch_sizes, checkpointings, global_batch)
    prepared: list[tuple[_Prepared, ComputePeak | None]] = []  # None: waits for its fake run
    waiting: dict[tuple, list[_Prepared]] = {}
    with _bar(progress, len(layouts), "layouts", "layout") as bar:
        for layout in layouts:  # model state first (fast); the fake runs after, one per distinct key
            try:
                prep = _prepare(source, raw, layout, optimizer, device_type, tp_plan, cache)
            except (LayoutError, ConfigError):
                bar.update()
                continue
            state_only = _assemble(source, prep, NO_COMPUTE, device_type, False)
            if not activations or (fast and state_only.peak["device"] > budget):
                bar.update()
                if not activations:
                    prepared.append((prep, NO_COMPUTE))
                continue
            prepared.append((prep, None))
            waiting.setdefault(prep.key, []).append(prep)
        runs: dict[tuple, ComputePeak | None] = {}
        for key, comp in measure_runs({key: group[0].run for key, group in waiting.items()}, workers):
            runs[key] = comp
            bar.set_postfix_str(waiting[key][0].layout.describe(), refresh=False)
            bar.update(len(waiting[key]))
    fits = []
    for prep, comp in prepared:
        comp = comp if comp is not None else runs[prep.key]
        if comp is None:  # the fake run refused the layout (LayoutError, ConfigError)
            continue
        est = _assemble(source, prep, comp, device_type, activations)
        if est.peak["device"] <= budget:
            if cluster is not None:
                est.time = time_prepared(prep, est, cluster, cache)
            fits.append(est)
    if cluster is not None:
        return rank_by_speed(fits)
    return sorted(fits, key=lambda e: (e.layout.world, e.peak["device"]))


def _batch_variants(
    layouts: list[Candidate],
    micro_batch_sizes: Iterable[int] | None,
    checkpointings: Iterable[bool | str] | None,
    global_batch: int | None,
) -> list[Candidate]:
    """Every layout at each micro-batch size and checkpointing asked for, those that cannot make up
    ``global_batch`` left out (see :func:`fitting_layouts`)."""
    sizes = list(micro_batch_sizes) if micro_batch_sizes is not None else None
    acs = list(checkpointings) if checkpointings is not None else None
    out = []
    for layout in layouts:
        for micro in sizes or [layout.micro_batch]:
            for ac in [layout.checkpointing] if acs is None else acs:
                variant = replace(layout, micro_batch=micro, checkpointing=ac)
                if global_batch is not None:
                    try:
                        variant = with_global_batch(variant, global_batch)
                    except (ConfigError, LayoutError):  # sizes that do not divide: not a layout of this batch
                        continue
                out.append(variant)
    return out


def rank_by_speed(fits: list[MemoryEstimate]) -> list[MemoryEstimate]:
    """Fastest first: predicted tokens/s per GPU, ties to less device memory."""
    return sorted(fits, key=lambda e: (-(e.time.tokens_per_s_per_gpu if e.time else 0.0), e.peak["device"]))


def why_slower(best: TimeEstimate, other: TimeEstimate, top: int = 2) -> str:
    """The parts of ``other``'s step that make it slower than ``best``'s, largest first (per token: a layout with
    more data-parallel ranks carries more tokens a step)."""
    scale = best.tokens_per_s_per_gpu / other.tokens_per_s_per_gpu if other.tokens_per_s_per_gpu else 1.0
    keys = set(best.parts) | set(other.parts)
    # each part per GPU-token of the layout: its share of the step, times the step per token
    per_token_best = {k: best.parts.get(k, 0.0) / best.step_time_s for k in keys}
    per_token_other = {k: other.parts.get(k, 0.0) / other.step_time_s * scale for k in keys}
    diff = sorted(((per_token_other[k] - per_token_best[k], k) for k in keys), reverse=True)
    named = [f"{k} {d:+.0%} of the best's step" for d, k in diff[:top] if d > 0.005]
    return "; ".join(named) or "within rounding of the best"


def _fake_model(
    source: ModelSource, tp: int, ep: int, tp_plan: Any, cache: dict, sp: int = 1
) -> tuple[Any, frozenset[int]]:
    """The fp32 fake model of a (tp, ep, sp) layout and the ids of its expert parameters, built once per search
    (under sequence parallelism with Ulysses installed: :func:`install_sequence_parallel` refuses what initialize
    refuses)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if ("fake", tp, ep, sp) not in cache:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        try:
            with mode:
                fake = build_fake(source, tp, torch.float32, tp_plan, ep, split=False)
                experts = split_experts(fake, ep, tp) if ep > 1 else frozenset()
                splitter = install_sequence_parallel(fake, sp, tp) if sp > 1 else None
        except (LayoutError, ConfigError) as refused:
            # a search asks again for every layout with these sizes: refuse them without building the model again
            # (at 1,024 GPUs it was built 1,201 times for 2 distinct refusals, two thirds of the search's time)
            cache["fake", tp, ep, sp] = refused
            raise
        cache["fake", tp, ep, sp] = (fake, experts)
        if cache.get("fast", True):  # an fp32 run without checkpointing needs this very model: build it once
            cache.setdefault("models", {})[model_key(tp, torch.float32, False, None, ep, sp)] = (mode, fake, splitter)
    built = cache["fake", tp, ep, sp]
    if isinstance(built, Exception):
        raise built.with_traceback(None)
    return built


def _expert_counts(source: ModelSource, cache: dict) -> list[int]:
    """``num_experts`` of every experts module of the model (empty for a dense one)."""
    return expert_counts(_fake_model(source, 1, 1, None, cache)[0])


_RUNS: list[dict[str, Any]] = []
"""The fake runs a pool of forked workers reads ([Note: fake runs in workers])."""


def measure_runs(runs: Mapping[tuple, dict[str, Any]], workers: int = 1) -> Iterator[tuple[tuple, ComputePeak | None]]:
    """``(key, peak)`` of each fake run (:func:`measure_compute`'s keyword arguments by key), as they finish;
    ``None`` for a run that refused its layout (a :class:`LayoutError` or :class:`ConfigError`).

    [Note: fake runs in workers]
    The distinct fake runs of a search share nothing but their inputs, and each is seconds of Python (fake-tensor
    dispatch): with ``workers > 1`` they run in that many forked processes (a fork copies the fake models already
    built, so no worker imports or builds again), and their peaks, plain integers, come back. The models every run
    needs are built here first. Forking is used only where it is safe: on Linux (fork is the default start method
    there), and while this process has not initialised CUDA (a CUDA context does not survive a fork); elsewhere the
    runs go one after another in this process. A worker that dies (killed for memory) is reported as the error it
    is, never waited for. The answers are the same either way: each run is the same function of the same inputs.
    """
    keys = list(runs)
    workers = min(workers, len(keys))
    if workers > 1 and _can_fork():
        for run in runs.values():  # each worker finds its models built
            model_args = ("source", "tp", "compute", "checkpointing", "unit_classes", "tp_plan", "models", "ep", "sp")
            prepare_models(**{k: run[k] for k in model_args})
        yield from _measure_in_workers(keys, runs, workers)
        return
    for key in keys:
        yield key, _measure_or_refuse(runs[key])


def _measure_or_refuse(run: dict[str, Any]) -> ComputePeak | None:
    try:
        return measure_compute(**run)
    except (LayoutError, ConfigError):
        return None


def _measure_index(i: int) -> ComputePeak | None:
    torch.set_num_threads(1)  # fake tensors compute nothing; one thread per worker
    return _measure_or_refuse(_RUNS[i])


def _can_fork() -> bool:
    import multiprocessing
    import sys

    return (
        sys.platform.startswith("linux")
        and "fork" in multiprocessing.get_all_start_methods()
        and not (torch.cuda.is_available() and torch.cuda.is_initialized())
    )


RUN_TIMEOUT_S = 900.0
"""A search in workers gives up when no fake run has finished for this long (one run of a 400B-parameter model's
shape takes well under a minute; a worker stuck for this long is not coming back)."""


def _measure_in_workers(
    keys: list[tuple], runs: Mapping[tuple, dict[str, Any]], workers: int
) -> Iterator[tuple[tuple, ComputePeak | None]]:
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    global _RUNS
    _RUNS = [runs[k] for k in keys]
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    pending: dict = {}
    try:
        pending = {pool.submit(_measure_index, i): keys[i] for i in range(len(keys))}
        while pending:
            done, _ = wait(pending, timeout=RUN_TIMEOUT_S, return_when=FIRST_COMPLETED)
            if not done:
                raise ShardtrainError(
                    f"estimate: no fake run of the search finished in {RUN_TIMEOUT_S:.0f} s in {workers} worker "
                    "processes; run it in this process with --jobs 1 (workers=1)"
                )
            for future in done:
                try:
                    comp = future.result()
                except BrokenProcessPool as err:
                    raise ShardtrainError(
                        f"estimate: a worker of the search died ({err}); the machine may be out of memory: "
                        "run with fewer workers (--jobs 1 runs the search in this process)"
                    ) from None
                yield pending.pop(future), comp
    finally:
        _RUNS = []
        processes = getattr(pool, "_processes", None) or {}
        for process in list(processes.values()) if pending else []:  # given up on: stop them rather than wait
            if process.is_alive():
                process.kill()
        pool.shutdown(wait=True, cancel_futures=True)


PROGRESS_DELAY_S = 2.0
"""A progress bar appears only once a search or an estimate has run this long (tqdm's ``delay``)."""


def _ticker(bar: Any) -> Any:
    """``progress(done, total)`` for :func:`measure_compute` moving a one-layout bar (None: no bar shown)."""
    if bar.disable:
        return None

    def progress(done: int, total: int) -> None:
        bar.total, bar.unit = total, "step"
        bar.update(done - bar.n)

    return progress


def _bar(progress: bool | None, total: int, desc: str, unit: str) -> Any:
    from tqdm import tqdm

    disable = None if progress is None else not progress  # None: tqdm shows it on a terminal only
    return tqdm(total=total, desc=desc, unit=unit, delay=PROGRESS_DELAY_S, disable=disable, leave=False)
