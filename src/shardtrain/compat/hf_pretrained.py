"""Hugging Face ``transformers`` models in: :func:`from_pretrained` builds a sharded engine from a pretrained
directory. (Out: :mod:`shardtrain.checkpoint.hf_config` is what ``engine.save_checkpoint`` keeps of a model's HF
configuration, so that ``shardtrain checkpoint consolidate`` writes a directory ``AutoModelForCausalLM.from_pretrained``
opens.)

``transformers`` is imported only when the model (or the call) is a ``transformers`` one: plain PyTorch users never
pay for it, and it is not a dependency of the package.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtrain.checkpoint.hf_config import hf_config_objects
from shardtrain.compat.hf_keys import hf_key_mapper
from shardtrain.config.sections import Config, load_config
from shardtrain.engine.engine import Engine, OptimizerArg, SchedulerArg, initialize
from shardtrain.errors import ShardtrainError

__all__ = ["from_pretrained", "hf_config_objects"]


def _check_pretrained_dir(path: Path) -> None:
    if not path.is_dir():
        raise ShardtrainError(f"from_pretrained: {str(path)!r} is not a directory (a save_pretrained output)")
    if not (path / "config.json").is_file():
        raise ShardtrainError(
            f"from_pretrained: {str(path)!r} has no config.json; pass a directory written by save_pretrained or by "
            "`shardtrain checkpoint consolidate` from a transformers model"
        )
    if not (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").is_file():
        other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (it holds {', '.join(other)}: save_pretrained writes safetensors)" if other else ""
        raise ShardtrainError(
            f"from_pretrained: {str(path)!r} holds neither model.safetensors nor model.safetensors.index.json{hint}"
        )


def _build(model_cls: Any, hf_config: Any, dtype: torch.dtype, model_kwargs: Mapping[str, Any]) -> nn.Module:
    """A randomly initialized model from ``hf_config``: ``Cls._from_config`` for a model class (it applies
    ``dtype`` and the attention implementation as ``from_pretrained`` does), ``Auto.from_config`` for an Auto class."""
    if hasattr(model_cls, "_from_config"):
        return model_cls._from_config(hf_config, dtype=dtype, **model_kwargs)
    if hasattr(model_cls, "from_config"):
        return model_cls.from_config(hf_config, dtype=dtype, **model_kwargs)
    raise TypeError(
        f"from_pretrained expects a transformers model class (e.g. LlamaForCausalLM) or an Auto class "
        f"(e.g. AutoModelForCausalLM), got {model_cls!r}"
    )


def from_pretrained(
    model_cls: Any,
    path: str | Path,
    config: Config | Mapping[str, Any] | str | Path | None = None,
    optimizer: OptimizerArg = None,
    lr_scheduler: SchedulerArg = None,
    *,
    dtype: torch.dtype = torch.float32,
    strict: bool = True,
    model_kwargs: Mapping[str, Any] | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    key_mapping: Mapping[str, str] | None = None,
) -> Engine:
    """Build ``model_cls`` from the pretrained directory ``path``, wrap it with :func:`initialize` and load its weights.

    Collective: every rank calls it with the same arguments. ``model_cls`` is a transformers model class
    (``GPT2LMHeadModel``) or an Auto class (``AutoModelForCausalLM``). At ZeRO stage 3 the model is built under
    :class:`shardtrain.zero.Init`, so no rank ever holds it whole; each rank then reads from the safetensors files only
    the rows covering what it holds (:meth:`Engine.load_full_state_dict`). With ``tensor_parallel.size`` > 1 or
    ``expert_parallel_size`` > 1 (any stage) it is built under ``zero.Init(config)``, on ``meta``, and each rank
    reads only its tensor-parallel blocks and its experts (docs/sharded-construction.md). Tied weights are loaded
    once, under any of their names. ``generation_config.json`` is loaded when present.

    Keys are read as transformers' own ``from_pretrained`` reads them (:mod:`shardtrain.compat.hf_keys`): its
    renamings (``embed_out`` -> ``lm_head``, ViT's ``encoder.layer``, ``block_sparse_moe``), its ``base_model_prefix``
    handling and its converters (per-expert ``experts.N.w1`` tensors stacked into one fused tensor, each rank reading
    only the experts it holds). ``key_mapping``: as transformers' argument (regex -> replacement, applied first).

    ``dtype``: the parameters' dtype (HF's ``torch_dtype``/``dtype``); stored values are cast to it. Keep the default
    float32 with ``bf16``/``fp16`` in the config: shardtrain makes fp32 masters and casts the compute copy itself.
    ``strict``: missing or unexpected weights are an error naming them; with ``strict=False`` a warning names every
    weight that keeps its initial value and every stored tensor left unloaded. ``model_kwargs`` go to
    ``from_config`` (e.g. ``attn_implementation="sdpa"``). ``tp_plan``: as for :func:`~shardtrain.initialize`
    (default: the model's own plan). Returns the engine; the model is ``engine.module``.
    """
    path = Path(path)
    _check_pretrained_dir(path)  # before any collective: every rank sees the same files and fails alike
    cfg = load_config(config)
    from transformers import AutoConfig, GenerationConfig

    hf_config = AutoConfig.from_pretrained(str(path))
    if cfg.zero_optimization.stage == 3 or cfg.tensor_parallel.degree > 1 or cfg.expert_parallel_size > 1:
        from shardtrain.construction.sharded_init import Init

        with Init(cfg):  # deferred (on meta) with tensor or expert parallelism: each rank makes only its blocks
            model = _build(model_cls, hf_config, dtype, model_kwargs or {})
    else:
        model = _build(model_cls, hf_config, dtype, model_kwargs or {})
    if (path / "generation_config.json").is_file() and getattr(model, "can_generate", lambda: False)():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    engine = initialize(model, config=cfg, optimizer=optimizer, lr_scheduler=lr_scheduler, tp_plan=tp_plan)
    engine.load_full_state_dict(path, strict=strict, key_map=hf_key_mapper(model, key_mapping))
    return engine
