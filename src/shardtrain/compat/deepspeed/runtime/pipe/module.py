"""DeepSpeed's ``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec`` (``deepspeed/runtime/pipe/module.py``): a
model written as a list of layers, cut into ``num_stages`` stages, each rank building only its own stage's layers.

[Note: a PipelineModule holds one stage]
As in DeepSpeed, the module is cut when it is constructed: the layers are partitioned by ``partition_method`` with
DeepSpeed's arithmetic (:mod:`.partition`), this rank's stage is ``rank // (world // num_stages)`` (DeepSpeed's
``PipeDataParallelTopology``, shardtrain's ``(pp, dp)`` mesh: the same ranks), and only that stage's ``LayerSpec``
layers are built; another stage's are never constructed (under ``"parameters"`` DeepSpeed builds every layer once to
count its parameters; here they are built on the ``meta`` device, which allocates nothing). Built layers are
registered under their index in the whole list (``"3"``, so ``3.weight``), as DeepSpeed names them: the names are the
same at any number of stages, so checkpoints and ``full_state_dict`` speak of the same tensors. ``initialize`` runs
the module as the rank's one pipeline stage (``pipeline_stages`` below) on ``torch.distributed.pipelining``; its
forward is DeepSpeed's: each layer called on the previous one's output.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardtrain.compat.deepspeed.runtime.pipe.partition import partition_balanced, partition_uniform
from shardtrain.compat.deepspeed.unsupported import not_provided
from shardtrain.errors import ConfigError


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)``, built only on the stage that holds it."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}")  # as DeepSpeed
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """The layer, constructed now."""
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose weights several layers share, under ``key``: built once per stage that holds one of them
    (``tied_modules.<key>``), called as ``forward_fn(module, x)`` where given; the ``tied_weight_attr`` parameters'
    gradients are summed across the stages (as DeepSpeed does). Ties between the first and the last stage are built
    ([Note: weights tied across stages] in ``pipeline_parallel/cut.py``); others are refused by name."""

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _dotted_attr(module: nn.Module, path: str) -> nn.Parameter:
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part)
    if not isinstance(value, nn.Parameter):
        raise ConfigError(f"TiedLayerSpec's tied_weight_attr {path!r} is not a parameter of {type(module).__name__}")
    return value


