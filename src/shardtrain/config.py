"""Typed, validated configuration that accepts DeepSpeed-style keys.

``load_config`` takes a dict, a path to a JSON or YAML file, or a :class:`Config`, and returns a
:class:`Config`. Every mistake raises :class:`ConfigError` naming the full key path, the bad value and what
is allowed. A DeepSpeed key that shardtrain does not support yet says exactly that; nothing is ignored.

Validation is pydantic's (types, ranges, enumerations); the key walk in :func:`_check_keys` runs first so
that unknown keys get a "did you mean" and DeepSpeed keys get their own message.
"""

from __future__ import annotations

import difflib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from shardtrain.errors import ConfigError

# DeepSpeed keys a user may bring over that shardtrain does not implement (yet). Paths use dots.
UNSUPPORTED_DEEPSPEED_KEYS: dict[str, str] = {
    "amp": "apex AMP is not supported; use the 'bf16' or 'fp16' sections",
    "fp16.auto_cast": "inputs are not cast; pass floating inputs in the compute dtype",
    "fp16.consecutive_hysteresis": "not supported; the hysteresis allowance is restored after each clean window",
    "prescale_gradients": "gradients are always averaged over data-parallel ranks during the reduction",
    "gradient_predivide_factor": "gradients are always averaged over data-parallel ranks during the reduction",
    "sparse_gradients": "sparse gradients are not supported",
    "activation_checkpointing": "use torch.utils.checkpoint in the model instead",
    "checkpoint": "checkpoint options are not supported yet",
    "zero_allow_untested_optimizer": "any torch.optim optimizer is accepted; the key is not needed",
    "zero_force_ds_cpu_optimizer": "there is no DeepSpeed CPU optimizer in shardtrain",
    "memory_breakdown": "not supported; use engine.state_bytes()",
    "flops_profiler": "not supported; use torch.profiler",
    "comms_logger": "not supported; use engine.comm_stats()",
    "pipeline": "pipeline parallelism is not supported",
    "tensor_parallel": "tensor parallelism is not supported yet",
    "aio": "NVMe offload is not supported yet",
    "autotuning": "not supported",
    "elasticity": "not supported",
    "compression_training": "not supported",
    "data_efficiency": "not supported",
    "curriculum_learning": "not supported",
    "dump_state": "not supported",
    "zero_optimization.offload_optimizer": "optimizer offload is not supported yet",
    "zero_optimization.offload_param": "parameter offload is not supported yet",
    "zero_optimization.sub_group_size": "the optimizer steps each rank's fragments at once",
    "zero_optimization.stage3_max_live_parameters": "at most the current and the prefetched units are gathered",
    "zero_optimization.stage3_max_reuse_distance": "units are released after every use",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "use engine.full_state_dict()",
    "zero_optimization.round_robin_gradients": "not supported",
    "zero_optimization.elastic_checkpoint": "not supported; checkpoints will load into any layout",
    "zero_optimization.load_from_fp32_weights": "not supported yet",
    "zero_optimization.reduce_scatter": "gradients are always reduce-scattered at stages 1 and 2",
    "zero_optimization.allgather_partitions": "parameters are always all-gathered after the step",
    "zero_optimization.cpu_offload": "optimizer offload is not supported yet",
    "zero_optimization.ignore_unused_parameters": "unused parameters are always handled (their gradient is zero)",
    "zero_optimization.zero_hpz_partition_size": "hierarchical partitioning (ZeRO++) is not supported",
    "zero_optimization.zero_quantized_weights": "quantized communication (ZeRO++) is not supported",
    "zero_optimization.zero_quantized_gradients": "quantized communication (ZeRO++) is not supported",
    "zero_optimization.mics_shard_size": "MiCS is not supported",
}


# Keys that belong elsewhere: refused with this message as it stands.
MISPLACED_KEYS: dict[str, str] = {
    f"bf16.{key}": "loss scaling applies to fp16 only; bf16 has fp32's range and needs none"
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
}


def _integral(v: Any) -> Any:
    """DeepSpeed configs write sizes as ``5e8``; accept integral floats as ints, refuse 1.5 and "5"."""
    if isinstance(v, bool):
        raise ValueError("expected a whole number, got a boolean")
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


