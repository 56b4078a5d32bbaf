"""Small training runs that write statistics, shared by the debug tests (and the docs walkthrough)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtrain.debug import StatisticsSubscriber, Subscriber, SubscriberManager
from shardtrain.models.gpt import GPT, GPTConfig

VOCAB, SEQ = 64, 16


class ScaleOutput(Subscriber):
    """A planted bug: multiply one module's output by ``factor`` from ``from_step`` on."""

    def __init__(self, name: str, factor: float, from_step: int) -> None:
        self.name, self.factor, self.from_step = name, factor, from_step

    def post_forward(self, step: int, name: str, module: nn.Module, outputs: Any) -> Any:
        if name == self.name and step >= self.from_step:
            return outputs * self.factor
        return None


def tiny_gpt(seed: int = 0, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=2, n_head=4)).to(dtype)


def batches(steps: int, rows: int = 2, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def train_plain(
    out_dir: Path,
    steps: int = 6,
    dtype: torch.dtype = torch.float32,
    extra: list[Subscriber] | None = None,
    start_step: int | None = None,
    end_step: int | None = None,
) -> list[float]:
    """Train the tiny GPT with SGD for ``steps`` steps, recording statistics; returns the losses."""
    model = tiny_gpt(dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = SubscriberManager()
    stats = StatisticsSubscriber(out_dir, start_step=start_step, end_step=end_step)
    manager.subscribe(model, [*(extra or []), stats])
    losses = []
    for x, y in batches(steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    manager.unsubscribe(model)
    return losses
