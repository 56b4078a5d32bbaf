"""The :class:`Subscriber` interface: what a subscriber is told about a module's forward and backward.

A subscriber is attached to a root module with :meth:`shardtrain.debug.SubscriberManager.subscribe`. Every callback
receives ``step`` (see the manager for how steps are counted) and ``name``, the module's qualified name as
``named_modules()`` spells it (``blocks.3.mlp.0``; the root itself is ``""``), and may return a replacement value;
returning ``None`` keeps the value. With several subscribers, each sees what the previous one returned.

Callbacks never receive parameters and must not assume they are materialized: under ZeRO stage 3 they are gathered
by other hooks around the same forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Subscriber:
    """Base class; override the callbacks you need. All default implementations observe nothing."""

    def is_active(self, step: int) -> bool:
        """Whether this subscriber wants callbacks at ``step``; when no subscriber does, the step costs ~nothing."""
        return True

    def pre_forward(
        self, step: int, name: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]] | None:
        """Before ``module.forward(*args, **kwargs)``; return ``(args, kwargs)`` to replace the inputs."""
        return None

    def post_forward(self, step: int, name: str, module: nn.Module, outputs: Any) -> Any | None:
        """After ``module``'s forward; return a value to replace ``outputs``."""
        return None

    def output_grad(self, step: int, name: str, path: str, grad: torch.Tensor) -> torch.Tensor | None:
        """In backward, the gradient of one tensor output (``path`` inside the outputs, ``""`` for a bare tensor).

        Also called for tensors recorded with :func:`shardtrain.debug.inspect_activation` (``name`` is theirs).
        Return a tensor to replace the gradient that flows on.
        """
        return None

    def inspect(self, step: int, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """An intermediate tensor passed to :func:`shardtrain.debug.inspect_activation` during a forward."""
        return None

    def post_root_forward(self, step: int, name: str, module: nn.Module, outputs: Any) -> Any | None:
        """After the root module's forward (after its own ``post_forward``); may replace the outputs."""
        return None
