"""Ulysses sequence parallelism on fake tensors: the engine's own splitter and attention, over a shape-only group.

[Note: sequence parallelism on fake tensors]
The planner runs the engine's own Ulysses code (docs/sequence-parallel.md) on the fake model of rank 0 of a group:
:func:`~shardtrain.sequence_parallel.install_ulysses` routes its attention through the exchange (refusing, in its
words, a ``P`` that does not divide a rank's heads) and the engine's splitter
(:func:`~shardtrain.sequence_parallel.make_splitter`) cuts the batch and combines the slices' losses, over
:class:`ShapeOnlyGroup`, a communicator that moves nothing and gives every collective's output its shape. So the
forward and backward on the slice, the exchange's buffers (sent, received, concatenated, each way and in backward),
the loss's sum over the group and a MoE's router logits gathered for the whole sequence all run on fake tensors.
The split itself reads values (each slice's real targets are counted, the ranks' batches compared by digest), so it
runs on a real batch of token ids outside the fake mode; the tensors it hands the model are copied into fake ones,
counted with the batch the caller holds. A real rank receives in its all-to-alls exactly the bytes it sends, so no
routing assumption enters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardtrain.errors import ShardtrainError
from shardtrain.estimate import wire


class ShapeOnlyGroup:
    """What the Ulysses path asks of a sequence-parallel group's
    :class:`~shardtrain.distributed.communicator.Communicator`, for rank 0 of ``size`` ranks: an all-to-all leaves
    the output it is given as it is (allocated by the caller in the received shape), a sum leaves its tensor, a
    gather allocates what the communicator's does (the stacked parts, then their concatenation), every part this
    rank's, and an object gather returns ``size`` copies. Works on fake and real tensors alike; each call is noted
    for the time model (:mod:`.wire`)."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank, self.global_rank = size, rank, rank
        self.ranks = list(range(size))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *, what: str) -> None:
        wire.note("all_to_all", "sp", self.size, inp.numel() * inp.element_size())

    def all_reduce(self, t: torch.Tensor, op: Any = "sum", *, what: str) -> None:
        wire.note("all_reduce", "sp", self.size, t.numel() * t.element_size())

    def all_gather_dim(self, inp: torch.Tensor, dim: int, *, what: str) -> torch.Tensor:
        wire.note("all_gather", "sp", self.size, inp.numel() * inp.element_size() * self.size)
        stacked = torch.stack([inp] * self.size)  # as Communicator.all_gather_dim lands the parts
        return torch.cat(stacked.unbind(0), dim=dim % inp.dim())

    def all_gather_object(self, obj: Any, *, what: str) -> list[Any]:
        return [obj] * self.size

    def broadcast(self, t: torch.Tensor, src: int = 0, *, what: str) -> None:
        return None


def install_sequence_parallel(model: nn.Module, sp: int, tp: int = 1) -> Any:
    """Rank 0's view of ``model`` (fake tensors, already split for ``tp``) under Ulysses of size ``sp``, as
    ``engine/parallelize.py`` installs it: the splitter of its inputs, with the exchange around its attention. Refuses
    what ``initialize`` refuses (a size that does not divide the heads, a model whose sequence cannot be split), in
    its words."""
    from shardtrain.sequence_parallel import install_ulysses, make_splitter

    splitter = make_splitter(model, ShapeOnlyGroup(sp))  # type: ignore[arg-type]
    install_ulysses(
        model,
        splitter.comm,
        tp=tp,
        key_limit=getattr(splitter, "key_limit", None),
        whole_inputs=getattr(splitter, "whole_inputs", None),
    )
    return splitter


def refuse_shared_config(model: nn.Module, name: str) -> None:
    """A transformers model built by a factory whose models share one config object: Ulysses is installed in the
    config (its attention implementation), so every later model of the factory would run it."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if isinstance(implementation, str) and implementation.startswith("shardtrain_ulysses"):
        raise ShardtrainError(
            f"estimate: the factory {name!r} returned a model whose config already runs Ulysses attention: its models "
            "share one config object, which sequence parallelism changes; return a model with a config of its own "
            "at each call (e.g. build the config inside the factory)"
        )


def split_batch(splitter: Any, batch: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """The engine's split of a real ``batch`` (see [Note: sequence parallelism on fake tensors]); call outside the
    fake-tensor mode."""
    args, kwargs = batch
    return splitter.split(args, kwargs)


def as_fake(value: Any) -> Any:
    """``value`` with every tensor copied by an operator, once however often it appears (inside the fake-tensor
    mode: a fake tensor, which the memory tracker counts as it counts the batch)."""
    from torch.utils._pytree import tree_map_only

    copies: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in copies:
            copies[id(t)] = t.clone()
        return copies[id(t)]

    return tree_map_only(torch.Tensor, copy, value)
