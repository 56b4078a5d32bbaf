"""Consolidation of a peft run: the merged model ``from_pretrained`` opens, or the adapters alone that
``PeftModel.from_pretrained`` opens.

The checkpoint holds the ``PeftModel``'s tensors under their own names and the configs that name them ([Note: a
peft run in a checkpoint] in ``hf_config.py``). Both outputs start the same way: the base model is built from its
config on the meta device (no memory, no weights) and wrapped with ``peft.get_peft_model``, so that peft itself
says which module is an adapter layer and what its tensors are called. Nothing of peft's layout is written down
here.

[Note: merging one layer at a time]
``PeftModel.merge_and_unload`` needs the whole model in memory; it replaces each outermost peft module (a tuner layer
such as ``lora.Linear``, or a wrapper such as ``ModulesToSaveWrapper``) by its merged base layer
(``unload_and_optionally_merge_module`` where it exists, else ``merge()`` and ``get_base_layer()``). We do the same per
module, alone: a copy of the meta module gets its checkpoint tensors (``load_state_dict(assign=True)``, each in its
stored dtype), peft merges it, and its base layer's state dict is written under the module's name without
``base_model.model.``. On meta tensors this gives the streaming header, on real ones the values; memory is one module's
tensors ([Note: streaming] in ``consolidate.py``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardtrain.checkpoint.format import TensorEntry
from shardtrain.checkpoint.reader import CheckpointReader
from shardtrain.errors import CheckpointError

PEFT_PREFIX = "base_model.model."
# (output name, shape, dtype, load: the tensor, whole, in that dtype)
Output = tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]


def peft_configs(reader: CheckpointReader, text: str) -> tuple[dict[str, dict], list[str], str]:
    """The adapters' configs (name -> adapter_config.json content), the active adapters' names, and the prefix of
    the checkpoint's names (``base_model.model.`` for a ``PeftModel``, nothing after transformers' ``add_adapter``)."""
    try:
        data = json.loads(text)
        adapters, active, prefix = data["adapters"], data["active_adapters"], data.get("prefix", PEFT_PREFIX)
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CheckpointError(f"{reader.path}: the peft config object is not what shardtrain writes") from None
    return adapters, active, prefix


def meta_peft_model(reader: CheckpointReader, hf_config_text: str | None, adapters: dict, active: list[str]) -> Any:
    """The ``PeftModel`` the run trained, on the meta device: built from the base model's config and the adapters'."""
    try:
        import peft
        import transformers
    except ImportError as err:
        raise CheckpointError(f"consolidating a peft run needs transformers and peft ({err})") from None
    if hf_config_text is None:
        raise CheckpointError(f"{reader.path}: a peft run without its base model's config; nothing was written")
    data = json.loads(hf_config_text)
    arch = (data.get("architectures") or [None])[0]
    model_cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if model_cls is None:
        raise CheckpointError(
            f"{reader.path}: the base model's class {arch!r} is not one transformers provides, so its modules cannot "
            "be rebuilt to merge the adapters; nothing was written"
        )
    data.pop("architectures")
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    configs = {name: peft.PeftConfig.from_peft_type(**cfg) for name, cfg in adapters.items()}
    first, *others = configs
    with torch.device("meta"):
        base = model_cls._from_config(config)
        model = peft.get_peft_model(base, configs[first], adapter_name=first, low_cpu_mem_usage=True)
        for name in others:
            model.add_adapter(name, configs[name], low_cpu_mem_usage=True)
    if not configs[first].is_prompt_learning:
        model.base_model.set_adapter(active if len(active) > 1 else active[0])
    return model


def merged_outputs(reader: CheckpointReader, model: Any, prefix: str, dtype: torch.dtype | None) -> list[Output]:
    """Every tensor of the merged model, in the manifest's order; ``prefix`` as :func:`peft_configs` gives it.

    See [Note: merging one layer at a time]. ``dtype`` converts floating-point tensors, as elsewhere."""
    if any(cfg.is_prompt_learning for cfg in model.peft_config.values()):
        kinds = sorted({str(cfg.peft_type.value) for cfg in model.peft_config.values() if cfg.is_prompt_learning})
        raise CheckpointError(
            f"{reader.path}: the adapter type {', '.join(kinds)} adds virtual tokens, not weights, so it cannot be "
            "merged into the base model; write it with --adapters-only (PeftModel.from_pretrained opens it); "
            "nothing was written"
        )
    try:
        model.base_model._check_merge_allowed()  # peft's own refusals (e.g. an adapter type that cannot merge)
    except (ValueError, NotImplementedError, AttributeError) as err:
        raise CheckpointError(f"{reader.path}: peft cannot merge these adapters: {err}; nothing was written") from None
    by_name = _model_entries(reader, prefix)
    groups = _peft_modules(model)
    group_of: dict[str, str] = {}  # tensor name in the PeftModel -> the peft module it belongs to
    for path, module in groups.items():
        for key in _inputs(module, path, by_name, reader):
            group_of[f"{path}.{key}"] = path
    outs: list[Output] = []
    done: set[str] = set()
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def convert(t: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point else t

    for name, entry in by_name.items():
        if name != _peft_name(entry.name, prefix):  # an alias: written once, under its primary name
            continue
        path = group_of.get(name)
        if path is None:
            target = convert(entry.torch_dtype)
            outs.append((_strip(reader, name), entry.global_shape, target, _reader(reader, entry, target)))
            continue
        if path in done:
            continue
        done.add(path)
        inputs = _inputs(groups[path], path, by_name, reader)
        meta = {k: torch.empty(e.global_shape, dtype=e.torch_dtype, device="meta") for k, e in inputs.items()}
        for key, t in _merge(groups[path], meta, path, reader).items():
            load = _merged(reader, groups[path], path, key, by_name, cache, convert(t.dtype))
            outs.append((_strip(reader, f"{path}.{key}"), tuple(t.shape), convert(t.dtype), load))
    return outs


def _model_entries(reader: CheckpointReader, prefix: str) -> dict[str, TensorEntry]:
    """Every model tensor by its name in the ``PeftModel`` (``model/`` removed, ``prefix`` replaced by
    ``base_model.model.``), primary names first, then aliases."""
    model = [e for e in reader.manifest.tensors.values() if e.name.startswith("model/")]
    by_name = {_peft_name(e.name, prefix): e for e in model}
    for e in model:
        by_name |= {_peft_name(a, prefix): e for a in e.aliases}
    return by_name


def _peft_name(name: str, prefix: str) -> str:
    name = name.removeprefix("model/")
    return PEFT_PREFIX + name[len(prefix) :] if name.startswith(prefix) else name


def _strip(reader: CheckpointReader, name: str) -> str:
    if not name.startswith(PEFT_PREFIX):
        raise CheckpointError(f"{reader.path}: tensor {name!r} is not under {PEFT_PREFIX!r} as in a peft model")
    return name[len(PEFT_PREFIX) :]


def _reader(reader: CheckpointReader, entry: TensorEntry, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    return lambda: reader.read(entry.name, dtype=dtype)


def _peft_modules(model: Any) -> dict[str, nn.Module]:
    """The outermost modules ``merge_and_unload`` replaces (see [Note: merging one layer at a time])."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if any(path.startswith(f"{p}.") for p in found):
            continue
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            found[path] = module
    return found


