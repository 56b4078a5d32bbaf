"""``DeepSpeedEngine``: DeepSpeed's engine API over a shardtrain :class:`~shardtrain.engine.engine.Engine`.

An adapter rather than more methods on ``Engine``: some names mean different things in the two APIs
(``Engine.train_batch_size`` is an int, DeepSpeed's ``train_batch_size()`` a method; DeepSpeed's
``load_checkpoint`` returns a ``(path, client_state)`` pair, ours the client state). The shardtrain engine stays
reachable as ``engine.shardtrain_engine``.

[Note: DeepSpeed's step protocol]
A DeepSpeed script calls ``backward`` and ``step`` after every micro-batch; ``step`` applies the optimizer and the
LR scheduler only at an accumulation boundary (``(micro_steps + 1) % gradient_accumulation_steps == 0``), and
``global_steps`` / ``global_samples`` count optimizer steps and the samples they consumed. shardtrain's ``Engine``
follows the same protocol (see ``shardtrain/engine.py``), so each call maps onto one call of it.

[Note: a declared accumulation boundary]
A script may declare the boundary instead (``set_gradient_accumulation_boundary``, before each backward) and call
``step()`` only after the last backward of an accumulation: accelerate drives DeepSpeed so. DeepSpeed then takes the
declaration and never counts. The engine's count is the boundary here (the reducer reduces by it), so the adapter keeps
the count where the declarations put it: a backward declared off a boundary is counted at once (the ``step()``
DeepSpeed would not need; a later ``step()`` for it does nothing, as DeepSpeed's off a boundary); a boundary declared
early (accelerate ends an accumulation at the end of its data loader) moves the count to it, as the Trainer
integration does; the loss is still divided by ``gradient_accumulation_steps``, as DeepSpeed divides it. A declared
accumulation longer than ``gradient_accumulation_steps`` is refused (the count would reduce and step at its end).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtrain.checkpoint.format import LATEST_NAME, MANIFEST_NAME
from shardtrain.checkpoint.latest import read_latest
from shardtrain.compat.deepspeed.unsupported import not_provided
from shardtrain.engine.engine import Engine

log = logging.getLogger("shardtrain")


class _Refused:
    """A name ``nn.Module`` defines that DeepSpeed's engine means otherwise: not an attribute (``hasattr`` is False),
    so that reading it goes to ``DeepSpeedEngine.__getattr__``, which refuses it by name with what to use."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        raise AttributeError(self.name)


