"""What a checkpoint keeps of a Hugging Face ``transformers`` model's configuration (engine layer, below
:mod:`shardtrain.compat.hf_pretrained`, so that ``engine_checkpoint`` can use it without importing the engine's users).

``transformers`` and ``peft`` are never imported here: a model is recognized by its config's class MRO (module name
and class name), so plain PyTorch users never pay for them and they stay optional dependencies.

[Note: a peft run in a checkpoint]
A ``peft.PeftModel`` is saved under its own parameter names (``base_model.model.<name>.base_layer.weight``,
``...lora_A.<adapter>.weight``). The checkpoint keeps the base model's config (the base class in ``architectures``, not
``PeftModelForCausalLM``) and every adapter's config as ``PeftModel.save_pretrained`` writes it, with the active
adapters' names (:data:`PEFT_CONFIG_KEY`). Adapters added with transformers' ``add_adapter`` are kept the same way;
their names lack ``base_model.model.``, and the object says so. From these, consolidation rebuilds the module tree on
the meta device and asks peft which tensors are adapters and how they merge (``checkpoint/peft_consolidate.py``).
"""

from __future__ import annotations

import json
from typing import Any

from torch import nn

from shardtrain.checkpoint.consolidate import HF_CONFIG_KEY, HF_GENERATION_CONFIG_KEY, PEFT_CONFIG_KEY


def _is_transformers_class(obj: Any, *names: str) -> bool:
    """True when a class in ``type(obj)``'s MRO is one of transformers' ``names`` (no import of transformers)."""
    return any(c.__module__.startswith("transformers.") and c.__name__ in names for c in type(obj).__mro__)


def _is_peft_class(obj: Any, *names: str) -> bool:
    return any(c.__module__.startswith("peft.") and c.__name__ in names for c in type(obj).__mro__)


def peft_config_text(model: Any) -> str:
    """JSON text ``{"adapters": {name: adapter_config.json content}, "active_adapters": [name, ...], "prefix":
    ...}``; ``prefix`` is what the model's parameter names start with before the base model's own names
    (``base_model.model.`` for a ``PeftModel``, nothing for adapters added with transformers' ``add_adapter``).

    Each adapter's config is what ``save_pretrained`` writes. A ``PeftModel``'s: ``to_dict()`` with sets as lists,
    the base model's ``name_or_path`` when the config has none, ``inference_mode`` true, and ``auto_mapping`` (the
    base model's class) when there is no task type. A transformers model's: ``to_dict()`` as it is."""
    peft_model = _is_peft_class(model, "PeftModel")
    base = model.get_base_model() if peft_model else model
    adapters = {}
    for name, cfg in model.peft_config.items():
        data = {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.to_dict().items()}
        if peft_model:
            if data.get("base_model_name_or_path") is None:
                data["base_model_name_or_path"] = base.__dict__.get("name_or_path") or None
            data["inference_mode"] = True
            if cfg.task_type is None:
                cls = model._get_base_model_class(is_prompt_tuning=cfg.is_prompt_learning)
                data["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
        adapters[name] = data
    active = list(model.active_adapters if peft_model else model.active_adapters())
    prefix = "base_model.model." if peft_model else ""
    return json.dumps({"adapters": adapters, "active_adapters": active, "prefix": prefix}, sort_keys=True)


def hf_config_objects(module: nn.Module) -> dict[str, str]:
    """The module's HF config (and generation config) as JSON text, or ``{}`` when it is not a transformers model.

    Global checkpoint objects: the text ``save_pretrained`` would write, except ``dtype``, which consolidation sets
    to the dtype it writes the weights in (see [Note: engine checkpoint contents]).

    ``architectures`` is set to the module's class name, as ``save_pretrained`` does, so that the Auto classes
    pick the right head when the consolidated directory is opened. A peft model adds its adapters' configs (see
    [Note: a peft run in a checkpoint])."""
    config = getattr(module, "config", None)
    if not _is_transformers_class(config, "PreTrainedConfig", "PretrainedConfig"):
        return {}
    peft_model = _is_peft_class(module, "PeftModel")
    data = json.loads(config.to_json_string(use_diff=True))
    data["architectures"] = [type(module.get_base_model() if peft_model else module).__name__]
    objects = {HF_CONFIG_KEY: json.dumps(data, indent=2, sort_keys=True)}
    if peft_model or getattr(module, "_hf_peft_config_loaded", False):  # a PeftModel, or transformers' add_adapter
        objects[PEFT_CONFIG_KEY] = peft_config_text(module)
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", lambda: False)
    if _is_transformers_class(generation, "GenerationConfig") and can_generate():
        gen = json.loads(generation.to_json_string(use_diff=True))
        gen.pop("compile_config", None)  # save_pretrained drops it too (runtime-only setting)
        objects[HF_GENERATION_CONFIG_KEY] = json.dumps(gen, indent=2, sort_keys=True)
    return objects