def _inputs(module: nn.Module, path: str, by_name: dict[str, TensorEntry], reader: CheckpointReader) -> dict:
    inputs = {}
    for key in module.state_dict(keep_vars=True):
        if f"{path}.{key}" not in by_name:
            raise CheckpointError(
                f"{reader.path}: tensor {path}.{key!r} of the peft model is not in the checkpoint; nothing was written"
            )
        inputs[key] = by_name[f"{path}.{key}"]
    return inputs


def _merge(module: nn.Module, tensors: dict[str, torch.Tensor], path: str, reader: CheckpointReader) -> dict:
    """``module`` merged as ``merge_and_unload`` merges it, from ``tensors``: its base layer's state dict."""
    module = copy.deepcopy(module)  # the meta model's module stays as it is
    module.load_state_dict(tensors, assign=True)
    try:
        if hasattr(module, "unload_and_optionally_merge_module"):
            merged = module.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=None)
        else:
            module.merge(safe_merge=False)
            merged = module.get_base_layer()
    except (ValueError, NotImplementedError, RuntimeError) as err:
        raise CheckpointError(
            f"{reader.path}: peft cannot merge module {path.removeprefix(PEFT_PREFIX)!r} "
            f"({type(module).__name__}): {err}; nothing was written"
        ) from None
    return {k: v.detach() for k, v in merged.state_dict().items()}


def _merged(
    reader: CheckpointReader,
    module: nn.Module,
    path: str,
    key: str,
    by_name: dict[str, TensorEntry],
    cache: dict[str, dict[str, torch.Tensor]],
    dtype: torch.dtype,
) -> Callable[[], torch.Tensor]:
    """Load for one output tensor of a merged module; the module is merged once, when its first tensor is asked
    for, and only the last merged module is kept."""

    def load() -> torch.Tensor:
        if path not in cache:
            cache.clear()
            real = {k: reader.read(e.name) for k, e in _inputs(module, path, by_name, reader).items()}
            cache[path] = _merge(module, real, path, reader)
        return cache[path][key].to(dtype)

    return load


def adapter_outputs(reader: CheckpointReader, model: Any, prefix: str, adapter: str) -> list[Output]:
    """The tensors ``PeftModel.save_pretrained`` writes for ``adapter``, named as it names them.

    peft's ``get_peft_model_state_dict`` is given the meta model's state dict, so it picks and renames the
    adapter's tensors itself; each one it returns is then found again by identity and read from the checkpoint.
    A prompt-learning adapter saves what its prompt encoder computes (``prompt_embeddings``): the encoder, small,
    is given its tensors from the checkpoint first, and what peft computes from them is written as it is."""
    from peft import get_peft_model_state_dict

    by_name = _model_entries(reader, prefix)
    if model.peft_config[adapter].is_prompt_learning:
        encoder = model.prompt_encoder[adapter]
        path = f"prompt_encoder.{adapter}"
        real = {k: reader.read(e.name) for k, e in _inputs(encoder, path, by_name, reader).items()}
        encoder.load_state_dict(real, assign=True)
    state = model.state_dict(keep_vars=True)
    source = {id(t): name for name, t in state.items()}
    with torch.no_grad():
        picked = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)
    outs = []
    for out_name, t in picked.items():
        name = source.get(id(t))
        if name in by_name:
            entry = by_name[name]
            outs.append((out_name, entry.global_shape, entry.torch_dtype, _reader(reader, entry, entry.torch_dtype)))
        elif not t.is_meta:  # computed by peft from tensors read above
            outs.append((out_name, tuple(t.shape), t.dtype, lambda t=t: t.detach().contiguous()))
        else:
            raise CheckpointError(
                f"{reader.path}: adapter tensor {out_name!r} is not in the checkpoint; nothing was written"
            )
    return outs
