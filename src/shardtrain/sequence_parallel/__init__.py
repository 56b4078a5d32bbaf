"""Ulysses sequence parallelism (``sequence_parallel_size``; docs/sequence-parallel.md) and context parallelism
(``context_parallel_size``, ring attention; docs/context-parallel.md).

    all_to_all.py  the all-to-all trading a sequence split for a head split, and the loss's sum, as autograd Functions
    ulysses.py     attention around the exchange; plugged into transformers models and the project's GPT
    inputs.py      what the engine does to a forward's inputs (split, shifted labels, positions, masks) and its loss
    seq2seq.py     an encoder-decoder model's two sequences, split; its cross-attention through the same exchange
    vision.py      a vision transformer's patch sequence, split after its embeddings and gathered before its norm
    model_kinds.py what a model does with the sequence (shifts its labels? causal attention?) and what is refused
    router_loss.py a mixture of experts' load-balancing loss over the whole sequence
    ring.py        context-parallel attention: load-balanced chunks, keys and values gathered over the cp group
    context_inputs.py  what the engine does to a forward's inputs under context parallelism (chunks, documents)
    tiling.py      ALST's tiled loss and tiled MLP (``tiled_logits_loss``, ``tiled_mlp_compute``), with or without
                   sequence parallelism

The mesh axis is in :mod:`shardtrain.distributed.mesh` ([Note: the sequence axis]).
"""

from __future__ import annotations

from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.sequence_parallel.context_inputs import ContextSplitter
from shardtrain.sequence_parallel.inputs import SequenceSplitter
from shardtrain.sequence_parallel.ring import install as install_context_attention
from shardtrain.sequence_parallel.seq2seq import Seq2SeqSplitter, is_encoder_decoder
from shardtrain.sequence_parallel.ulysses import install as install_ulysses
from shardtrain.sequence_parallel.ulysses import kv_repeats, ulysses
from shardtrain.sequence_parallel.vision import PatchSplitter, is_vision

__all__ = [
    "ContextSplitter",
    "PatchSplitter",
    "Seq2SeqSplitter",
    "SequenceSplitter",
    "install_context_attention",
    "install_ulysses",
    "kv_repeats",
    "make_splitter",
    "ulysses",
]


def make_splitter(module: nn.Module, comm: Communicator) -> SequenceSplitter | PatchSplitter | Seq2SeqSplitter:
    """What splits a forward's sequence over ``comm``'s group: the inputs (tokens), a vision transformer's patches
    after its embeddings ([Note: vision transformers under Ulysses] in :mod:`shardtrain.sequence_parallel.vision`),
    or an encoder-decoder model's two sequences ([Note: encoder-decoder models under Ulysses] in
    :mod:`shardtrain.sequence_parallel.seq2seq`)."""
    if is_vision(module):
        return PatchSplitter(module, comm)
    if is_encoder_decoder(module):
        return Seq2SeqSplitter(module, comm)
    return SequenceSplitter(module, comm)
