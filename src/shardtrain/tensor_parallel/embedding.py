"""Tensor-parallel embeddings, built from an existing ``nn.Embedding`` in place.

* :class:`VocabParallelEmbedding` is Megatron's: the table's rows (the vocabulary) are split, each rank looks up
  the ids it owns, zeroes the others and the ranks' results are summed (``g``). Its split matches a
  column-parallel LM head's, so a tied embedding/head weight is cut once and serves both.
* :class:`HiddenParallelEmbedding` (fairscale's ``ParallelEmbedding``, Hugging Face's ``embedding_colwise``)
  splits the embedding dimension: every rank looks up a slice of every vector and the slices are all-gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.placement import ParameterSharder, ShapeOf, TPPlacement, own_shape
from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel.communication import gather_from_tp_region, reduce_from_tp_region
from shardtrain.tensor_parallel.rng import RegionRNG


def _check_embedding(module: nn.Module, name: str) -> None:
    if not isinstance(module, nn.Embedding):
        raise LayoutError(
            f"{name or 'the module'} ({type(module).__name__}) cannot take an embedding style: those apply to "
            "nn.Embedding only."
        )
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise LayoutError(
            f"{name or 'the embedding'}: max_norm, scale_grad_by_freq and sparse are not supported with a "
            "tensor-parallel embedding (they act on whole rows or on per-batch counts); turn them off or leave "
            "the embedding replicated."
        )


class _ParallelEmbedding(nn.Module):
    def __init__(self, module: nn.Embedding, comm: Communicator, rng: RegionRNG | None, name: str) -> None:
        super().__init__()
        self.weight = module.weight  # the same Parameter, already cut to this rank's block
        self.num_embeddings, self.embedding_dim = module.num_embeddings, module.embedding_dim
        self.padding_idx = module.padding_idx
        self.comm, self.rng, self.name = comm, rng, name

    @classmethod
    def from_module(
        cls,
        module: nn.Embedding,
        comm: Communicator,
        *,
        rng: RegionRNG | None = None,
        sharder: ParameterSharder | None = None,
        name: str = "",
    ) -> _ParallelEmbedding:
        """Shard ``module`` in place and return the layer to put in its place (an instance of ``cls``)."""
        sharder = sharder or ParameterSharder(comm.rank, comm.size)
        placement = cls.placements(module, name=name, shape_of=sharder.global_shape)["weight"]
        sharder.shard(module.weight, placement, f"{name}.weight" if name else "weight")
        return cls(module, comm, rng, name)

    @staticmethod
    def placements(module: nn.Module, *, name: str = "", shape_of: ShapeOf = own_shape) -> dict[str, TPPlacement]:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.comm.size}"


class VocabParallelEmbedding(_ParallelEmbedding):
    """Megatron's ``VocabParallelEmbedding``: rows split; out-of-range ids masked; partial lookups summed.

    ``ids [*]`` replicated (global vocabulary ids) -> ``[*, d]`` replicated. A ``padding_idx`` keeps a zero
    gradient on the rank that owns that row.
    """

    @staticmethod
    def placements(module: nn.Module, *, name: str = "", shape_of: ShapeOf = own_shape) -> dict[str, TPPlacement]:
        _check_embedding(module, name)
        return {"weight": TPPlacement(0, 1, shape_of(module.weight))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [*] replicated
        if self.rng is not None:
            self.rng.exit()
        per = self.weight.shape[0]  # rows this rank owns: [start, start + per)
        start = self.comm.rank * per
        outside = (ids < start) | (ids >= start + per)  # [*]
        local_ids = (ids - start).masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = pad - start if pad is not None and start <= pad < start + per else None
        out = F.embedding(local_ids, self.weight, local_pad)  # [*, d]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # only the rows this rank owns
        return reduce_from_tp_region(out, self.comm, self.name)  # [*, d]


class HiddenParallelEmbedding(_ParallelEmbedding):
    """Embedding split on the embedding dimension (Hugging Face's ``embedding_colwise``).

    ``ids [*]`` replicated -> local ``[*, d/N]`` -> all-gathered ``[*, d]`` replicated.
    """

    @staticmethod
    def placements(module: nn.Module, *, name: str = "", shape_of: ShapeOf = own_shape) -> dict[str, TPPlacement]:
        _check_embedding(module, name)
        return {"weight": TPPlacement(1, 1, shape_of(module.weight))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [*] replicated
        if self.rng is not None:
            self.rng.exit()
        out = F.embedding(ids, self.weight, self.padding_idx)  # [*, d/N]
        return gather_from_tp_region(out, self.comm, self.name)  # [*, d]
