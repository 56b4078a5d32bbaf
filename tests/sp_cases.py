"""Shared pieces of the sequence-parallel parity tests whose batches are keyword dicts (transformers models): the
optimizer, a data-parallel rank's rows, and the one-process reference over the data-parallel ranks' rows."""

from __future__ import annotations

import torch

from parity import train_one_process


def adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def rows_of(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in batch.items()}


def dp_reference(
    model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], dp: int, rows: int, steps: int, gas: int
) -> dict:
    """One process on the whole batches: each micro-step's loss is the mean of each data-parallel rank's rows' loss,
    as the engine's data-parallel average makes it; AdamW, clipping at 1.0."""
    model.train()

    def loss(model, i: int) -> torch.Tensor:
        parts = [slice(d * rows, (d + 1) * rows) for d in range(dp)]
        return sum(model(**rows_of(batches[i], r)).loss for r in parts) / dp

    return train_one_process(model, adamw(model), loss, steps, gas, 1.0)
