"""The DeepSpeed API that real scripts call, one row per name, and what ``shardtrain.deepspeed`` does with each.

:data:`SURFACE` lists every ``deepspeed.*`` name and engine method that these call (found by searching their
sources for ``deepspeed.``, ``from deepspeed... import`` and calls on the engine ``deepspeed.initialize`` returns):

* ``DSE``: DeepSpeedExamples' ``training/`` scripts (commit ``45b4b7156c87``);
* ``transformers`` 5.23 (``integrations/deepspeed.py``, ``trainer.py``, the models that gather under ZeRO-3),
  ``accelerate`` (``accelerator.py``, ``state.py``, ``utils/deepspeed.py``, ``utils/operations.py``,
  ``utils/other.py``), ``TRL`` and ``peft``, as installed beside shardtrain;
* ``docs``: DeepSpeed's documented API (``deepspeed.utils`` of 0.19.8) that none of those happens to call.

A name's status is not written here: :func:`status` resolves the name on ``shardtrain.deepspeed`` and reports
whether it works or raises :class:`~shardtrain.compat.deepspeed.unsupported.NotProvidedError` (with what to use
instead, from the error itself). ``docs/migration-deepspeed.md`` holds :func:`markdown_table`'s output (regenerate
with ``python -m shardtrain.compat.deepspeed.surface``); ``tests/compat/test_deepspeed_surface.py`` checks the two are
equal and calls every name that works.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from shardtrain.compat.deepspeed.unsupported import NotProvidedError


@dataclass(frozen=True)
class ApiName:
    name: str
    """As a script writes it: ``deepspeed.zero.Init``, ``get_accelerator().device_name``, ``engine.backward``."""
    used_by: str
    """Who calls it (see the module's docstring)."""


def _rows(used_by: str, *names: str) -> tuple[ApiName, ...]:
    return tuple(ApiName(n, used_by) for n in names)


SURFACE: tuple[ApiName, ...] = (
    # -- deepspeed.* -------------------------------------------------------------------------------
    ApiName("deepspeed.initialize", "DSE, transformers, accelerate, TRL"),
    ApiName("deepspeed.init_distributed", "DSE"),
    ApiName("deepspeed.add_config_arguments", "DSE"),
    ApiName("deepspeed.__version__", "transformers"),
    ApiName("deepspeed.DeepSpeedEngine", "accelerate"),
    ApiName("deepspeed.get_accelerator", "DSE"),
    ApiName("deepspeed.accelerator.get_accelerator", "DSE, transformers"),
    ApiName("get_accelerator().device_name", "DSE, transformers"),
    ApiName("get_accelerator().current_device_name", "DSE, transformers"),
    ApiName("get_accelerator().set_device", "DSE"),
    ApiName("get_accelerator().device_count", "DSE"),
    ApiName("get_accelerator().is_available", "DSE"),
    ApiName("get_accelerator().memory_allocated", "DSE"),
    ApiName("get_accelerator().max_memory_allocated", "DSE"),
    ApiName("get_accelerator().memory_reserved", "DSE"),
    ApiName("get_accelerator().max_memory_reserved", "DSE"),
    ApiName("get_accelerator().reset_peak_memory_stats", "DSE"),
    ApiName("deepspeed.comm.get_rank", "DSE, transformers, TRL"),
    ApiName("deepspeed.comm.get_world_size", "DSE"),
    ApiName("deepspeed.comm.get_local_rank", "DSE"),
    ApiName("deepspeed.comm.is_initialized", "DSE, accelerate"),
    ApiName("deepspeed.comm.init_distributed", "DSE, accelerate"),
    ApiName("deepspeed.comm.barrier", "DSE"),
    ApiName("deepspeed.comm.new_group", "DSE"),
    ApiName("deepspeed.comm.broadcast", "DSE"),
    ApiName("deepspeed.comm.all_reduce", "DSE"),
    ApiName("deepspeed.comm.reduce", "DSE"),
    ApiName("deepspeed.comm.gather", "DSE"),
    ApiName("deepspeed.zero.Init", "DSE, transformers, accelerate"),
    ApiName("deepspeed.zero.GatheredParameters", "transformers, accelerate, TRL, peft"),
    ApiName("deepspeed.zero.register_external_parameter", "transformers"),
    ApiName("deepspeed.utils.logger", "DSE, transformers"),
    ApiName("deepspeed.utils.RepeatingLoader", "DSE"),
    ApiName("deepspeed.utils.safe_get_full_grad", "peft"),
    *_rows(
        "docs",
        "deepspeed.utils.safe_get_full_fp32_param",
        "deepspeed.utils.safe_get_full_optimizer_state",
        "deepspeed.utils.safe_set_full_fp32_param",
        "deepspeed.utils.safe_set_full_optimizer_state",
    ),
    *_rows(
        "docs (transformers' and accelerate's messages point to it)",
        "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
        "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
        "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    ),
    ApiName("deepspeed.checkpoint.utils.clone_tensors_for_torch_save", "accelerate"),
    ApiName("deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES", "accelerate"),
    ApiName("deepspeed.runtime.lr_schedules.WarmupLR", "DSE, accelerate's examples"),
    *_rows(
        "docs",
        "deepspeed.runtime.lr_schedules.WarmupDecayLR",
        "deepspeed.runtime.lr_schedules.WarmupCosineLR",
        "deepspeed.runtime.lr_schedules.OneCycle",
        "deepspeed.runtime.lr_schedules.LRRangeTest",
    ),
    # refused
    *_rows(
        "docs",
        "deepspeed.utils.safe_get_local_fp32_param",
        "deepspeed.utils.safe_get_local_grad",
        "deepspeed.utils.safe_get_local_optimizer_state",
        "deepspeed.utils.safe_set_full_grad",
    ),
    ApiName("deepspeed.utils.groups", "transformers, accelerate"),
    ApiName("deepspeed.utils.set_z3_leaf_modules", "DSE, accelerate"),
    ApiName("deepspeed.ops", "DSE, accelerate"),
    ApiName("deepspeed.runtime.engine", "TRL"),
    ApiName("deepspeed.runtime.zero", "DSE, transformers, TRL"),
    ApiName("deepspeed.runtime.sequence_parallel", "accelerate"),
    ApiName("deepspeed.tp_model_init", "DSE, transformers"),
    ApiName("deepspeed.pipe", "DSE"),
    ApiName("deepspeed.moe", "DSE"),
    ApiName("deepspeed.init_inference", "DSE"),
    ApiName("deepspeed.module_inject", "DSE"),
    ApiName("deepspeed.replace_transformer_layer", "DSE"),
    ApiName("deepspeed.DeepSpeedTransformerLayer", "DSE"),
    ApiName("deepspeed.DeepSpeedConfig", "DSE"),
    ApiName("deepspeed.launcher", "accelerate"),
    ApiName("deepspeed.checkpointing", "docs (Megatron-DeepSpeed)"),
    # -- the engine --------------------------------------------------------------------------------
    ApiName("engine.forward", "DSE, transformers, accelerate, TRL"),
    ApiName("engine.backward", "DSE, transformers, accelerate"),
    ApiName("engine.step", "DSE, transformers, accelerate"),
    ApiName("engine.module", "DSE, transformers, accelerate, TRL"),
    ApiName("engine.optimizer", "transformers, accelerate, TRL"),
    ApiName("engine.lr_scheduler", "DSE, accelerate"),
    ApiName("engine.config", "transformers"),
    ApiName("engine.device", "DSE, TRL"),
    ApiName("engine.local_rank", "DSE"),
    ApiName("engine.train", "DSE, accelerate, TRL"),
    ApiName("engine.eval", "DSE, accelerate, TRL"),
    ApiName("engine.zero_grad", "accelerate"),
    ApiName("engine.save_checkpoint", "DSE, transformers, accelerate"),
    ApiName("engine.load_checkpoint", "DSE, transformers, accelerate"),
    ApiName("engine.save_16bit_model", "docs"),
    ApiName("engine._zero3_consolidated_16bit_state_dict", "transformers, accelerate"),
    ApiName("engine.zero_gather_16bit_weights_on_model_save", "accelerate"),
    ApiName("engine.get_global_grad_norm", "accelerate"),
    ApiName("engine.is_gradient_accumulation_boundary", "DSE"),
    ApiName("engine.set_gradient_accumulation_boundary", "accelerate"),
    ApiName("engine.gradient_accumulation_steps", "DSE"),
    ApiName("engine.train_micro_batch_size_per_gpu", "DSE"),
    ApiName("engine.train_batch_size", "DSE"),
    ApiName("engine.get_lr", "DSE"),
    ApiName("engine.global_steps", "DSE"),
    ApiName("engine.was_step_applied", "docs"),
    ApiName("engine.fp16_enabled", "DSE"),
    ApiName("engine.bfloat16_enabled", "DSE"),
    ApiName("engine.zero_optimization", "docs"),
    ApiName("engine.zero_optimization_stage", "docs"),
    ApiName("engine.loss_scale", "docs"),
    ApiName("engine.wall_clock_breakdown", "DSE"),
    ApiName("engine.destroy", "DSE, accelerate"),
    ApiName("engine.compile", "accelerate"),
    ApiName("engine.offload_states", "DSE"),
    ApiName("engine.reload_states", "DSE"),
    ApiName("engine.train_batch", "DSE"),
)

_ENGINE_FIELDS = ("module", "training_dataloader", "config", "shardtrain_engine")
"""Attributes ``DeepSpeedEngine.__init__`` sets (the others are methods and properties of the class)."""


def resolve(name: str) -> Any:
    """The object ``name`` stands for on ``shardtrain.deepspeed`` (an engine name: the ``DeepSpeedEngine`` class's
    attribute); raises ``NotProvidedError`` for a name that is refused."""
    import shardtrain.compat.deepspeed as deepspeed  # the module shardtrain.deepspeed names
    from shardtrain.compat.deepspeed.engine import DeepSpeedEngine

    head, _, rest = name.partition(".")
    if head == "engine":
        if rest in _ENGINE_FIELDS:
            return rest
        if hasattr(DeepSpeedEngine, rest):
            return getattr(DeepSpeedEngine, rest)
        return DeepSpeedEngine.__getattr__(object.__new__(DeepSpeedEngine), rest)  # raises: refused
    if head == "get_accelerator()":
        return getattr(deepspeed.get_accelerator(), rest)
    obj: Any = deepspeed
    for part in rest.split("."):
        try:
            obj = getattr(obj, part)
        except NotProvidedError as refused:
            if not hasattr(obj, "__path__"):
                raise
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")  # a submodule not imported yet
            except ModuleNotFoundError:
                raise refused from None

    return obj


def status(name: str) -> str | None:
    """None when ``name`` works; else what to use instead (possibly empty), from its ``NotProvidedError``."""
    try:
        resolve(name)
    except NotProvidedError as e:
        return getattr(e, "instead", "")
    return None


def markdown_table() -> str:
    lines = ["| DeepSpeed name | used by | here |", "|---|---|---|"]
    for row in SURFACE:
        instead = status(row.name)
        shown = "works" if instead is None else ("refused: " + instead if instead else "refused")
        lines.append(f"| `{row.name}` | {row.used_by} | {shown.replace('|', '/')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
