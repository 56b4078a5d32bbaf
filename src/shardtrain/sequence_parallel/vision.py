"""Sequence parallelism for vision transformers: the patch sequence is split after the embeddings, not on the inputs.

[Note: vision transformers under Ulysses]
A vision transformer (ViT, DeiT, DINOv2, ...) is given ``pixel_values [b, c, h, w]``: its sequence, the patches plus
a class token (and DeiT's distillation token), is made inside the model by its ``embeddings`` module. So the engine
does not cut the inputs. Every rank of a sequence-parallel group gets the same whole batch and runs the embeddings
on it. A forward hook then keeps rank ``r``'s slice of their output: ``[r * S'/P, (r + 1) * S'/P)`` of the sequence
padded at the end to ``S'``, the next multiple of ``P`` (197 tokens at ``P`` 2 become 198).

- **The encoder** runs on the slices. Its attention goes through Ulysses
  (:func:`shardtrain.sequence_parallel.ulysses.install_hf`). After the exchange a rank holds the whole padded
  sequence for its heads. The padded keys are hidden from every query: ``key_limit`` gives the real length ``S``.
  Attention is bidirectional, so a padded token changes no real token's output.
- **Before the final norm** (``layernorm``, a forward pre-hook) the slices are gathered into the whole sequence and
  the padding is dropped. From there every rank computes the same thing on the whole sequence: the norm, the
  pooler, the head and its loss, whether the head reads the class token (classification) or every patch (masked
  image modelling). So no head is refused here.
- **The gradients.** The gather is :func:`~shardtrain.sequence_parallel.all_to_all.gather_over_group`. Its
  backward sums the group's gradients of the whole sequence and keeps this rank's slice. Every rank backpropagates
  the same loss, so a slice receives ``P`` times its gradient. ZeRO averages over the ``dp * P`` ranks of the group
  ([Note: the sequence axis] in :mod:`shardtrain.distributed.mesh`), so the encoder's gradient is the sum over the
  slices, as in one process. The parameters after the gather (the norm, the head) have the same gradient on every
  rank, and the average keeps it. The loss is returned as the model computed it, the same on every rank of the
  group.

Built for transformers models whose base model (``base_model_prefix``) has an ``embeddings`` module that returns the
sequence and a ``layernorm`` applied to the encoder's output. Others taking ``pixel_values`` are refused by name,
and so are audio models (``input_features``, ``input_values``), whose frames are made by convolutions that see
neighbouring frames.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError
from shardtrain.sequence_parallel.all_to_all import gather_over_group
from shardtrain.sequence_parallel.model_kinds import unwrapped

VISION_INPUTS = ("pixel_values",)


def is_vision(model: nn.Module) -> bool:
    """Whether ``model`` (a transformers one) makes its sequence from images (see [Note: vision transformers under
    Ulysses])."""
    return getattr(unwrapped(model), "main_input_name", None) in VISION_INPUTS


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The base model's ``embeddings`` and final ``layernorm``, or a refusal naming what is missing."""
    outer = unwrapped(model)
    base = getattr(outer, getattr(outer, "base_model_prefix", ""), None) or outer
    embeddings, norm = getattr(base, "embeddings", None), getattr(base, "layernorm", None)
    if not isinstance(embeddings, nn.Module) or not isinstance(norm, nn.Module):
        raise ConfigError(
            f"{type(outer).__name__} takes pixel_values, and sequence parallelism splits a vision model's patch "
            f"sequence after its `embeddings` and gathers it before its final `layernorm` ([Note: vision transformers "
            f"under Ulysses]); {type(base).__name__} has no such modules (a hierarchical model such as Swin, or "
            "convolutions, changes its sequence between stages). Train it without sequence_parallel_size"
        )
    return embeddings, norm


class PatchSplitter:
    """Splits the patch sequence of a vision transformer inside its forward (see the module's Note); the engine's
    ``split`` and ``combine`` leave the inputs and the loss as they are."""

    def __init__(self, module: nn.Module, comm: Communicator) -> None:
        from shardtrain.sequence_parallel.inputs import BatchCheck

        self.comm = comm
        self.size, self.rank = comm.size, comm.rank
        embeddings, norm = _parts(module)
        self._batch_check = BatchCheck(comm)
        # the real and the padded length of the last forward's sequence: kept until the next one, since
        # activation checkpointing runs the attention again in backward
        self._length: int | None = None
        self._padded = 0
        self._split_pending = False  # between the split of a forward and its gather
        self.hooks = [embeddings.register_forward_hook(self._split), norm.register_forward_pre_hook(self._gather)]

    def key_limit(self) -> int | None:
        """How many keys are real after the exchange (the padding is hidden from the queries); None: no padding."""
        return self._length if self._length is not None and self._padded != self._length else None

    def split(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        self._batch_check(args, kwargs)
        return args, kwargs

    def combine(self, output: Any) -> Any:
        return output  # every rank of the group computed the whole sequence's loss

    def _split(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(output) or output.dim() != 3:
            raise ConfigError(
                f"the embeddings of a vision model under sequence parallelism returned "
                f"{type(output).__name__ if not torch.is_tensor(output) else tuple(output.shape)}, not the sequence "
                "[batch, tokens, hidden] ([Note: vision transformers under Ulysses])"
            )
        length = output.shape[1]
        per = -(-length // self.size)
        self._length, self._padded, self._split_pending = length, per * self.size, True
        if self._padded > length:
            output = nn.functional.pad(output, (0, 0, 0, self._padded - length))
        return output.narrow(1, self.rank * per, per)

    def _gather(self, module: nn.Module, args: tuple) -> tuple:
        if not self._split_pending:  # the norm called outside a forward of the whole model
            return args
        self._split_pending = False
        whole = gather_over_group(args[0].contiguous(), self.comm, 1, "the patch sequence before the final norm")
        return (whole[:, : self._length], *args[1:])
