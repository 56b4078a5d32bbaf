"""DeepSpeed's ``PipelineEngine`` (``deepspeed/runtime/pipe/engine.py``): what ``deepspeed.initialize`` returns for a
:class:`~.module.PipelineModule`. Its calls go to the shardtrain engine's pipeline API (``train_batch``,
``eval_batch``, ``grid``, ... in ``engine/engine.py``); a step is one schedule, so ``engine(x)``, ``backward`` and
``step`` are refused, as DeepSpeed refuses them ("Only train_batch() is accessible in pipeline mode")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from shardtrain.compat.deepspeed.engine import DeepSpeedEngine
from shardtrain.compat.deepspeed.utils import RepeatingLoader
from shardtrain.errors import ConfigError
from shardtrain.pipeline_parallel import PipelineGrid


class PipelineEngine(DeepSpeedEngine):
    """The engine of a ``PipelineModule`` script: ``loss = engine.train_batch(data_iter)`` per step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        loader = self.training_dataloader
        self._data_iterator: Iterator | None = iter(RepeatingLoader(loader)) if loader is not None else None

    def set_dataiterator(self, iterator: Iterator) -> None:
        """The iterator ``train_batch()`` pulls from when it is given none."""
        self._data_iterator = iterator

    def _iterator(self, data_iter: Iterator | None, call: str) -> Iterator:
        data_iter = data_iter if data_iter is not None else self._data_iterator
        if data_iter is None:
            raise ConfigError(
                f"engine.{call}() without a data_iter: pass one, or give deepspeed.initialize training_data, or call "
                "engine.set_dataiterator(it)"
            )
        return data_iter

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` ``(inputs, labels)`` micro-batches pulled from
        ``data_iter``; the step's mean loss, on every rank. Collective."""
        return self.shardtrain_engine.train_batch(self._iterator(data_iter, "train_batch"))

    def eval_batch(
        self,
        data_iter: Iterator,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> torch.Tensor | None:
        """The mean loss of a step's micro-batches, forwards only (DeepSpeed's arguments; see
        ``Engine.eval_batch``). Collective."""
        return self.shardtrain_engine.eval_batch(
            data_iter,
            return_logits=return_logits,
            compute_loss=compute_loss,
            reduce_output=reduce_output,
            bcast_loss=bcast_loss,
            num_micro_batches=num_micro_batches,
        )

    @property
    def grid(self) -> PipelineGrid:
        return self.shardtrain_engine.grid

    @property
    def stage_id(self) -> int:
        return self.shardtrain_engine.stage_id

    @property
    def num_stages(self) -> int:
        return self.shardtrain_engine.num_stages

    @property
    def micro_batches(self) -> int:
        return self.shardtrain_engine.micro_batches

    def is_first_stage(self) -> bool:
        return self.shardtrain_engine.is_first_stage()

    def is_last_stage(self) -> bool:
        return self.shardtrain_engine.is_last_stage()

    def _only_train_batch(self, call: str) -> ConfigError:
        return ConfigError(
            f"{call} on DeepSpeed's PipelineEngine: only train_batch() and eval_batch() run a pipeline step (DeepSpeed "
            "refuses it too); loss = engine.train_batch(data_iter)"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._only_train_batch("engine(...)")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise self._only_train_batch("engine.forward()")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise self._only_train_batch("engine.backward()")

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise self._only_train_batch("engine.step()")


__all__ = ["PipelineEngine"]