class DeepSpeedEngine(nn.Module):
    """What DeepSpeed scripts call on the engine ``deepspeed.initialize`` returns; anything else of DeepSpeed's
    engine raises :class:`~shardtrain.deepspeed.unsupported.NotProvidedError` naming it.

    An ``nn.Module`` whose child ``module`` is the model, as DeepSpeed's engine: accelerate and other libraries
    unwrap a prepared model by ``isinstance(model, DeepSpeedEngine)`` and walk it as a module."""

    def __init__(self, engine: Engine, training_dataloader: Any = None, config: Any = None) -> None:
        super().__init__()
        self.shardtrain_engine = engine
        self.module: nn.Module = engine.module
        self.training_dataloader = training_dataloader
        self.config = config
        """The config as ``deepspeed.initialize`` was given it (a dict or a path), as DeepSpeed's ``engine.config``."""
        self._stepped_at: int | None = None  # the global step the last step() ended, if it was a boundary
        # [Note: a declared accumulation boundary]: the script's last declaration (None: never declared, the count
        # rules), and whether the last backward was already counted (a later step() for it does nothing)
        self._declared_boundary: bool | None = None
        self._counted_by_backward = False

    # -- the training loop -------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.shardtrain_engine(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.shardtrain_engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss / gradient_accumulation_steps`` (``loss`` as given with ``scale_wrt_gas=False``);
        returns ``loss`` as DeepSpeed does."""
        if retain_graph:
            raise not_provided("engine.backward(retain_graph=True)", "run forward again for a second backward")
        engine = self.shardtrain_engine
        declared = self._declared_boundary
        if declared is not None:
            self._follow_declared_boundary(declared)
        engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
        if declared is False:  # counted now: the script may not call step() until its declared boundary
            engine.step()
            self._counted_by_backward = True
            self._stepped_at = None
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Call after every micro-batch; see [Note: DeepSpeed's step protocol]."""
        if lr_kwargs:
            raise not_provided("engine.step(lr_kwargs=...)", "the LR scheduler steps without arguments")
        if self._counted_by_backward:  # a declared non-boundary, counted by its backward: DeepSpeed does nothing
            self._counted_by_backward = False
            return
        engine = self.shardtrain_engine
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        # read when asked: an fp16 overflow may be learned a step later (see [Note: an overflow learned a step later])
        self._stepped_at = engine.global_step if boundary else None

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.shardtrain_engine.is_gradient_accumulation_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Declare whether the next backward ends an accumulation (accelerate does before every backward); see
        [Note: a declared accumulation boundary]."""
        self._counted_by_backward = False  # a new micro-step: step() for the last one is no longer expected
        self._declared_boundary = bool(is_boundary)
        self._follow_declared_boundary(self._declared_boundary)

    def _follow_declared_boundary(self, declared: bool) -> None:
        engine = self.shardtrain_engine
        counted = engine.is_gradient_accumulation_boundary()
        if declared == counted:
            return
        gas = engine.gradient_accumulation_steps
        if declared:  # an accumulation cut short: the count moves to its boundary
            engine.micro_steps += gas - 1 - engine.micro_steps % gas
            return
        raise not_provided(
            f"an accumulation longer than gradient_accumulation_steps ({gas}): "
            f"engine.set_gradient_accumulation_boundary(False) at micro-step {engine.micro_steps}, where the count "
            "ends one",
            "set the config's gradient_accumulation_steps to the number of micro-batches the script accumulates "
            "(with accelerate: Accelerator(gradient_accumulation_steps=...) and the config's the same)",
        )

    def zero_grad(self) -> None:
        """Clear the gradients accumulated since the last optimizer step (the engine also clears them after each
        step, so a call right after ``step()`` changes nothing)."""
        self.shardtrain_engine._reducer.zero_grads()

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.training = mode
        self.shardtrain_engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    # nn.Module's methods that mean something else on DeepSpeed's engine: refused as the names it lacks
    state_dict = _Refused()
    load_state_dict = _Refused()
    compile = _Refused()

    # -- counters and settings ---------------------------------------------------------------------
    @property
    def global_steps(self) -> int:
        return self.shardtrain_engine.global_step

    @property
    def global_samples(self) -> int:
        return self.shardtrain_engine.global_samples

    @property
    def micro_steps(self) -> int:
        return self.shardtrain_engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.shardtrain_engine.skipped_steps

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` stepped the optimizer (False off a boundary, or when fp16 skipped it)."""
        at = self._stepped_at
        return at is not None and not self.shardtrain_engine.step_was_skipped(at)

    def train_batch_size(self) -> int:
        return self.shardtrain_engine.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.shardtrain_engine.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.shardtrain_engine.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.shardtrain_engine.config.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self.shardtrain_engine.stage

    def get_lr(self) -> list[float]:
        return self.shardtrain_engine.get_lr()

    def get_global_grad_norm(self) -> float | None:
        return self.shardtrain_engine.get_global_grad_norm()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.shardtrain_engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.shardtrain_engine.lr_scheduler

    @property
    def device(self) -> torch.device:
        return self.shardtrain_engine.device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return self.shardtrain_engine.topology.rank

    @property
    def world_size(self) -> int:
        return self.shardtrain_engine.topology.world_size

    @property
    def dp_world_size(self) -> int:
        return self.shardtrain_engine.topology.dp

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.module.named_parameters(*args, **kwargs)

    # -- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Collective. Written in shardtrain's format (loadable at any world size and stage); ``latest`` is always
        updated, last, once every rank's part is complete."""
        if not save_latest:
            raise not_provided(
                "engine.save_checkpoint(save_latest=False)",
                "`latest` is how a crash-safe save publishes a complete checkpoint; pass a tag to load_checkpoint "
                "to load another one",
            )
        if exclude_frozen_parameters:
            raise not_provided("engine.save_checkpoint(exclude_frozen_parameters=True)", "frozen ones are saved too")
        self.shardtrain_engine.save_checkpoint(
            save_dir, tag=None if tag is None else str(tag), client_state=client_state
        )
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict | None]:
        """Collective. Returns ``(checkpoint directory, client_state)``; ``(None, None)`` when ``load_dir`` holds no
        ``latest`` and no tag is given (DeepSpeed's answer for "nothing to resume from", with a warning).
        ``load_module_only``: the weights only; counters, optimizer and scheduler stay as they are."""
        if not load_module_strict:
            raise not_provided(
                "engine.load_checkpoint(load_module_strict=False)",
                "checkpoints load strictly; to load some weights only, use "
                "engine.shardtrain_engine.load_full_state_dict(state_dict, strict=False)",
            )
        if custom_load_fn is not None:
            raise not_provided("engine.load_checkpoint(custom_load_fn=...)")
        load_dir = Path(load_dir)
        if tag is None and not (load_dir / LATEST_NAME).is_file() and not (load_dir / MANIFEST_NAME).is_file():
            log.warning("Unable to find latest file at %s, if trying to load latest checkpoint please pass a tag "
                        "or save one first", load_dir / LATEST_NAME)  # fmt: skip
            return None, None
        engine = self.shardtrain_engine
        kept_counters = {
            k: getattr(engine, k) for k in ("global_step", "micro_steps", "skipped_steps", "global_samples")
        }
        scheduler = engine.lr_scheduler
        kept_scheduler = scheduler.state_dict() if scheduler is not None else None
        kept_lrs = [g["lr"] for g in engine.optimizer.param_groups]
        client_state = engine.load_checkpoint(
            load_dir,
            tag=None if tag is None else str(tag),
            load_optimizer_states=load_optimizer_states and not load_module_only,
        )
        if load_module_only:
            for k, v in kept_counters.items():
                setattr(engine, k, v)
        if scheduler is not None and (load_module_only or not load_lr_scheduler_states):
            scheduler.load_state_dict(kept_scheduler)
            for g, lr in zip(engine.optimizer.param_groups, kept_lrs):
                g["lr"] = lr
        if tag is None and not (load_dir / MANIFEST_NAME).is_file():
            tag = read_latest(load_dir)  # what the engine loaded: confined to load_dir
        path = load_dir / tag if tag is not None else load_dir
        return str(path), client_state

    # -- the config's answers ------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.shardtrain_engine.config.fp16.enabled is True

    def bfloat16_enabled(self) -> bool:
        return self.shardtrain_engine.config.bf16.enabled is True

    bf16_enabled = bfloat16_enabled  # the name scripts often guess

    def zero_optimization(self) -> bool:
        """Whether ZeRO is on (stage 1-3), as DeepSpeed's ``zero_enabled``."""
        return self.zero_optimization_stage() > 0

    def loss_scale(self) -> float:
        """The config's ``fp16.loss_scale`` (0: dynamic), as DeepSpeed's ``loss_scale()``; the scale in use is
        ``engine.shardtrain_engine.loss_scale``."""
        return float(self.shardtrain_engine.config.fp16.loss_scale)

    def wall_clock_breakdown(self) -> bool:
        """As DeepSpeed's: ``wall_clock_breakdown``, or the flops profiler, which turns it on."""
        config = self.shardtrain_engine.config
        return config.wall_clock_breakdown or config.flops_profiler.enabled

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``stage3_gather_16bit_weights_on_model_save`` (false by default), as DeepSpeed answers it:
        without it ``save_16bit_model`` writes nothing at stage 3, and accelerate's ``get_state_dict`` refuses."""
        return self.shardtrain_engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save is True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The full weights in their training dtype on rank 0 (host copies), None on the other ranks; collective.
        (A private name of DeepSpeed that accelerate and transformers call to save a ZeRO-3 model.)"""
        state = self.shardtrain_engine.full_state_dict()
        if state is not None and exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def close(self) -> None:
        """Release what the engine holds (monitors, swap files, background saves); a second call does nothing."""
        self.shardtrain_engine.close()

    destroy = close  # DeepSpeed's name

    def save_16bit_model(
        self,
        save_dir: str | os.PathLike,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """The model's weights, whole, in their training dtype, to ``save_dir/save_filename`` on rank 0 (collective:
        every rank calls it). ``.safetensors`` writes safetensors, anything else ``torch.save``'s format, as DeepSpeed
        and ``from_pretrained`` read it. Returns True; at stage 3 without ``stage3_gather_16bit_weights_on_model_save``
        it writes nothing and returns False, as DeepSpeed does (the weights would be gathered one tensor at a time,
        but a script written for DeepSpeed expects nothing there)."""
        if self.shardtrain_engine.stage == 3 and not self.zero_gather_16bit_weights_on_model_save():
            log.info(
                "did not save the model to %s: stage3_gather_16bit_weights_on_model_save is false (as DeepSpeed)",
                Path(save_dir) / save_filename,
            )
            return False
        state = self.shardtrain_engine.full_state_dict()  # collective; the full weights on rank 0
        if state is None:
            return True
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        path = Path(save_dir) / save_filename
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        else:
            torch.save(state, path)
        log.info("saved the model's weights to %s (step %d)", path, self.shardtrain_engine.global_step)
        return True

    # -- everything else of DeepSpeed's engine -----------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "shardtrain_engine":  # copy/pickle probes; construction not finished
            raise AttributeError(name)
        try:
            return super().__getattr__(name)  # the child module ``module``, as nn.Module keeps it
        except AttributeError:
            pass
        instead = _ENGINE_INSTEAD.get(
            name, "the shardtrain engine underneath is engine.shardtrain_engine (its methods: shardtrain/engine.py)"
        )
        raise not_provided(f"DeepSpeedEngine.{name}", instead)


_FULL_WEIGHTS = (
    "take engine.shardtrain_engine.full_state_dict() (collective; the full weights on rank 0) and save it, or "
    "consolidate a checkpoint with `shardtrain checkpoint consolidate`"
)
_ENGINE_INSTEAD = {
    "save_fp16_model": _FULL_WEIGHTS + "; or save_16bit_model()",
    "state_dict": _FULL_WEIGHTS + "; engine.module.state_dict() at stages 0-2",
    "load_state_dict": "engine.load_checkpoint(dir), or engine.shardtrain_engine.load_full_state_dict(state_dict) "
    "for full weights",
    "set_train_batch_size": "set train_batch_size or gradient_accumulation_steps in the config",
    "offload_states": "offload is configured: zero_optimization.offload_optimizer / offload_param",
    "reload_states": "offload is configured: zero_optimization.offload_optimizer / offload_param",
    "train_batch": "train_batch runs a pipeline: build the model as a deepspeed.pipe.PipelineModule (or run forward, "
    "backward and step per micro-batch)",
    "eval_batch": "eval_batch runs a pipeline: build the model as a deepspeed.pipe.PipelineModule (or call the "
    "engine on the batch under torch.no_grad())",
    "compile": "call torch.compile on the model yourself, or turn on the config's graph mode (docs/graph-mode.md)",
}
