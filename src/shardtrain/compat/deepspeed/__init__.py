"""DeepSpeed's training API on shardtrain: ``import shardtrain.deepspeed as deepspeed`` runs a DeepSpeed script.

    import shardtrain.compat.deepspeed as deepspeed     # was: import deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()
    deepspeed.init_distributed()
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config, enabled=stage == 3):
        model = Model()
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                                model_parameters=model.parameters(),
                                                                training_data=dataset)
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

The config is the same DeepSpeed JSON (read by :func:`shardtrain.config.sections.load_config`); the optimizer and the LR
scheduler are built from its sections as DeepSpeed builds them. Names of DeepSpeed's API that are not provided raise
:class:`~shardtrain.deepspeed.unsupported.NotProvidedError` naming them (docs/migration-deepspeed.md lists both).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from shardtrain.compat.accelerate import check_accelerate_world
from shardtrain.compat.deepspeed import accelerator, checkpoint, comm, pipe, runtime, utils, zero  # noqa: F401  deepspeed.comm, ...
from shardtrain.compat.deepspeed.accelerator import get_accelerator  # noqa: F401  `from deepspeed import ...`
from shardtrain.compat.deepspeed.comm import init_distributed
from shardtrain.compat.deepspeed.engine import DeepSpeedEngine
from shardtrain.compat.deepspeed.runtime.pipe import PipelineEngine, PipelineModule
from shardtrain.compat.deepspeed.unsupported import NotProvidedError, install_refused_imports, not_provided
from shardtrain.config.sections import load_config, optimizer_class_and_kwargs
from shardtrain.engine import Engine
from shardtrain.engine import initialize as initialize_engine
from shardtrain.errors import ConfigError
from shardtrain.optim.deepspeed_muon import DeepSpeedMuon

install_refused_imports()  # `from deepspeed.ops.adam import X` says what to use instead (see RefusedImports)

__all__ = [
    "DeepSpeedEngine",
    "NotProvidedError",
    "PipelineEngine",
    "PipelineModule",
    "add_config_arguments",
    "init_distributed",
    "initialize",
    "zero",
]

ConfigArg = Mapping[str, Any] | str | os.PathLike | None


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: ``--deepspeed``, ``--deepspeed_config PATH`` (and the old ``--deepscale``
    names); returns ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (always on here)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


__version__ = "0.19.8"
"""The DeepSpeed release whose API this module follows (scripts compare it to pick code paths)."""


def _raw_config(config: ConfigArg) -> dict[str, Any]:
    """The config as written (for the keys only this module reads, e.g. ``dataloader_drop_last``)."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    return json.loads(Path(config).read_text())


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: ConfigArg = None,
    config_params: ConfigArg = None,
) -> tuple[DeepSpeedEngine, torch.optim.Optimizer, DataLoader | None, Any]:
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    The config comes from ``config`` (a dict or a JSON path), ``config_params`` (its old name) or
    ``args.deepspeed_config``; giving it two ways is an error, as in DeepSpeed. With an ``optimizer`` section the
    optimizer is built over ``model_parameters`` (param groups kept; default: the model's trainable parameters);
    with a ``scheduler`` section the scheduler is built on it. ``training_data``: a map-style dataset, batched by
    ``train_micro_batch_size_per_gpu`` over a ``DistributedSampler`` as DeepSpeed's loader does. A
    :class:`~shardtrain.deepspeed.pipe.PipelineModule` gives a :class:`PipelineEngine` (``train_batch``), its
    ``num_stages`` the config's ``pipeline_parallel_size``."""
    if model is None:
        raise ValueError("deepspeed.initialize: model is required")
    if mpu is not None:
        raise not_provided(
            "deepspeed.initialize(mpu=...)",
            "tensor parallelism is shardtrain's own: set tensor_parallel.size in the config (docs/tensor-parallel.md)",
        )
    if config is not None and config_params is not None:
        raise ValueError("deepspeed.initialize: pass config or config_params, not both")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise ValueError(
            "deepspeed.initialize: a config was given both in args.deepspeed_config and as config=...; keep one"
        )
    config = config if config is not None else from_args
    if config is None:
        raise ValueError(
            "deepspeed.initialize: no config: pass config=<dict or JSON path> or args with --deepspeed_config"
        )
    if dist_init_required is False and not dist.is_initialized():
        raise ValueError("deepspeed.initialize(dist_init_required=False) but no process group exists: create one first")
    cfg = load_config(config)  # initialize() joins the process group (with the config's timeout) if needed
    if isinstance(model, PipelineModule):
        cfg = _pipeline_config(cfg, model)
    check_accelerate_world()  # under accelerate: its count of processes is the launcher's
    if cfg.train_batch_size is None and cfg.train_micro_batch_size_per_gpu is None:
        # shardtrain.initialize takes micro-batch 1 there; a DeepSpeed script gets DeepSpeed's refusal
        raise ConfigError(
            "deepspeed.initialize: the config gives neither train_batch_size nor train_micro_batch_size_per_gpu; "
            "DeepSpeed refuses it too: give one of them (the third follows from the others and the world size)"
        )
    built_optimizer = optimizer
    if optimizer is None and cfg.optimizer is not None and model_parameters is not None:
        # DeepSpeed builds the config's optimizer over model_parameters (which may be param groups)
        cls, kwargs = optimizer_class_and_kwargs(cfg.optimizer)
        groups = list(model_parameters)
        if cls is DeepSpeedMuon:  # DeepSpeed tags each parameter of the model (use_muon) before splitting groups
            built_optimizer = DeepSpeedMuon.from_config(model, groups, kwargs)
        else:
            built_optimizer = cls(groups, **kwargs)
        cfg = cfg.model_copy(update={"optimizer": None})
    elif callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer) and model_parameters is not None:
        groups = list(model_parameters)
        built_optimizer = lambda _params: optimizer(groups)  # noqa: E731  DeepSpeed calls it with model_parameters
    engine = initialize_engine(model, config=cfg, optimizer=built_optimizer, lr_scheduler=lr_scheduler)
    zero.register_engine(engine)
    loader = None
    if training_data is not None:
        loader = _data_loader(engine, training_data, collate_fn, _raw_config(config).get("dataloader_drop_last", False))
    adapter = (PipelineEngine if isinstance(model, PipelineModule) else DeepSpeedEngine)(engine, loader, config)
    return adapter, engine.optimizer, loader, engine.lr_scheduler


