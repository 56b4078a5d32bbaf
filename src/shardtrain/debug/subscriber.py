"""The :class:`Subscriber` interface: what a subscriber is told about a module's forward and backward.

A subscriber is attached to a root module with :meth:`shardtrain.debug.SubscriberManager.subscribe`. Every callback
receives ``step`` (see the manager for how steps are counted) and ``name``, the module's qualified name as
``named_modules()`` spells it (``blocks.3.mlp.0``; the root itself is ``""``), and may return a replacement value;
returning ``None`` keeps the value. With several subscribers, each sees what the previous one returned.

Callbacks never receive parameters and must not assume they are materialized: under ZeRO stage 3 they are gathered
by other hooks around the same forward.

Graph mode at ZeRO stage 3
    There the forward cannot stop to run Python on the activations (see [Note: statistics inside the graph] in
    :mod:`shardtrain.debug.traced`), so the callbacks above are not called. A subscriber that defines
    :meth:`Subscriber.summarize` (torch operations on a tensor, traced into the captured graph) and
    :meth:`Subscriber.record_summary` (what to do with the result on the host) is called through those instead,
    for every tensor ``post_forward``, ``inspect`` and ``output_grad`` would have seen; one that does not (or that
    overrides ``pre_forward`` or ``post_root_forward``, which replace inputs and outputs) is refused at the first
    forward with a :class:`~shardtrain.errors.GraphCaptureError` naming it. :class:`StatisticsSubscriber` defines
    both and records the same files in both modes.
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

    # -- graph mode at ZeRO stage 3 (see the module docstring) ----------------------------------------
    def summarize(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """A module output, an ``inspect_activation`` tensor or a gradient, reduced to tensors by torch operations
        alone: no ``.item()``, no Python branch on values, no I/O (this runs while the graph is traced)."""
        raise NotImplementedError

    def record_summary(
        self,
        step: int,
        direction: str,
        name: str,
        path: str,
        shape: list[int],
        dtype: torch.dtype,
        summary: list[torch.Tensor],
    ) -> None:
        """On the host, once the graph computed it: ``summary`` is what :meth:`summarize` returned for the tensor
        of ``shape`` and ``dtype`` at ``path`` in the outputs of module ``name`` (``direction``: ``"forward"``, or
        ``"backward"`` for its gradient), at ``step``; called only at steps where :meth:`is_active`."""
        raise NotImplementedError

    def traceable(self) -> bool:
        """Whether graph mode at ZeRO stage 3 can call this subscriber (see the module docstring)."""
        cls = type(self)
        return (
            cls.summarize is not Subscriber.summarize
            and cls.record_summary is not Subscriber.record_summary
            and cls.pre_forward is Subscriber.pre_forward
            and cls.post_root_forward is Subscriber.post_root_forward
        )
