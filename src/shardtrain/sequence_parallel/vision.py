"""Sequence parallelism for vision transformers: the patch sequence is split after the embeddings, not on the inputs.

[Note: vision transformers under Ulysses]
The sequence (patches, class token, DeiT's distillation token) is made inside the model by ``embeddings``, so the
inputs are not cut: every rank of the group runs the embeddings on the whole batch, and a forward hook keeps its
slice of their output, padded at the end to a multiple of ``P``. The encoder's attention goes through Ulysses
(:func:`shardtrain.sequence_parallel.ulysses.install_hf`); after the exchange the padded keys are dropped
(``key_limit``, looked up by the padded length so that a backbone run at two resolutions, or recomputed under
checkpointing, keeps each one's), so no mask is needed.

A pre-hook on the final ``layernorm`` gathers the slices and drops the padding: the norm, pooler, head and loss run
on the whole sequence on every rank, so a class-token head and a per-patch one are both served. Every rank
backpropagates that same loss, so the gather's backward (``gather_over_group``) gives each slice ``P`` times its
gradient; ZeRO's average over the ``dp * P`` ranks ([Note: the sequence axis] in :mod:`shardtrain.distributed.mesh`)
makes it the sum over the slices, as in one process.

The inputs are compared at the first forward and then broadcast from sp rank 0: a per-rank augmentation would embed a
different image on each rank. Refused: stochastic depth (it would drop a sample's branch in some slices only),
attention outside transformers' interface (no exchange between split and gather), bases without ``embeddings`` and a
final ``layernorm``, video and audio models (frames made by convolutions over neighbouring ones).
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


def _refuse_unshared_randomness(model: nn.Module) -> None:
    """Stochastic depth (``drop_path_rate``) drops a sample's residual branch: drawn on each rank apart, a sample
    would keep the branch in some slices and drop it in others, which is no model's computation. Refused by name."""
    config = getattr(unwrapped(model), "config", None)
    rate = getattr(config, "drop_path_rate", 0.0) or 0.0
    if rate > 0:
        raise ConfigError(
            f"{type(unwrapped(model)).__name__} has drop_path_rate {rate}: under sequence parallelism each rank "
            "would drop a sample's residual branch for its own slice of the patches, not for the whole sample. "
            "Set drop_path_rate to 0, or train without sequence_parallel_size"
        )


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The base model's ``embeddings`` and final ``layernorm``, or a refusal naming what is missing."""
    outer = unwrapped(model)
    if getattr(getattr(outer, "config", None), "num_frames", None):
        raise ConfigError(
            f"{type(outer).__name__} is a video model: its patches are cut from frames in time too (tubelets), and "
            "sequence parallelism is built for vision transformers on images, not for video models yet. Train it "
            "without sequence_parallel_size"
        )
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
        _refuse_unshared_randomness(module)
        self._model_name = type(unwrapped(module)).__name__
        self._batch_check = BatchCheck(comm)
        # the real length of each padded length split in this micro-step's forwards: kept until the next forward,
        # since activation checkpointing runs the attention again in backward (a backbone called twice per forward,
        # multi-crop, has one entry per resolution)
        self._real: dict[int, int] = {}
        self._length = 0  # the real length of the sequence between a split and its gather
        self._split_pending = False
        self._attended = 0  # Ulysses attention calls since the last split: none means the model bypassed it
        self.hooks = [embeddings.register_forward_hook(self._split), norm.register_forward_pre_hook(self._gather)]

    def key_limit(self, padded: int) -> int | None:
        """How many of ``padded`` keys are real after the exchange (the padding is dropped from the keys); None: no
        padding. Called by the Ulysses attention at every call."""
        self._attended += 1
        real = self._real.get(padded)
        return real if real is not None and real != padded else None

    def split(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The inputs, as sp rank 0 has them: checked the same on every rank at the first forward, and from then on
        broadcast from sp rank 0 (image augmentations drawn per rank would otherwise embed a different image on each
        rank of the group, and each slice would be a different image's)."""
        self._batch_check(args, kwargs)
        self._real = {}
        if self.size == 1:
            return args, kwargs
        return tuple(self._from_rank0(a) for a in args), {k: self._from_rank0(v) for k, v in kwargs.items()}

    def _from_rank0(self, value: Any) -> Any:
        if not torch.is_tensor(value):
            return value
        mine = value.detach().clone().contiguous()  # the caller's tensor is left as it was
        self.comm.broadcast(mine, 0, what="the inputs of a sequence-parallel group (from sp rank 0)")
        return mine

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

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
        padded = per * self.size
        if self._real.get(padded, length) != length:
            raise ConfigError(
                f"{self._model_name} embedded sequences of {self._real[padded]} and {length} tokens in one forward, "
                f"which both pad to {padded} at sequence_parallel_size {self.size}: the attention could not tell "
                "their padding apart. Give the crops sizes that pad to different lengths, or train without "
                "sequence_parallel_size"
            )
        self._real[padded] = length
        self._length, self._split_pending, self._attended = length, True, 0
        if padded > length:
            output = nn.functional.pad(output, (0, 0, 0, padded - length))
        return output.narrow(1, self.rank * per, per)

    def _gather(self, module: nn.Module, args: tuple) -> tuple:
        if not self._split_pending:  # the norm called outside a forward of the whole model
            return args
        self._split_pending = False
        if not self._attended:
            raise ConfigError(
                f"{self._model_name}'s attention did not go through the Ulysses exchange (it does not call "
                "transformers' attention interface): each rank would attend within its slice only. Sequence "
                "parallelism is not built for it; train it without sequence_parallel_size"
            )
        whole = gather_over_group(args[0].contiguous(), self.comm, 1, "the patch sequence before the final norm")
        return (whole[:, : self._length], *args[1:])
