"""Tensor-parallel embeddings, built from an existing ``nn.Embedding`` in place.

* :class:`VocabParallelEmbedding` is Megatron's: the table's rows (the vocabulary) are split, each rank looks up
  the ids it owns, zeroes the others and the ranks' results are summed (``g``). Its split matches a
  column-parallel LM head's, so a tied embedding/head weight is cut once and serves both.
* :class:`HiddenParallelEmbedding` (fairscale's ``ParallelEmbedding``, Hugging Face's ``embedding_colwise``)
  splits the embedding dimension: every rank looks up a slice of every vector and the slices are all-gathered.
* :class:`KeptEmbeddingParallel` does either around the forward of an embedding subclass that computes something of
  its own (Gemma's scaled embedding), keeping the module object ([Note: a plan keeps a module's meaning]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.placement import ParameterSharder, ShapeOf, TPPlacement, own_shape
from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel.communication import gather_from_tp_region, reduce_from_tp_region
from shardtrain.tensor_parallel.keeps_meaning import local_padding_idx
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


class KeptEmbeddingParallel:
    """An embedding with a forward of its own, split in place and parallelized around that forward.

    The module object stays where it is ([Note: a plan keeps a module's meaning]); its weight is cut to this
    rank's block and two hooks do what :class:`VocabParallelEmbedding` / :class:`HiddenParallelEmbedding` do
    around the lookup, with the module's own forward (a scale, a norm) in between:

    * vocabulary split: the pre-hook maps the ids to this rank's rows (others to row 0), the module's forward runs,
      the post-hook zeroes the positions of ids this rank does not own and sums over the ranks (``g``). The
      module's ``padding_idx`` becomes this rank's local index (``None`` where another rank owns it), so that
      ``F.embedding`` keeps the padding row's gradient zero on its owner only;
    * hidden split: the module's forward runs on this rank's columns; the post-hook all-gathers them.

    :func:`~.meaning.check_kept` has checked on a probe that the forward commutes with the split.
    """

    def __init__(self, module: nn.Embedding, comm: Communicator, rng: RegionRNG | None, name: str, vocab: bool):
        self.comm, self.rng, self.name, self.vocab = comm, rng, name, vocab
        self._outside: torch.Tensor | None = None  # set by the pre-hook, read by the post-hook of the same call
        if vocab:
            per = module.weight.shape[0]  # already cut: rows [start, start + per) are this rank's
            self.start, self.per = comm.rank * per, per
            module.padding_idx = local_padding_idx(module.padding_idx, self.start, per)

    @classmethod
    def install(
        cls,
        module: nn.Embedding,
        comm: Communicator,
        *,
        vocab: bool,
        rng: RegionRNG | None = None,
        sharder: ParameterSharder | None = None,
        name: str = "",
    ) -> KeptEmbeddingParallel:
        """Cut ``module``'s weight in place and register the hooks on it; the module itself stays."""
        sharder = sharder or ParameterSharder(comm.rank, comm.size)
        layer = VocabParallelEmbedding if vocab else HiddenParallelEmbedding
        placement = layer.placements(module, name=name, shape_of=sharder.global_shape)["weight"]
        sharder.shard(module.weight, placement, f"{name}.weight" if name else "weight")
        hooks = cls(module, comm, rng, name, vocab)
        module.register_forward_pre_hook(hooks.before)
        module.register_forward_hook(hooks.after, prepend=True)  # before any hook of the model's: they see the sum
        return hooks

    def before(self, _module: nn.Module, args: tuple) -> tuple | None:
        if self.rng is not None:
            self.rng.exit()
        if not self.vocab:
            return None
        ids = args[0]  # [*] replicated, global ids
        outside = (ids < self.start) | (ids >= self.start + self.per)
        self._outside = outside
        return ((ids - self.start).masked_fill(outside, 0), *args[1:])

    def after(self, _module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        if not self.vocab:
            return gather_from_tp_region(out, self.comm, self.name)  # [*, d/N] -> [*, d]
        outside, self._outside = self._outside, None
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # [*, d]: only the ids this rank owns
        return reduce_from_tp_region(out, self.comm, self.name)


def kept_parallel(module: nn.Module) -> bool:
    """Whether ``module`` was already split in place by :class:`KeptEmbeddingParallel`."""
    hooks = (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
    return any(isinstance(getattr(h, "__self__", None), KeptEmbeddingParallel) for h in hooks)
