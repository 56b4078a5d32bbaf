"""Shared pieces of the sequence-parallel parity tests whose batches are keyword dicts (transformers models): the
optimizer, the loss, and their parity-harness recipe (:class:`shardtrain.testing.parity.Recipe`), whose reference
is one process on the whole batches with each micro-step's loss the mean of each data-parallel rank's rows' loss."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardtrain.testing.parity import Recipe, train_one_process


def adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def keyword_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss on keyword inputs (a model, or an engine)."""
    return model(**batch).loss


def rows_of(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in batch.items()}


def keyword_recipe(make_model: Callable, batches: Callable, gas: int, config: dict) -> Recipe:
    """AdamW, clipping at 1.0, the model's own loss, and the per-rank loss of [Note: the layout a recipe describes]
    (the ranks' rows hold different numbers of real tokens). ``make_model`` and ``batches`` must be importable
    (``functools.partial`` of module-level functions): the ranks are fresh processes."""
    return Recipe(make_model, adamw, batches, keyword_loss, gas=gas, clip=1.0, config=config, per_rank_loss=True)


def dp_reference(
    model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], dp: int, rows: int, steps: int, gas: int
) -> dict:
    """One process on the whole batches of a model already built (in its dtype): each micro-step's loss is the mean
    of each data-parallel rank's ``rows`` rows' loss, as the engine's data-parallel average makes it; AdamW, clipping
    at 1.0. The harness's :func:`~shardtrain.testing.parity.reference_run` of :func:`keyword_recipe` is the same run
    for a model the recipe builds."""
    model.train()
    recipe = keyword_recipe(lambda: model, lambda: batches, gas, {})
    if recipe.rows != dp * rows:
        raise ValueError(f"the batches hold {recipe.rows} rows, not {dp} data-parallel ranks x {rows}")

    def loss(model, i: int) -> torch.Tensor:
        return recipe.reference_loss(model, batches[i], dp)

    return train_one_process(model, adamw(model), loss, steps, gas, 1.0)
