"""Resolve ``"auto"`` config values at ``initialize``, as Hugging Face's Trainer does for DeepSpeed.

Where the Trainer reads ``TrainingArguments``, shardtrain reads ``initialize(auto_values={...})``:

======================================  ==========================================================================
config key                              resolved from
======================================  ==========================================================================
``train_micro_batch_size_per_gpu``      ``auto_values["train_micro_batch_size_per_gpu"]``, or the other two
``gradient_accumulation_steps``         ``auto_values["gradient_accumulation_steps"]``, or the other two
``train_batch_size``                    ``auto_values["train_batch_size"]``, or micro x accumulation x dp size
``gradient_clipping``                   ``auto_values["gradient_clipping"]``
``optimizer.params.lr/betas/eps/...``   ``auto_values["lr"]``, ``["betas"]``, ``["eps"]``, ``["weight_decay"]``
``scheduler.params.warmup_min_lr``      ``auto_values["warmup_min_lr"]``, else 0 (as the Trainer)
``scheduler.params.warmup_max_lr``      ``auto_values["lr"]``
``scheduler.params.warmup_num_steps``   ``auto_values["warmup_num_steps"]``
``scheduler.params.total_num_steps``    ``auto_values["total_num_steps"]``
``stage3_gather_16bit_weights_...``    true (the Trainer saves the full weights)
``fp16.enabled`` / ``bf16.enabled``     ``auto_values["precision"]`` (``"fp32"``, ``"bf16"``, ``"fp16"``); false if
                                        not given (the Trainer's default without ``--fp16``/``--bf16``)
``pipeline.stages``                     ``pipeline_parallel_size`` (a PipelineModule's ``num_stages``)
``zero_optimization.*`` sizes           hidden size h (``model.config.hidden_size``, the largest of
                                        ``hidden_sizes``, or ``auto_values["hidden_size"]``):
                                        ``reduce_bucket_size`` h², at stage 3 ``stage3_prefetch_bucket_size``
                                        int(0.9 h²) and ``stage3_param_persistence_threshold`` 10 h (at stages
                                        0-2 these two have no effect and take their defaults)
======================================  ==========================================================================

A value in ``auto_values`` for a key the config sets to a different number is an error (the Trainer's
"mismatch" check); an ``"auto"`` that cannot be derived is a :class:`ConfigError` naming the key and the
``auto_values`` entry to give.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from shardtrain.config.deepspeed_keys import is_auto, unknown_key_message
from shardtrain.config.sections import Config, ZeroConfig, inspect_config, resolve_batch_sizes
from shardtrain.errors import ConfigError

# auto_values name -> the config keys it fills (dots) when they are "auto" (and must match when they are not).
AUTO_VALUE_KEYS: dict[str, tuple[str, ...]] = {
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu",),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "train_batch_size": ("train_batch_size",),
    "gradient_clipping": ("gradient_clipping",),
    "lr": ("optimizer.params.lr", "scheduler.params.warmup_max_lr"),
    "betas": ("optimizer.params.betas",),
    "eps": ("optimizer.params.eps",),
    "weight_decay": ("optimizer.params.weight_decay",),
    "warmup_min_lr": ("scheduler.params.warmup_min_lr",),
    "warmup_num_steps": ("scheduler.params.warmup_num_steps",),
    "total_num_steps": ("scheduler.params.total_num_steps",),
    "precision": (),
    "hidden_size": (),
}
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_PRECISIONS = ("fp32", "bf16", "fp16")


def auto_paths(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    found = []
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        if is_auto(value):
            found.append(path)
        elif isinstance(value, Mapping):
            found += auto_paths(value, path)
    return found


def _get(data: Mapping[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node[part]
    node[last] = value


def model_hidden_size(model: nn.Module) -> int | None:
    """The hidden size Hugging Face's Trainer uses: ``config.hidden_size`` or the largest ``hidden_sizes``."""
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        if source is None:
            continue
        if isinstance(getattr(source, "hidden_size", None), int):
            return source.hidden_size
        sizes = getattr(source, "hidden_sizes", None)
        if sizes:
            return max(sizes)
    return None


