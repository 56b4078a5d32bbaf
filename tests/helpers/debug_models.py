"""Tiny modules with known names and nested outputs, for the subscriber tests."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import torch
from torch import nn

from shardtrain.debug import inspect_activation


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc1(x))


class Net(nn.Module):
    """Root of ``blocks.0.fc1``-style names; ``inspect_activation("net.hidden", ...)`` inside its forward."""

    def __init__(self, width: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        x = inspect_activation("net.hidden", x * 2)
        return self.head(x).sum()


@dataclass(frozen=True)
class Pair:
    first: torch.Tensor
    second: torch.Tensor


@dataclass
class FakeModelOutput(OrderedDict):
    """Shaped like ``transformers.ModelOutput``: a dataclass that is also an OrderedDict of its non-None fields."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("loss", "logits"):
            if getattr(self, name) is not None:
                self[name] = getattr(self, name)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


Point = namedtuple("Point", ["x", "y"])


class Nested(nn.Module):
    """Returns every container kind the tree walker handles."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor):
        h = self.lin(x)
        return (
            h,
            {"a": h + 1, "b": [h + 2, "text", None]},
            Pair(h + 3, h + 4),
            FakeModelOutput(loss=h.sum(), logits=h + 5),
            Point(h + 6, 7),
        )


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Nested()

    def forward(self, x: torch.Tensor):
        return self.inner(x)
