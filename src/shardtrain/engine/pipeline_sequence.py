"""Sequence or context parallelism inside each pipeline stage: the pipeline's share of the sequence split.

[Note: a sequence split in a pipeline]
Every rank of a stage's sequence group (its sp ranks or its cp ranks) is given the same
whole micro-batches, as without pipelining, and the engine splits each one as the batch splitter does
(``SequenceSplitter.split``: labels shifted once over the whole sequence, this rank's slice under Ulysses or its two
load-balanced chunks under the ring): the first stage is given this rank's tokens, so every activation the stages
send each other is this rank's share ``[rows, S / (sp * cp), width]`` and the stage shapes are per-rank shapes.
Every stage is also given, per micro-batch, its share of the position ids (rotary embeddings at global positions)
and the whole row's (``whole_positions``), from which each stage makes what its attention needs where it is
needed: under Ulysses the whole sequence's mask (transformers' own, None for plain causal attention; [Note: masks
under Ulysses]), under the ring the split its attention reads (documents from the positions, [Note: packed
documents under context parallelism]), handed to every layer call: 1F1B runs one micro-batch's forward between
another's forward and backward, so a layer recomputed in backward must not read the splitter's latest split. Rows
are read as packed always, as a pipeline's stages read them without a split (a pipeline has no key/value cache).
The last stage's loss is the micro-batch's mean over the whole sequence's real targets: this rank's sum and count
summed over the group by an all-reduce whose backward is the all-reduce of the gradients, as [Note: the loss over a
sequence-parallel group] says; ZeRO's average over the stage's ``dp * sp * cp`` ranks gives one process's gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardtrain.sequence_parallel.all_to_all import sum_over_group
from shardtrain.sequence_parallel.context_inputs import ContextSplitter, documents_of
from shardtrain.sequence_parallel.inputs import IGNORE, SequenceSplitter, whole_sequence_mask
from shardtrain.sequence_parallel.ring import ContextSplit


class SequenceInPipeline:
    """A pipeline's micro-batches split by ``splitter`` (Ulysses' or the ring's), the masks its stages make and its
    loss ([Note: a sequence split in a pipeline])."""

    def __init__(self, splitter: SequenceSplitter, config: object) -> None:
        self.splitter, self.config = splitter, config
        self.context = isinstance(splitter, ContextSplitter)

    def prepare(
        self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's tokens and shifted labels of one whole micro-batch, and what every stage is given: its
        positions and the whole row's."""
        if positions is None:
            positions = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1)
        kwargs = {"input_ids": inputs, "labels": labels, "position_ids": positions, "use_cache": False}
        _, mine = self.splitter.split((), kwargs)
        given = {"position_ids": mine["position_ids"], "whole_positions": positions.contiguous()}
        return mine["input_ids"], mine["labels"], given

    def stage_inputs(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, whole_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, object]]:
        """A stage's position ids, attention mask and what else its layers are given, for one micro-batch: the whole
        sequence's mask under Ulysses; under the ring none, and the split its attention reads, handed to every
        layer (a layer recomputed in backward keeps it with its inputs) and set as the splitter's current one."""
        rows, length = whole_positions.shape
        if self.context:
            split = ContextSplit(length, documents_of(whole_positions), None, causal=True)
            self.splitter.current = split
            return position_ids, None, {"context_split": split}
        mask = whole_sequence_mask(self.config, None, whole_positions, rows, length, hidden.device)
        return position_ids, mask, {}

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean loss over the whole sequence's real targets (``labels``: this rank's, shifted)."""
        total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        count = (labels != IGNORE).sum().to(total.dtype)
        summed = sum_over_group(torch.stack([total, count]), self.splitter.comm, "pipeline loss (sequence group)")
        return summed[0] / summed[1].clamp(min=1)


__all__ = ["SequenceInPipeline"]