def resolve_auto(
    cfg: Config, *, dp: int, model: nn.Module | None = None, auto_values: Mapping[str, Any] | None = None
) -> Config:
    """Return ``cfg`` with every ``"auto"`` replaced (see the module docstring); ``cfg`` itself when it has none."""
    if auto_values is not None and not isinstance(auto_values, Mapping):
        raise ConfigError(f"auto_values must be a dict (name -> value), got {type(auto_values).__name__}")
    values = dict(auto_values or {})
    for name in values:
        if name not in AUTO_VALUE_KEYS:
            raise ConfigError(unknown_key_message(f"auto_values[{name!r}]", name, list(AUTO_VALUE_KEYS)))
    data = cfg.model_dump(exclude_unset=True)
    problems: list[str] = []
    for name, value in values.items():  # the Trainer's mismatch check
        for path in AUTO_VALUE_KEYS[name]:
            given = _get(data, path)
            if given is not None and not is_auto(given) and _normalized(given) != _normalized(value):
                problems.append(
                    f"{path}: the config says {given!r} but auto_values[{name!r}] is {value!r}; "
                    'keep one of them (write "auto" in the config to take the argument)'
                )
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    if not auto_paths(data) and not values:
        return cfg

    for name, value in values.items():
        for path in AUTO_VALUE_KEYS[name]:
            if is_auto(_get(data, path)):
                _set(data, path, value)
    if is_auto(_get(data, "scheduler.params.warmup_min_lr")):
        _set(data, "scheduler.params.warmup_min_lr", 0.0)
    if is_auto(_get(data, "pipeline.stages")):  # DeepSpeed reads the stages from its PipelineModule, never from here
        _set(data, "pipeline.stages", cfg.pipeline_parallel_size)
    zenflow = data.get("zero_optimization", {}).get("zenflow")
    if isinstance(zenflow, dict) and is_auto(zenflow.get("select_interval")):
        del zenflow["select_interval"]  # DeepSpeed's own "auto": ZenFlow's select_strategy "auto" gives its meaning
    if isinstance(zenflow, dict) and is_auto(zenflow.get("update_interval")):
        del zenflow["update_interval"]  # DeepSpeed's own "auto", the default: the adaptive interval
    _resolve_precision(data, values.get("precision"))
    _resolve_batch(data, dp)
    _resolve_sizes(data, model, values.get("hidden_size"))

    for path in auto_paths(data):
        problems.append(f'{path}: "auto" cannot be derived here; {_what_to_give(path)}')
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    report = inspect_config(data)
    if report.problems:
        raise ConfigError('invalid config after resolving "auto":\n  ' + "\n  ".join(report.problems))
    assert report.config is not None
    return report.config


def _normalized(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _what_to_give(path: str) -> str:
    for name, paths in AUTO_VALUE_KEYS.items():
        if path in paths:
            return f"pass initialize(auto_values={{{name!r}: ...}}) or write a value in the config"
    return "write a value in the config"


def _resolve_precision(data: dict[str, Any], precision: Any) -> None:
    if precision is not None and precision not in _PRECISIONS:
        raise ConfigError(f"auto_values['precision']: {precision!r}; allowed: {', '.join(_PRECISIONS)}")
    for name in ("fp16", "bf16"):
        if is_auto(_get(data, f"{name}.enabled")):
            _set(data, f"{name}.enabled", precision == name)


def _resolve_batch(data: dict[str, Any], dp: int) -> None:
    autos = [k for k in _BATCH if is_auto(data.get(k))]
    if not autos:
        return
    known = {k: data.get(k) for k in _BATCH if not is_auto(data.get(k))}
    if known.get("train_micro_batch_size_per_gpu") is None and known.get("train_batch_size") is None:
        raise ConfigError(
            f'{autos[0]}: "auto" cannot be derived without a micro-batch size; pass '
            "initialize(auto_values={'train_micro_batch_size_per_gpu': ...}) (and 'gradient_accumulation_steps' if "
            'it is "auto" too), or write the numbers in the config'
        )
    # DeepSpeed's rule on the keys that are known: any two determine the third; one alone means accumulation 1
    tb, mb, gas = resolve_batch_sizes(Config.model_validate(known), dp)
    resolved = {"train_batch_size": tb, "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas}
    for k in autos:
        data[k] = resolved[k]


def _resolve_sizes(data: dict[str, Any], model: nn.Module | None, hidden_size: Any) -> None:
    zero = data.get("zero_optimization", {})
    if is_auto(zero.get("stage3_gather_16bit_weights_on_model_save")):  # the Trainer saves the full weights
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    stage = ZeroConfig.model_validate({"stage": zero.get("stage", 0)}).stage
    stage3_keys = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    if stage != 3:  # no effect below stage 3: the defaults, without asking for a hidden size
        for key in stage3_keys:
            if is_auto(zero.get(key)):
                zero[key] = ZeroConfig.model_fields[key].default
    needs = [k for k in ("reduce_bucket_size", *stage3_keys) if is_auto(zero.get(k))]
    if not needs:
        return
    h = hidden_size if hidden_size is not None else (model_hidden_size(model) if model is not None else None)
    if not isinstance(h, int) or isinstance(h, bool) or h < 1:
        keys = ", ".join(f"zero_optimization.{k}" for k in needs)
        raise ConfigError(
            f'{keys}: "auto" is derived from the model\'s hidden size, and this model has no '
            "config.hidden_size (nor hidden_sizes); write numbers in the config, or pass "
            "initialize(auto_values={'hidden_size': ...})"
        )
    derived = {
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
    }
    for key in needs:
        zero[key] = derived[key]