def set_random_seed(seed: int) -> None:
    """DeepSpeed's ``set_random_seed`` (Python's, numpy's and torch's generators), its default ``seed_fn``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _layer_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable_count(layer: Any) -> int:
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # counted, not allocated ([Note: a PipelineModule holds one stage])
            layer = layer.build()
    if not isinstance(layer, nn.Module):
        return 0
    return sum(p.numel() for p in layer.parameters() if p.requires_grad)


def partition_layers(layers: Sequence[Any], num_stages: int, method: str = "parameters") -> list[int]:
    """The ``num_stages + 1`` stage boundaries DeepSpeed's ``PipelineModule._partition_layers`` computes for
    ``layers``: ``"uniform"`` (layer counts), ``"parameters"`` (trainable parameters, balanced), ``"type:REGEX"``
    (the layers whose class name matches, case-insensitively, balanced)."""
    method = method.lower()
    if method == "uniform":
        return partition_uniform(len(layers), num_stages)
    if method == "parameters":
        return partition_balanced([_trainable_count(layer) for layer in layers], num_stages)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":")[1], re.IGNORECASE)
        hits = [int(bool((name := _layer_name(layer)) and pattern.search(name))) for layer in layers]
        if not any(hits):
            raise ConfigError(f"partition_method {method!r}: no layer's class name matches; check the pattern")
        return partition_balanced(hits, num_stages)
    raise ConfigError(
        f"partition_method {method!r} is not implemented (DeepSpeed refuses it too): use 'parameters', 'uniform' "
        "or 'type:REGEX'"
    )


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule``: ``layers`` (modules, :class:`LayerSpec`, callables) cut into ``num_stages``
    stages, this rank's built ([Note: a PipelineModule holds one stage]); ``loss_fn(outputs, labels)`` on the last
    stage (None: the last layer's output is the loss). Give it to ``deepspeed.initialize(model=...)``."""

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        super().__init__()
        refused = [
            (topology is not None, "PipelineModule(topology=...)", "give num_stages: the mesh is (pipe, data)"),
            (
                dynamic_shape,
                "PipelineModule(dynamic_shape=True)",
                "the stages exchange activations of the first step's shapes: pad micro-batches to one shape",
            ),
        ]
        for hit, what, instead in refused:
            if hit:
                raise not_provided(what, instead)
        if num_stages is None or num_stages < 1:
            raise ConfigError(f"PipelineModule needs num_stages >= 1, got {num_stages}")
        if any(isinstance(layer, PipelineModule) for layer in layers):
            raise ConfigError("a PipelineModule inside a PipelineModule's layers: DeepSpeed does not build it either")
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if world % num_stages:
            raise ConfigError(f"num_stages ({num_stages}) must divide the world size ({world}), as in DeepSpeed")
        self.num_stages = num_stages
        self.stage_id = rank // (world // num_stages)
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn or set_random_seed, base_seed
        if activation_checkpoint_interval < 0:
            raise ConfigError(f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}")
        # DeepSpeed's default function is its own reentrant checkpoint; torch's non-reentrant one computes the same
        # values and also gives a chunk whose inputs need no gradient (token ids into an embedding) its gradients
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func or partial(checkpoint, use_reentrant=False)
        self.checkpointable_layers = checkpointable_layers
        self._layer_specs = list(layers)
        self.parts = partition_layers(self._layer_specs, num_stages, partition_method)
        if num_stages > 1 and any(a == b for a, b in zip(self.parts, self.parts[1:])):
            raise ConfigError(
                f"partition_method {partition_method!r} leaves a pipeline stage without layers (boundaries "
                f"{self.parts} for {len(self._layer_specs)} layers): use fewer stages or another partition_method"
            )
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self._tied_stages = self._stages_of_tied_keys()
        self.tied_modules = nn.ModuleDict()  # DeepSpeed's names: tied_modules.<key>.<parameter>
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.forward_funcs: list[Callable] = []
        self._micro_offset = 0
        for index in range(self._local_start, self._local_stop):
            layer = self._layer_specs[index]
            if seed_layers:
                self.seed_fn(base_seed + index)
            if isinstance(layer, TiedLayerSpec):  # one module per key on this stage, as DeepSpeed builds it
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
                continue
            if isinstance(layer, LayerSpec):
                layer = layer.build()
            if isinstance(layer, nn.Module):
                self.add_module(str(index), layer)
            self.forward_funcs.append(layer)

    def forward(self, inputs: Any) -> Any:
        """This stage's layers, each called on the previous one's output (with ``seed_layers``, each reseeded per
        micro-batch by DeepSpeed's rule, ``base_seed * micro_batch + layer``, so dropout draws as DeepSpeed's); with
        ``activation_checkpoint_interval`` k > 0, every k layers checkpointed as one chunk when they hold parameters
        (DeepSpeed's ``_is_checkpointable``), recomputed in backward with the same seeds."""
        self._micro_offset += 1
        micro = self._micro_offset + 1  # the closure's: a recomputation in backward reseeds as the forward did

        def run_range(start: int, stop: int) -> Callable:
            def run(*x: Any) -> Any:
                x = x[0] if len(x) == 1 else x
                for index in range(start, stop):
                    if self.seed_layers:
                        self.seed_fn(self.base_seed * micro + self._local_start + index)
                    x = self.forward_funcs[index](x)
                return x

            return run

        count, interval = len(self.forward_funcs), self.activation_checkpoint_interval
        if interval == 0:
            return run_range(0, count)(inputs)
        x = inputs
        for start in range(0, count, interval):
            stop = min(start + interval, count)
            args = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(self.forward_funcs[start:stop]):
                x = self.activation_checkpoint_func(run_range(start, stop), *args)
            else:
                x = run_range(start, stop)(*args)
        return x

    def _is_checkpointable(self, funcs: list[Callable]) -> bool:
        """DeepSpeed's rule: the chunk's layers are all of ``checkpointable_layers`` where given, else some layer
        of the chunk holds parameters."""
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(any(True for _ in f.parameters()) for f in funcs if isinstance(f, nn.Module))

    def _stages_of_tied_keys(self) -> dict[str, list[int]]:
        """The stages holding each ``TiedLayerSpec`` key; a key on stages other than the first and the last (or on
        one stage alone) is refused by name."""
        stages: dict[str, set[int]] = {}
        for index, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stages.setdefault(layer.key, set()).add(self.stage_owner(index))
        ends = {0, self.num_stages - 1}
        for key, held in stages.items():
            if len(held) > 1 and held != ends:
                raise not_provided(
                    f"TiedLayerSpec {key!r} on pipeline stages {sorted(held)}",
                    "weights tied across the first and the last stage are built (an input embedding and an output "
                    "head); give the other stages their own layer, or change partition_method",
                )
        return {key: sorted(held) for key, held in stages.items()}

    # -- what shardtrain's pipeline asks of a model built as one stage (pipeline_parallel/cut.py) -----------------
    def tied_across_stages(self) -> list[nn.Parameter]:
        """The ``tied_weight_attr`` parameters of this stage's keys that the first and the last stage share, by key
        and attribute: one order on both ([Note: weights tied across stages] in ``pipeline_parallel/cut.py``)."""
        params = []
        for key in sorted(k for k, held in self._tied_stages.items() if len(held) > 1 and k in self.tied_modules):
            for attr in self.tied_weight_attrs[key]:
                params.append(_dotted_attr(self.tied_modules[key], attr))
        return params

    def pipeline_stages(self, num_stages: int, stage_ids: list[int]) -> tuple[list[nn.Module], Callable]:
        """This module as the rank's stage ``stage_ids[0]`` of ``num_stages``, and the last stage's loss."""
        if num_stages != self.num_stages or stage_ids != [self.stage_id]:
            raise ConfigError(
                f"this PipelineModule was built as stage {self.stage_id} of {self.num_stages}, but the engine runs "
                f"stages {stage_ids} of {num_stages} here: pipeline_parallel_size must be num_stages and "
                "pipeline.stages_per_rank 1"
            )
        loss_fn = self.loss_fn
        return [self], (lambda outputs, labels: loss_fn(outputs, labels)) if loss_fn else (lambda outputs, _: outputs)

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that holds layer ``layer_idx``."""
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ValueError(f"layer {layer_idx} is not among the {len(self._layer_specs)} layers")
        return next(s for s in range(self.num_stages) if self.parts[s] <= layer_idx < self.parts[s + 1])

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> list[int]:
        return self.parts


__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "partition_layers", "set_random_seed"]
