"""Hugging Face ``transformers.Trainer`` on shardtrain: :class:`ShardtrainTrainerMixin` and :class:`ShardtrainTrainer`.

A run written for ``Trainer(model, args=TrainingArguments(..., deepspeed="ds_config.json"), ...)`` becomes::

    from shardtrain.compat.hf_trainer import ShardtrainTrainer

    trainer = ShardtrainTrainer(model, args=TrainingArguments(...), ..., shardtrain_config="ds_config.json")

The same DeepSpeed JSON is read, with its ``"auto"`` values filled from ``TrainingArguments`` as transformers fills
them for DeepSpeed (see :func:`auto_values_from_args`), and a value that contradicts an argument is an error naming
both. Any subclass of ``Trainer`` (TRL's trainers, your own) gets the same by putting the mixin first:
``class MySFTTrainer(ShardtrainTrainerMixin, SFTTrainer)``. See docs/migration-hf-trainer.md.

[Note: how the Trainer drives the engine]
The Trainer's loop stays the Trainer's (accelerate's data loading, callbacks, logging, evaluation, checkpoint
rotation); shardtrain replaces what accelerate does with DeepSpeed, at the same points:

* ``create_optimizer`` builds the engine once, with the Trainer's optimizer and scheduler unless the config has
  ``optimizer``/``scheduler`` sections. The engine steps them; the Trainer gets stand-ins whose ``step``/``zero_grad``
  do nothing (as accelerate's DeepSpeed wrappers), and a thin module that calls the engine.
* The ``accelerator``'s ``backward`` runs ``engine.backward`` then ``engine.step`` (reduce, clip, step at the
  Trainer's ``sync_gradients`` boundary). The Trainer's loss is already divided for accumulation (or normalized by
  ``num_items_in_batch``), so ``scale_wrt_gas=False``, as accelerate drives DeepSpeed. ``clip_grad_norm_`` answers
  the engine's norm of that step.
* ``checkpoint-N/`` holds the Trainer's files and, instead of ``optimizer.pt``/``scheduler.pt``, the engine's sharded
  checkpoint (``global_stepN/``, ``latest``), as DeepSpeed's; ``resume_from_checkpoint`` loads it with
  ``engine.load_checkpoint`` at any world size or stage. ``save_model`` gathers the full weights
  (``engine.full_state_dict``) and rank 0 writes ``save_pretrained`` (a peft model: the adapter).
* A forward-only second model (TRL's reference, teacher or reward models), passed to ``prepare_deepspeed`` or
  ``accelerator.prepare_model(model, evaluation_mode=True)``, is treated as ``prepare_deepspeed`` does: cast to the
  compute dtype, in eval mode, and at ZeRO-3 sharded into units of its own (:func:`shard_frozen_model`); below
  stage 3 it stays whole (DeepSpeed gives it stage 0).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtrain.compat.accelerate import launch_world_problem
from shardtrain.config.auto import resolve_auto
from shardtrain.config.plan import parallel_dims, resolve_plan
from shardtrain.config.sections import Config, load_config
from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.mesh import init_topology, join_world
from shardtrain.engine import initialize, shutdown
from shardtrain.engine.engine import Engine
from shardtrain.errors import ConfigError, ShardtrainError
from shardtrain.runtime.eager import EagerRuntime
from shardtrain.zero.build import build_layout

log = logging.getLogger("shardtrain")

__all__ = ["ShardtrainTrainer", "ShardtrainTrainerMixin", "auto_values_from_args", "shard_frozen_model"]

# transformers versions this integration is tested with (tests/compat/test_hf_trainer.py): it overrides a few of the
# Trainer's private methods, which may change in another major version.
TESTED_TRANSFORMERS = ">=5.23,<6"


def auto_values_from_args(args: Any, num_training_steps: int) -> dict[str, Any]:
    """What ``"auto"`` config values become, from ``TrainingArguments``: the mapping of transformers'
    ``HfTrainerDeepSpeedConfig`` (``trainer_config_process`` and ``trainer_config_finalize``), as
    ``initialize(auto_values=...)`` names it. Values the config gives as numbers must equal these (else
    :class:`ConfigError`, as the Trainer's mismatch check). Hidden-size keys come from the model's config."""
    gas = args.gradient_accumulation_steps
    return {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": gas,
        "train_batch_size": args.per_device_train_batch_size * gas * args.world_size,
        "gradient_clipping": args.max_grad_norm,
        "lr": args.learning_rate,
        "betas": [args.adam_beta1, args.adam_beta2],
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "total_num_steps": num_training_steps,
        # as transformers: DeepSpeed refuses a warmup of 0 steps
        "warmup_num_steps": max(1, args.get_warmup_steps(num_training_steps)),
        "precision": _precision(args),
    }


def _precision(args: Any) -> str:
    if args.bf16 or getattr(args, "bf16_full_eval", False):
        return "bf16"
    if args.fp16 or getattr(args, "fp16_full_eval", False):
        return "fp16"
    return "fp32"


def _check_precision(cfg: Config, precision: str) -> None:
    """The Trainer's mismatch check for ``fp16.enabled`` / ``bf16.enabled`` (``"auto"`` takes the arguments)."""
    data = cfg.model_dump(exclude_unset=True)
    for name, flag in (("fp16", "--fp16"), ("bf16", "--bf16")):
        given = data.get(name, {}).get("enabled")
        if isinstance(given, bool) and given != (precision == name):
            raise ConfigError(
                f"the shardtrain config says {name}.enabled={given} but TrainingArguments has "
                f'{name}={precision == name}; keep one of them (write "auto" in the config to take {flag})'
            )


def is_engine_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` (a Trainer ``checkpoint-N`` directory) holds an engine checkpoint (a ``latest`` file)."""
    return (Path(path) / "latest").is_file()


def shard_frozen_model(model: nn.Module, config: Config, auto_values: dict[str, Any]) -> EagerRuntime | None:
    """Prepare ``model``, which is only ever run forward (a reference model), as DeepSpeed's inference engine over the
    same config would: its parameters are frozen and cast to the config's compute dtype (bf16/fp16 sections), it is
    moved to the device and put in eval mode, and at ZeRO-3 its parameters are laid out into units of its own, sharded
    over the data-parallel ranks and gathered around each forward as the trained model's are. Below stage 3 it stays
    whole on every rank (DeepSpeed gives such a model stage 0). Collective: every rank calls it with the same model.
    Returns the ZeRO-3 runtime (its units record shards and gathers), or None when nothing was sharded."""
    _check_precision(config, auto_values["precision"])
    data = config.model_dump(exclude_unset=True)
    # as TRL's prepare_deepspeed: a model that is never stepped takes no optimizer, scheduler nor optimizer offload
    data.pop("optimizer", None)
    data.pop("scheduler", None)
    # nor is it split: the trained model's ZeRO layout, without its tensor and expert axes and hpZ's secondary shards
    data.pop("tensor_parallel", None)
    data.pop("expert_parallel_size", None)
    data.get("zero_optimization", {}).pop("offload_optimizer", None)
    data.get("zero_optimization", {}).pop("zero_hpz_partition_size", None)
    cfg = load_config(data)
    if cfg.sequence_parallel_size != 1:
        raise ConfigError(
            f"a second model run forward only (a reference model) is not supported with sequence_parallel_size="
            f"{cfg.sequence_parallel_size}; use precompute_ref_log_probs=True or a peft model (its reference is the "
            "model with the adapter disabled)"
        )
    world = join_world(cfg.collective_timeout_s, cfg.device)
    topology = init_topology(parallel_dims(cfg, world), cfg.collective_timeout_s, cfg.device)
    cfg = resolve_auto(cfg, dp=topology.dp, model=model, auto_values=auto_values)
    plan = resolve_plan(cfg, world)
    policy = plan.precision
    model.requires_grad_(False)  # never trained: nothing is reduced and no gradient is kept for it
    with torch.no_grad():
        for p in model.parameters():
            if policy.casts(p):
                p.data = p.data.to(policy.compute_dtype)
        for m in model.modules():
            for name, buf in m._buffers.items():
                if buf is not None and policy.casts(buf):
                    m._buffers[name] = buf.to(policy.compute_dtype)
    model.to(topology.device)
    model.eval()
    if not plan.zero.shard_parameters:
        return None
    comm = Communicator(topology.shard_group, topology.timeout_s)
    dp_comm = Communicator(topology.zero_group, topology.timeout_s) if topology.hybrid else comm
    layout = build_layout(model, plan.zero, comm, dp_comm=dp_comm)  # rank 0's values, this rank's shards cut
    if not layout.unit_buckets:  # every parameter under stage3_param_persistence_threshold: all stay whole
        return None
    return EagerRuntime(
        model,
        layout.unit_buckets,
        comm,
        plan.prefetch,
        plan.zero.gather_check,
        check_group=topology.host_shard_group,
    )


class _EngineModule(nn.Module):
    """What the Trainer calls as its (wrapped) model: forward goes through ``engine(...)`` (gathers at stage 3,
    the ranks' agreement checks, graph mode). ``engine.module`` is a child, so ``train()``/``eval()`` reach it."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "engine", engine)  # not a submodule: the engine is not an nn.Module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine clears its gradients after each step (and keeps them sharded in its own buffers)."""


class _EngineOptimizer:
    """The Trainer's ``self.optimizer``: ``step``/``zero_grad`` do nothing (the engine steps at the accumulation
    boundary, in ``backward``); everything else (``param_groups``, ``state``, ...) is the optimizer the engine steps,
    whose parameters are this rank's fragments."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ShardtrainError(
                "optimizer.step(closure) is not supported on shardtrain: the engine steps the optimizer at the "
                "accumulation boundary, once, without re-evaluating the loss"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine.optimizer, name)


class _EngineScheduler:
    """The Trainer's ``self.lr_scheduler``: ``step`` does nothing (the engine steps its scheduler after each
    optimizer step it does not skip); ``get_last_lr`` is the learning rate of the last step taken, which is what the
    Trainer logs (it reads it between the optimizer's and the scheduler's step)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.last_step_lr: list[float] | None = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return list(self.last_step_lr if self.last_step_lr is not None else self._engine.get_lr())

    def state_dict(self) -> dict[str, Any]:
        scheduler = self._engine.lr_scheduler
        return scheduler.state_dict() if scheduler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ShardtrainError(
            "the learning-rate scheduler is restored with the engine's checkpoint (resume_from_checkpoint), not "
            "from scheduler.pt"
        )

    def __getattr__(self, name: str) -> Any:
        scheduler = self._engine.lr_scheduler
        if scheduler is None:
            raise AttributeError(f"the shardtrain engine has no learning-rate scheduler (asked for {name!r})")
        return getattr(scheduler, name)


class _EngineAccelerator:
    """The Trainer's ``accelerator`` with the calls DeepSpeed answers under accelerate answered by the engine
    (``backward``, ``clip_grad_norm_``, ``unwrap_model``, ``optimizer_step_was_skipped``); everything else (data
    loader sharding, gathers for logging and metrics, process state) is accelerate's own object."""

    def __init__(self, accelerator: Any, trainer: ShardtrainTrainerMixin) -> None:
        object.__setattr__(self, "_accelerator", accelerator)
        object.__setattr__(self, "_trainer", trainer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._accelerator, name, value)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self._trainer.shardtrain_engine is None:
            return self._accelerator.backward(loss, **kwargs)
        if kwargs:
            raise ShardtrainError(
                f"accelerator.backward({', '.join(kwargs)}=...) is not supported on shardtrain (LOMO optimizers "
                "pass the learning rate this way); use an element-wise optimizer such as AdamW"
            )
        self._trainer._shardtrain_backward(loss)
        return None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        engine = self._trainer.shardtrain_engine
        if engine is None:
            return self._accelerator.clip_grad_norm_(parameters, max_norm, norm_type)
        # the engine clipped at gradient_clipping in its step (run by backward at the boundary): its norm, before
        # clipping, as clip_grad_norm_ returns it, a tensor on the device that the Trainer reads when it logs
        return engine.get_global_grad_norm(as_tensor=True)

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        trainer = self._trainer
        if evaluation_mode and model is not trainer.model and not isinstance(model, _EngineModule):
            # a second model a subclass only runs forward (TRL's reference model, ...): as DeepSpeed prepares it
            return trainer._shardtrain_prepare_frozen(model)
        return self._accelerator.prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )

    def unwrap_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if isinstance(model, _EngineModule):
            model = model.module
        return self._accelerator.unwrap_model(model, *args, **kwargs)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        trainer = self._trainer
        if trainer.shardtrain_engine is None:
            return self._accelerator.optimizer_step_was_skipped
        return trainer._shardtrain_step_skipped


class ShardtrainTrainerMixin:
    """Put first among the bases of a ``transformers.Trainer`` subclass to train on shardtrain; see the module
    docstring. ``shardtrain_config``: the DeepSpeed-style config (dict, JSON/YAML path or :class:`shardtrain.Config`)
    that ``TrainingArguments(deepspeed=...)`` took; ``"auto"`` values are filled from the arguments when training
    starts. The engine is ``trainer.shardtrain_engine`` (None before the first ``train()``)."""

    def __init__(self, *args: Any, shardtrain_config: Config | dict | str | Path, **kwargs: Any) -> None:
        self.shardtrain_config = load_config(shardtrain_config)  # a bad key fails here, before any work
        self.shardtrain_engine: Engine | None = None
        self._shardtrain_step_skipped = False
        self._shardtrain_module: _EngineModule | None = None
        self._shardtrain_scheduler: _EngineScheduler | None = None
        # models prepared with accelerator.prepare_model(..., evaluation_mode=True) and their ZeRO-3 runtimes (None
        # where nothing is sharded), see shard_frozen_model
        self.shardtrain_frozen_models: list[tuple[nn.Module, EagerRuntime | None]] = []
        super().__init__(*args, **kwargs)
        self._shardtrain_refuse_unsupported()

    # -- set-up -----------------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator = _EngineAccelerator(self.accelerator, self)

    def _shardtrain_prepare_frozen(self, model: nn.Module) -> nn.Module:
        """See :func:`shard_frozen_model`; the "auto" values are the arguments' (the step count only matters to a
        scheduler, which such a model does not get)."""
        values = auto_values_from_args(self.args, max(1, self.args.max_steps))
        units = shard_frozen_model(model, self.shardtrain_config, values)
        self.shardtrain_frozen_models.append((model, units))
        log.info(
            "ShardtrainTrainer: %s prepared for forward only (%s)",
            type(model).__name__,
            f"ZeRO-3, {len(units.units)} units" if units is not None else "whole on every rank",
        )
        return model

    def _shardtrain_problems(self) -> list[str]:
        """What a subclass refuses besides the Trainer's arguments (see _shardtrain_refuse_unsupported)."""
        return []

    def _shardtrain_refuse_unsupported(self) -> None:
        """TrainingArguments that would be silently wrong or ignored on shardtrain, refused by name."""
        args, cfg = self.args, self.shardtrain_config
        problems = self._shardtrain_problems()
        if args.deepspeed:
            problems.append(
                "TrainingArguments(deepspeed=...) turns on DeepSpeed itself; pass the config as "
                "shardtrain_config=... instead and leave deepspeed unset"
            )
        if args.fsdp:
            problems.append("TrainingArguments(fsdp=...) cannot be combined with shardtrain; leave fsdp unset")
        if cfg.tensor_parallel.degree > 1:
            problems.append(
                "tensor_parallel.size > 1 is not supported through the Trainer yet (its data loader gives every "
                "rank a different batch, tensor-parallel ranks need the same one); use shardtrain.initialize "
                "directly, or set tensor_parallel.size to 1"
            )
        if args.auto_find_batch_size:
            problems.append(
                "auto_find_batch_size is not supported (the engine is built for one micro-batch size); set "
                "per_device_train_batch_size"
            )
        if args.torch_compile:
            problems.append(
                "torch_compile=True would be ignored (accelerate compiles the model it wraps, and shardtrain wraps "
                'it instead); use the config\'s "graph": {"enabled": true} section'
            )
        if args.save_on_each_node and args.world_size > 1:
            problems.append(
                "save_on_each_node is not supported: save_model gathers the weights on global rank 0 only; save to "
                "storage every node can read"
            )
        world = launch_world_problem(args.world_size, "TrainingArguments")
        if world is not None:  # the batch sizes and "auto" values below would be one process's
            problems.append(world)
        if args.n_gpu > 1:
            problems.append(
                "this process drives several GPUs (torch.nn.DataParallel); launch one process per GPU with torchrun"
            )
        if problems:
            raise ConfigError("ShardtrainTrainer:\n  " + "\n  ".join(problems))

    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        """Build the engine the first time (see [Note: how the Trainer drives the engine]); return the optimizer
        stand-in the Trainer steps (a no-op: the engine steps)."""
        if self.shardtrain_engine is None:
            self._shardtrain_build(self.state.max_steps)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.shardtrain_engine is None:  # the engine calls it (through _shardtrain_build) for the Trainer's own
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:  # the Trainer clears a scheduler it made when train() is called again
            self.lr_scheduler = self._shardtrain_scheduler
        return self.lr_scheduler

    def _shardtrain_build(self, num_training_steps: int) -> None:
        cfg = self.shardtrain_config
        values = auto_values_from_args(self.args, num_training_steps)
        _check_precision(cfg, values["precision"])
        if cfg.optimizer is not None:
            if self.optimizer is not None:
                raise ConfigError(
                    "an optimizer was passed to the Trainer (optimizers=(...)) and the shardtrain config has an "
                    "'optimizer' section; keep one of them"
                )
            optimizer = None  # the engine builds the config's, with "auto" filled from the arguments
        else:
            optimizer = super().create_optimizer()  # the Trainer's own (args.optim, decay groups, ...)
        if cfg.scheduler is not None:
            if self.lr_scheduler is not None:
                raise ConfigError(
                    "a learning-rate scheduler was passed to the Trainer (optimizers=(...)) and the shardtrain "
                    "config has a 'scheduler' section; keep one of them"
                )
            scheduler = None
        elif self.lr_scheduler is not None:
            scheduler = self.lr_scheduler  # the user's, built on the optimizer they passed
        else:

            def scheduler(opt: torch.optim.Optimizer) -> Any:  # the Trainer's own, on the optimizer the engine keeps
                self.lr_scheduler = None
                return super(ShardtrainTrainerMixin, self).create_scheduler(num_training_steps, optimizer=opt)

        engine = initialize(self.model, self.shardtrain_config, optimizer, scheduler, auto_values=values)
        self.shardtrain_engine = engine
        shutdown.end_at_exit()  # the script may never call end(): see [Note: what the engine starts and who joins it]
        self._shardtrain_module = _EngineModule(engine)
        self._shardtrain_scheduler = _EngineScheduler(engine)
        self.optimizer = _EngineOptimizer(engine)
        self.lr_scheduler = self._shardtrain_scheduler
        log.info(
            "ShardtrainTrainer: ZeRO stage %d over %d rank(s), %s optimizer from %s, scheduler from %s",
            engine.stage,
            engine.topology.dp,
            type(engine.optimizer).__name__,
            "the config" if cfg.optimizer is not None else "the Trainer",
            "the config" if cfg.scheduler is not None else ("the Trainer" if engine.lr_scheduler else "nowhere"),
        )

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if self._shardtrain_module is not None:  # neither DDP nor accelerate's prepare: the engine's own module
            return self._shardtrain_module
        return super()._wrap_model(model, training, dataloader)

    # -- a micro-step ---------------------------------------------------------------------------------------
    def _shardtrain_backward(self, loss: torch.Tensor) -> None:
        """``accelerator.backward`` on the engine; see [Note: how the Trainer drives the engine]."""
        engine = self.shardtrain_engine
        boundary = self.accelerator.sync_gradients  # the Trainer's: set before each micro-step
        gas = engine.gradient_accumulation_steps
        if boundary and not engine.is_gradient_accumulation_boundary():
            # the last accumulation of an epoch whose batches do not divide by gas is shorter: the Trainer steps
            # early (and divided the loss by the shorter count), and the engine follows
            engine.micro_steps += gas - 1 - engine.micro_steps % gas
        elif not boundary and engine.is_gradient_accumulation_boundary():
            raise ShardtrainError(
                f"the Trainer continues an accumulation at the engine's micro-step {engine.micro_steps}, where the "
                f"engine (gradient_accumulation_steps={gas}) ends one: the engine was driven outside the Trainer "
                "(engine.backward/engine.step called directly); let the Trainer drive it"
            )
        engine.backward(loss, scale_wrt_gas=False)  # the Trainer already divided it for accumulation
        if boundary:
            lr = engine.get_lr()
            skipped_before = engine.skipped_steps
        engine.step()
        if boundary:
            self._shardtrain_step_skipped = engine.skipped_steps > skipped_before
            self._shardtrain_scheduler.last_step_lr = lr

    def end(self) -> None:
        """Close the engine (its threads and process groups), then the Trainer's ``end()`` (trackers, and the process
        group the Trainer's arguments created). Call it once, at the very end of the script, as ``Trainer.end()``;
        without it the same happens at interpreter exit ([Note: what the engine starts and who joins it])."""
        if self.shardtrain_engine is not None:
            self.shardtrain_engine.close()
        super().end()

    # -- saving and resuming --------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the full model so that ``from_pretrained`` opens it (peft: the adapter). Collective once training
        has started: every rank must call it; rank 0 writes."""
        engine = self.shardtrain_engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = engine.full_state_dict()  # every rank gathers; rank 0 gets CPU copies
        if engine.topology.rank == 0:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self.shardtrain_engine
        if engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # model (fp32 masters), optimizer, scheduler, loss scale, counters: sharded, in checkpoint-N/global_stepN
        engine.save_checkpoint(output_dir)
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if is_engine_checkpoint(resume_from_checkpoint):
            return None  # the weights come with the engine's checkpoint, in _load_optimizer_and_scheduler
        if self.shardtrain_engine is not None:
            raise ShardtrainError(_no_engine_checkpoint(resume_from_checkpoint))
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        engine = self.shardtrain_engine
        if engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if not is_engine_checkpoint(checkpoint):
            raise ShardtrainError(_no_engine_checkpoint(checkpoint))
        engine.load_checkpoint(checkpoint)
        return None

    def _load_best_model(self) -> None:
        engine = self.shardtrain_engine
        if engine is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        if not is_engine_checkpoint(best):
            raise ShardtrainError(
                f"load_best_model_at_end: {best!r} has no engine checkpoint (it was saved with save_only_model=True); "
                "save full checkpoints to load the best one at the end"
            )
        log.info("loading the best model from %s (score %s)", best, self.state.best_metric)
        engine.load_checkpoint(best, load_optimizer_states=False)  # weights and their fp32 masters
        return None


def _no_engine_checkpoint(path: str) -> str:
    return (
        f"resume_from_checkpoint={path!r} holds no shardtrain checkpoint (no 'latest' file): a checkpoint of the "
        "plain Trainer keeps its optimizer as one unsharded optimizer.pt, which shardtrain does not read. Start a new "
        "run from its weights instead (load the model from that directory with from_pretrained and train without "
        "resume_from_checkpoint)"
    )


def _trainer_base() -> type:
    try:
        import transformers
        from transformers import Trainer
    except ImportError as err:  # transformers is not a dependency of shardtrain
        raise ImportError(
            f"shardtrain.integrations.hf_trainer needs transformers (pip install 'transformers{TESTED_TRANSFORMERS}')"
        ) from err
    major = int(transformers.__version__.split(".")[0])
    if major != 5:  # 4.x builds the optimizer before it knows the number of steps, in another order
        raise ImportError(
            f"shardtrain.integrations.hf_trainer works with transformers{TESTED_TRANSFORMERS} (tested with 5.23); "
            f"transformers {transformers.__version__} is installed"
        )
    return Trainer


class ShardtrainTrainer(ShardtrainTrainerMixin, _trainer_base()):
    """``transformers.Trainer`` training on shardtrain: ``ShardtrainTrainer(model, args, ...,
    shardtrain_config="ds_config.json")``. See :class:`ShardtrainTrainerMixin`."""