Count = Annotated[int, BeforeValidator(_integral), Field(strict=True, ge=1)]
Size = Annotated[int, BeforeValidator(_integral), Field(strict=True, ge=0)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ZeroConfig(_Section):
    stage: Literal[0, 1, 2, 3] = 0
    reduce_bucket_size: Count = 500_000_000
    """Elements per gradient bucket; also the unit parameters are laid out (and all-gathered) in."""
    allgather_bucket_size: Count = 500_000_000
    """At most this many elements of parameter all-gathers are in flight at once after a step."""
    overlap_comm: bool = True
    """Launch each bucket's reduction as soon as its gradients are ready during backward."""
    contiguous_gradients: Literal[True] = True
    """Always on: gradients are copied into contiguous bucket buffers (``false`` is refused)."""
    stage3_param_persistence_threshold: Size = 100_000
    """Stage 3: parameters with fewer elements stay whole on every rank."""
    stage3_prefetch_bucket_size: Size = 50_000_000
    """Stage 3: elements of upcoming units gathered ahead of use (0 disables prefetch)."""
    stage3_unit_classes: list[str] | None = None
    """Stage 3 (shardtrain key): module class names to gather/release as units, instead of repeated blocks."""
    stage3_gather_check: bool = True
    """Stage 3 (shardtrain key): exchange unit ids before each gather to catch ranks on different paths."""

    @model_validator(mode="after")
    def _stage3_keys_need_stage3(self) -> ZeroConfig:
        if self.stage != 3:
            for key in sorted(self.model_fields_set):
                if key.startswith("stage3_"):
                    raise ValueError(f"{key} applies to stage 3 only, but stage is {self.stage}; remove it")
        return self


class BF16Config(_Section):
    enabled: bool = False


class FP16Config(_Section):
    enabled: bool = False
    loss_scale: float = Field(default=0.0, ge=0)
    """0 = dynamic loss scaling; a positive value is a static scale."""
    initial_scale_power: int = Field(default=16, ge=0, le=64)
    loss_scale_window: Count = 1000
    hysteresis: Count = 2
    min_loss_scale: float = Field(default=1.0, gt=0)


class OptimizerConfig(_Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(_Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class WarmupLRParams(_Section):
    warmup_min_lr: float = Field(default=0.0, ge=0)
    warmup_max_lr: float = Field(default=0.001, ge=0)
    warmup_num_steps: Count = 1000
    warmup_type: Literal["log", "linear"] = "log"


class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: Count


class MonitorConfig(_Section):
    """DeepSpeed's ``tensorboard`` and ``csv_monitor`` sections (written by :mod:`shardtrain.monitor`)."""

    enabled: bool = False
    output_path: str = ""
    """Directory for the monitor's files; empty: ``./runs`` relative to the working directory."""
    job_name: str = "DeepSpeedJobName"
    """Subdirectory of ``output_path`` for this run."""


class WandbConfig(_Section):
    """DeepSpeed's ``wandb`` section; needs the ``wandb`` package when enabled."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class Config(_Section):
    """The whole configuration. Field names are DeepSpeed's where DeepSpeed has the same concept."""

    train_batch_size: Count | None = None
    train_micro_batch_size_per_gpu: Count | None = None
    gradient_accumulation_steps: Count | None = None
    gradient_clipping: float = Field(default=0.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    bf16: BF16Config = Field(default_factory=BF16Config)
    fp16: FP16Config = Field(default_factory=FP16Config)
    communication_data_type: Literal["fp32", "bf16", "fp16"] | None = None
    """dtype gradients are reduced in; default fp32 (see [Note: mixed precision])."""
    steps_per_print: Count = 10
    wall_clock_breakdown: bool = False
    """Log forward/backward/step wall-clock times every ``steps_per_print`` steps (rank 0)."""
    tensorboard: MonitorConfig = Field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    seed: int | None = None
    collective_timeout_s: float = Field(default=1800.0, gt=0)
    """shardtrain's own key: seconds a collective may wait before failing with a named error."""

    @model_validator(mode="after")
    def _precision(self) -> Config:
        if self.bf16.enabled and self.fp16.enabled:
            raise ValueError("bf16.enabled and fp16.enabled are both true; enable one of them")
        compute = "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"
        if compute == "fp32" and self.communication_data_type not in (None, "fp32"):
            raise ValueError(
                "communication_data_type applies to mixed precision only; enable bf16 or fp16, or remove it"
            )
        if self.communication_data_type not in (None, "fp32", compute):
            raise ValueError(
                f"communication_data_type {self.communication_data_type!r} with {compute} compute; use 'fp32' "
                f"(the default) or {compute!r}"
            )
        return self


# -- optimizer and scheduler validation ----------------------------------------------------------

_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
_SCHEDULERS = {"WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams}


def optimizer_class_and_kwargs(cfg: OptimizerConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Map a DeepSpeed optimizer section onto a torch optimizer class and keyword arguments.

    As in DeepSpeed, ``type: Adam`` has ``adam_w_mode: true`` by default, i.e. decoupled weight decay
    (torch's AdamW); ``adam_w_mode: false`` gives torch's Adam (L2 penalty).
    """
    kind = cfg.type.lower()
    if kind not in _OPTIMIZERS:
        raise ConfigError(
            f"optimizer.type: {cfg.type!r} is not supported; allowed: Adam, AdamW, SGD "
            "(or pass a torch optimizer to initialize(optimizer=...))"
        )
    params = dict(cfg.params)
    if kind == "adam":
        adam_w_mode = params.pop("adam_w_mode", True)
        if not isinstance(adam_w_mode, bool):
            raise ConfigError(f"optimizer.params.adam_w_mode: expected true or false, got {adam_w_mode!r}")
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    else:
        cls = _OPTIMIZERS[kind]
    allowed = [p for p in inspect.signature(cls).parameters if p != "params"]
    for key in params:
        if key not in allowed:
            raise ConfigError(_unknown_key_message(f"optimizer.params.{key}", key, allowed))
    if "betas" in params and isinstance(params["betas"], list):
        params["betas"] = tuple(params["betas"])
    try:  # let torch validate values (negative lr, betas out of range) on a throwaway tensor
        cls([torch.zeros(1, requires_grad=True)], **params)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"optimizer.params: {err} (got {cfg.params!r})") from err
    return cls, params


def scheduler_params(cfg: SchedulerConfig) -> WarmupLRParams:
    if cfg.type not in _SCHEDULERS:
        raise ConfigError(
            f"scheduler.type: {cfg.type!r} is not supported; allowed: {', '.join(_SCHEDULERS)} "
            "(or pass a torch LR scheduler to initialize(lr_scheduler=...))"
        )
    model = _SCHEDULERS[cfg.type]
    _check_keys(cfg.params, model, "scheduler.params")
    try:
        return model.model_validate(cfg.params)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, "scheduler.params")) from None


# -- loading ----------------------------------------------------------------------------------------


def load_config(source: Config | Mapping[str, Any] | str | Path | None) -> Config:
    if source is None:
        return Config()
    if isinstance(source, Config):
        return source
    if isinstance(source, (str, Path)):
        data = _read_file(Path(source))
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        raise ConfigError(
            f"config must be a dict, a path to a .json/.yaml file or a shardtrain.Config; got {type(source).__name__}"
        )
    _check_keys(data, Config, "")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, "")) from None
    if cfg.optimizer is not None:
        optimizer_class_and_kwargs(cfg.optimizer)
    if cfg.scheduler is not None:
        scheduler_params(cfg.scheduler)
    return cfg


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {str(path)!r}: unknown extension; use .json, .yaml or .yml")
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"config file {str(path)!r} is not valid {path.suffix[1:].upper()}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top, got {type(data).__name__}")
    return data


def _unknown_key_message(path: str, key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{path}: unknown key {key!r}{hint} Allowed keys here: {', '.join(sorted(allowed))}"


def _check_keys(data: Any, model: type[BaseModel], prefix: str) -> None:
    """Refuse unknown and unsupported keys, recursing into nested sections."""
    if not isinstance(data, Mapping):
        return  # pydantic reports the wrong type with its path
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if path in MISPLACED_KEYS:
            raise ConfigError(f"{path}: {MISPLACED_KEYS[path]}")
        if path in UNSUPPORTED_DEEPSPEED_KEYS:
            raise ConfigError(
                f"{path}: a DeepSpeed key shardtrain does not support yet ({UNSUPPORTED_DEEPSPEED_KEYS[path]})"
            )
        if key not in model.model_fields:
            raise ConfigError(_unknown_key_message(path, str(key), list(model.model_fields)))
        annotation = model.model_fields[key].annotation
        for candidate in getattr(annotation, "__args__", (annotation,)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                _check_keys(value, candidate, path)


def _format_validation_error(err: ValidationError, prefix: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith(("function-", "constrained-")))
        loc = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        msg = e["msg"].removeprefix("Value error, ")
        if not loc:  # a rule about several keys: the message names them, the input is the whole config
            lines.append(f"config: {msg}")
            continue
        lines.append(f"{loc}: {msg} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


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