def _pipeline_config(cfg: Any, model: PipelineModule) -> Any:
    """The config with the module's ``num_stages`` as ``pipeline_parallel_size`` (DeepSpeed reads the stages from
    the module; a config that says otherwise is refused)."""
    given = cfg.pipeline_parallel_size if "pipeline_parallel_size" in cfg.model_fields_set else None
    if given is not None and given != model.num_stages:
        raise ConfigError(
            f"the config's pipeline_parallel_size {given} and the PipelineModule's num_stages {model.num_stages} "
            "differ: leave pipeline_parallel_size out (the module's num_stages is used)"
        )
    if model.num_stages == 1:
        raise not_provided(
            "a PipelineModule with num_stages=1",
            "train it as a plain module (engine(x), backward, step) or with num_stages >= 2",
        )
    return cfg.model_copy(update={"pipeline_parallel_size": model.num_stages})


def _data_loader(engine: Engine, data: Dataset, collate_fn: Callable | None, drop_last: bool) -> DataLoader:
    """DeepSpeed's training loader: micro-batches of this data-parallel rank's share (``DistributedSampler``,
    shuffled with its default seed, the same order every epoch as DeepSpeed does not call ``set_epoch``); read in
    the main process, where DeepSpeed starts two workers (the same batches)."""
    if isinstance(data, IterableDataset) or not hasattr(data, "__len__"):
        raise not_provided(
            "deepspeed.initialize(training_data=<an iterable dataset>)",
            "pass a map-style Dataset, or build your own DataLoader and leave training_data out",
        )
    topo = engine.topology
    sampler = DistributedSampler(data, num_replicas=topo.dp, rank=topo.dp_rank)
    return DataLoader(
        data,
        batch_size=engine.micro_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        pin_memory=engine.device.type == "cuda",
    )


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module 'shardtrain.deepspeed' has no attribute {name!r}")
    instead = {
        "checkpointing": "use torch.utils.checkpoint for activation checkpointing",
        "ops": "DeepSpeed's fused kernels are not provided: the config's Adam/AdamW are torch's (torch_adam)",
        "moe": "DeepSpeed-MoE's layer is not provided: train a transformers MoE model with expert_parallel_size; "
        "the config's `moe` section reads the layer's arguments (ep_size, drop_tokens, ...: docs/expert-parallel.md)",
        "init_inference": "inference engines are not built: use the model directly",
        "runtime": "DeepSpeed's internals are not provided: the engine is deepspeed.DeepSpeedEngine, the schedulers "
        "are built from the config's scheduler section, the ZeRO-3 state of a parameter is shardtrain's own "
        "(gather with deepspeed.zero.GatheredParameters)",
        "tp_model_init": "tensor parallelism is set in the config: tensor_parallel.size (docs/tensor-parallel.md)",
        "module_inject": "kernel injection is not built: use the model as it is",
        "replace_transformer_layer": "kernel injection is not built: use the model as it is",
        "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernels are not provided: use the model's layers",
        "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernels are not provided: use the model's layers",
        "DeepSpeedConfig": "read a config with shardtrain.config.load_config (validated, with DeepSpeed's keys)",
        "launcher": "launch with torchrun (docs/migration-deepspeed.md)",
    }.get(name, "")
    raise not_provided(f"deepspeed.{name}", instead)
