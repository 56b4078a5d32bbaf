"""What the engine does to a forward's inputs under context parallelism (``context_parallel_size``): as under
Ulysses (:mod:`shardtrain.sequence_parallel.inputs`: labels shifted once over the whole sequence, the whole
sequence's positions, the loss over the group's real tokens), but each rank keeps two load-balanced chunks of the
sequence instead of one slice ([Note: load-balanced chunks] in :mod:`shardtrain.sequence_parallel.ring`), and no
mask is built: the attention makes its masks (causal or not, window, documents, padding) from the tokens' global
positions ([Note: masks from global positions] in :mod:`shardtrain.sequence_parallel.ring_attention`).

[Note: packed documents under context parallelism]
Rows packing several documents say so by ``position_ids`` restarting (transformers' rule,
``find_packed_sequence_indices``: a new document wherever a position is not the previous one plus 1). The engine
numbers the documents of the whole row before the split and hands them to every layer's attention (``ContextSplit``),
which lets a query read a key only within its document, on whichever rank either lies. As transformers does, rows
are taken as packed only without a key/value cache (``use_cache=False``, or gradient checkpointing in training);
otherwise one process attends across the documents too, and so does this. A padding ``attention_mask`` ``[b, S]``
is handed to the attention whole (``ContextSplit.real``), and then, as transformers, no packing is read from the
positions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError
from shardtrain.sequence_parallel.inputs import SequenceSplitter
from shardtrain.sequence_parallel.ring import ContextSplit, positions_of


def documents_of(positions: torch.Tensor) -> torch.Tensor | None:
    """The document index of each token ``[b, S]`` from ``position_ids`` ``[b or 1, S]`` (a new document wherever a
    position is not the previous one plus 1, as transformers' ``find_packed_sequence_indices``); None when every row
    is one document."""
    starts = positions[:, 1:] - positions[:, :-1] != 1
    if not bool(starts.any()):
        return None
    return torch.cat([torch.zeros_like(starts[:, :1]), starts], dim=1).long().cumsum(dim=1)


class ContextSplitter(SequenceSplitter):
    """Splits the inputs of each forward into this rank's share of its cp rank's two chunks and combines the loss
    over the ranks sharing the sequence; :attr:`current` is the split the attention reads ([Note: packed documents
    under context parallelism]). ``comm``: those ranks, ``cp * sp`` of them, ranked ``cp_rank * sp + sp_rank``
    ([Note: the context axis] in :mod:`shardtrain.distributed.mesh`); ``cp``: the context-parallel size (the
    group's size without Ulysses)."""

    def __init__(self, module: nn.Module, comm: Communicator, cp: int | None = None) -> None:
        super().__init__(module, comm)
        self.cp = cp or comm.size
        self.sp = comm.size // self.cp  # Ulysses' ranks within a cp rank: each holds 1/sp of its two chunks
        self.current = ContextSplit(0)

    def _length(self, args: tuple, kwargs: dict[str, Any]) -> int:
        length = super()._length(args, kwargs)
        if length % (2 * self.size):
            ulysses = f" x sequence_parallel_size {self.sp}" if self.sp > 1 else ""
            raise ConfigError(
                f"sequence length {length} is not divisible by 2 x context_parallel_size {self.cp}{ulysses}: each cp "
                f"rank holds two of {2 * self.cp} equal chunks (one near the start, one near the end, so that causal "
                f"work is equal){', split over its sp ranks' if self.sp > 1 else ''}. Pad every sequence at the end "
                f"to a multiple of {2 * self.size} (labels -100 there)"
            )
        return length

    def _slice(self, v: Any) -> Any:
        if not torch.is_tensor(v) or v.dim() < 2:
            return v
        cp_rank, sp_rank = divmod(self.rank, self.sp)
        mine = positions_of(v.shape[1], self.cp, cp_rank, v.device)  # this cp rank's two chunks
        per = mine.shape[0] // self.sp  # Ulysses' all-to-all gathers them back in sp-rank order
        return v.index_select(1, mine[sp_rank * per : (sp_rank + 1) * per])

    def _whole_mask(
        self, mask: Any, positions: torch.Tensor | None, first: torch.Tensor, length: int, kwargs: dict[str, Any]
    ) -> None:
        """No mask for the model: the attention reads :attr:`current` ([Note: masks from global positions])."""
        if mask is not None and (not torch.is_tensor(mask) or mask.dim() != 2 or tuple(mask.shape) != first.shape[:2]):
            shape = tuple(mask.shape) if torch.is_tensor(mask) else mask
            raise ConfigError(
                f"an attention_mask {shape} under context parallelism: only a [batch, seq] padding mask of the inputs' "
                f"shape {tuple(first.shape[:2])} is built (1 on real tokens, 0 on padding); pack documents by "
                "position_ids restarting at 0"
            )
        if mask is not None and self._hf_config is None and not bool(mask.all()):
            raise ConfigError(
                f"an attention_mask with padding under context parallelism is built for transformers models; "
                f"{self._model_name} is not one: pad at the end with targets -100 and pass no mask"
            )
        real = mask.bool() if mask is not None and not bool(mask.all()) else None
        documents = None
        # as transformers: rows are taken as packed only without a padding mask and without a key/value cache
        if self._hf_config is not None and positions is not None and mask is None and not self._uses_cache(kwargs):
            documents = documents_of(positions)
            if documents is not None and documents.shape[0] != first.shape[0]:
                documents = documents.expand(first.shape[0], -1)
        self.current = ContextSplit(length, documents, real, causal=self._causal)
        return None


__all__ = ["ContextSplitter", "documents_of"]
