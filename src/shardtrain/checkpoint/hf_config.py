"""What a checkpoint keeps of a Hugging Face ``transformers`` model's configuration (engine layer, below
:mod:`shardtrain.compat.hf_pretrained`, so that ``engine_checkpoint`` can use it without importing the engine's users).

``transformers`` is never imported here: a model is recognized by its config's class MRO (module name and class
name), so plain PyTorch users never pay for it and it stays an optional dependency.
"""

from __future__ import annotations

import json
from typing import Any

from torch import nn

from shardtrain.checkpoint.consolidate import HF_CONFIG_KEY, HF_GENERATION_CONFIG_KEY


def _is_transformers_class(obj: Any, *names: str) -> bool:
    """True when a class in ``type(obj)``'s MRO is one of transformers' ``names`` (no import of transformers)."""
    return any(c.__module__.startswith("transformers.") and c.__name__ in names for c in type(obj).__mro__)


def hf_config_objects(module: nn.Module) -> dict[str, str]:
    """The module's HF config (and generation config) as JSON text, or ``{}`` when it is not a transformers model.

    Global checkpoint objects: the text ``save_pretrained`` would write, except ``dtype``, which consolidation sets
    to the dtype it writes the weights in (see [Note: engine checkpoint contents]).

    ``architectures`` is set to the module's class name, as ``save_pretrained`` does, so that the Auto classes
    pick the right head when the consolidated directory is opened."""
    config = getattr(module, "config", None)
    if not _is_transformers_class(config, "PreTrainedConfig", "PretrainedConfig"):
        return {}
    data = json.loads(config.to_json_string(use_diff=True))
    data["architectures"] = [type(module).__name__]
    objects = {HF_CONFIG_KEY: json.dumps(data, indent=2, sort_keys=True)}
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", lambda: False)
    if _is_transformers_class(generation, "GenerationConfig") and can_generate():
        gen = json.loads(generation.to_json_string(use_diff=True))
        gen.pop("compile_config", None)  # save_pretrained drops it too (runtime-only setting)
        objects[HF_GENERATION_CONFIG_KEY] = json.dumps(gen, indent=2, sort_keys=True)
    return objects
