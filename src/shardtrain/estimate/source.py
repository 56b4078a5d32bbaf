"""What the planner estimates: a model it can build without allocating weights, and the batch it runs.

A :class:`ModelSource` builds the model on demand under a :class:`~torch._subclasses.fake_tensor.FakeTensorMode`
(shapes, dtypes and devices, no storage), as many times as the planner needs (each layout's tensor-parallel split
cuts parameters in place). It comes from

* a Hugging Face config: a ``config.json`` file, or a directory holding one (``AutoModelForCausalLM.from_config``;
  weights are never read);
* a factory ``"package.module:function"`` (called with no arguments, returns an ``nn.Module``); the module may also
  define ``estimate_batch(micro_batch, seq_len) -> (args, kwargs)`` and ``tp_plan`` (a plan for
  ``tensor_parallel.size > 1``);
* an ``nn.Module`` class or a zero-argument callable, through the API.

The batch: a causal language model's ``input_ids`` and ``labels`` (``[micro_batch, seq_len]`` token ids) for a
Hugging Face model (with ``use_cache=False``, as in training; its output's ``.loss`` is backpropagated);
``(idx, targets)`` positionally for any other model, whose output is the loss when it is a scalar, otherwise summed
(say so with ``estimate_batch`` when that is not how the model is called).
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtrain.errors import ShardtrainError

BatchFn = Callable[[int, int], tuple[tuple, dict]]


@dataclass
class ModelSource:
    """How to build the model (called under fake tensors) and what one micro-batch of it looks like."""

    build: Callable[[], nn.Module]
    name: str
    hf: bool = False
    batch: BatchFn | None = None
    tp_plan: Any = None
    """Tensor-parallel plan for :func:`shardtrain.tensor_parallel.parallelize` (None: a Hugging Face model's own)."""
    vocab_size: int | None = None

    def make_batch(self, micro_batch: int, seq_len: int) -> tuple[tuple, dict]:
        if self.batch is not None:
            return self.batch(micro_batch, seq_len)
        vocab = self.vocab_size or 2
        ids = torch.randint(0, vocab, (micro_batch, seq_len))
        if self.hf:  # training: no key/value cache
            return (), {"input_ids": ids, "labels": ids, "use_cache": False}
        return (ids, torch.randint(0, vocab, (micro_batch, seq_len))), {}


def loss_of(output: Any) -> torch.Tensor:
    """The scalar to backpropagate from a model's output (see the module docstring)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        output = output[0]
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else output.float().sum()
    raise ShardtrainError(
        f"estimate: the model returned {type(output).__name__}, not a loss or a tensor; define "
        "estimate_batch(micro_batch, seq_len) returning inputs for which it returns its loss"
    )


def resolve_source(spec: str | Path | nn.Module | Callable[[], nn.Module] | ModelSource) -> ModelSource:
    """A :class:`ModelSource` from a path (HF config file or directory), ``"module:function"`` or a callable."""
    if isinstance(spec, ModelSource):
        return spec
    if isinstance(spec, nn.Module):
        raise ShardtrainError(
            "estimate: pass a way to build the model (its class with no arguments, a zero-argument function, a "
            "'module:function' string or a Hugging Face config path), not a built model: the planner builds it on "
            "fake tensors, once per tensor-parallel layout, so that no weights are allocated"
        )
    if callable(spec):
        return _from_callable(spec, getattr(spec, "__name__", type(spec).__name__), None)
    text = str(spec)
    path = Path(text)
    if path.exists():
        return _from_hf_config(path)
    if re.fullmatch(r"[\w.]+:[\w.]+", text):
        module_name, _, attr = text.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ShardtrainError(f"estimate: cannot import {module_name!r} for the factory {text!r}: {err}") from None
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise ShardtrainError(f"estimate: {module_name!r} has no callable {attr!r} (the factory {text!r})")
        return _from_callable(factory, text, module)
    raise ShardtrainError(
        f"estimate: model {text!r} is neither an existing path (a Hugging Face config.json or a directory holding "
        "one) nor a factory 'package.module:function'"
    )


def _from_callable(factory: Callable[[], nn.Module], name: str, module: Any) -> ModelSource:
    source = ModelSource(build=factory, name=name)
    if module is not None:
        source.batch = getattr(module, "estimate_batch", None)
        source.tp_plan = getattr(module, "tp_plan", None)
    return source


def _from_hf_config(path: Path) -> ModelSource:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ShardtrainError(f"estimate: {str(path)!r} is a directory without config.json (a Hugging Face model)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ShardtrainError(f"estimate: {str(file)!r} is not valid JSON: {err}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ShardtrainError(f"estimate: {str(file)!r} has no model_type: not a Hugging Face model config")
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(str(file.parent))

    def build() -> nn.Module:
        # a config of its own per model: the planner builds several, and sequence parallelism changes a model's
        # config (its attention implementation)
        return AutoModelForCausalLM.from_config(copy.deepcopy(hf_config))

    vocab = getattr(hf_config, "vocab_size", None) or getattr(getattr(hf_config, "text_config", None), "vocab_size", 2)
    return ModelSource(build=build, name=f"{data['model_type']} ({file})", hf=True, vocab_size=vocab)
