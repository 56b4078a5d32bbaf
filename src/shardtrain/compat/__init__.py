"""Other people's APIs on the engine: the DeepSpeed shim (:mod:`.deepspeed`, public as ``shardtrain.deepspeed``),
Hugging Face loading (:mod:`.hf_pretrained`), and the Trainer and TRL integrations (:mod:`.hf_trainer`,
:mod:`.trl_trainers`, public under ``shardtrain.integrations``). Each imports its framework only when used."""

import importlib
import pkgutil
import sys
from types import ModuleType


def expose(public: str, real: str) -> ModuleType:
    """Import ``real`` and register it, and each of its submodules, under the public name ``public`` as well.

    A public module calls this and puts the result in ``sys.modules`` in its own place: importing either name then
    gives the same module objects (no module runs twice, ``isinstance`` and ``monkeypatch`` see one class)."""
    module = importlib.import_module(real)
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        # subpackages too (``deepspeed.utils.zero_to_fp32``), at every depth
        sys.modules[f"{public}.{info.name}"] = expose(f"{public}.{info.name}", f"{real}.{info.name}")
    return module
