"""Shared pieces of the sequence-parallel parity tests whose batches are keyword dicts (transformers models): the
optimizer, the loss, and their parity-harness recipe (:class:`shardtrain.testing.parity.Recipe`), whose reference
is one process on the whole batches with each micro-step's loss the mean of each data-parallel rank's rows' loss."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardtrain.testing.parity import Recipe


def adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def keyword_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss on keyword inputs (a model, or an engine)."""
    return model(**batch).loss


def keyword_recipe(make_model: Callable, batches: Callable, gas: int, config: dict) -> Recipe:
    """AdamW, clipping at 1.0, the model's own loss, and the per-rank loss of [Note: the layout a recipe describes]
    (the ranks' rows hold different numbers of real tokens). ``make_model`` and ``batches`` must be importable
    (``functools.partial`` of module-level functions): the ranks are fresh processes."""
    return Recipe(make_model, adamw, batches, keyword_loss, gas=gas, clip=1.0, config=config, per_rank_loss=True)
