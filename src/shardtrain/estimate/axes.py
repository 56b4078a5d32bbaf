"""The planner's arithmetic of the axes built after its fake run: pipeline stages, context parallelism's ring, fp8.

[Note: pipeline stages in the estimate]
A pipeline rank holds its stages' layers only, cut as ``initialize`` cuts them (``pipeline_parallel/cut.py``'s
:func:`~shardtrain.pipeline_parallel.cut.cut_model`, run on the fake model), so its model state is the engine's layout
of those parameters over the stage's ``world / pp`` ranks. Its activations are not a fake run of the stage (a middle
stage takes hidden states, not token ids): the whole model's saved activations of one micro-batch (its fake run
replays the whole model's ZeRO layout at the stage's shard group) are scaled by the stage's share of the layers, and
held for as many micro-batches as the schedule keeps in flight on it: under 1F1B stage ``s`` of ``p`` starts
``min(m, p - s)`` forwards before its first backward (the first stage the most), under GPipe all ``m``. The
forward/backward peak of the micro-batch in work is that share of the saved activations plus the whole model's
temporaries above them (an upper bound of a stage's): charging a stage the whole model's saved activations put the
first stage's peak at pp 2 30% above the engine's measured one (tests/estimate/test_estimate_pipeline_peak.py).
Beside them, torch's stages allocate a receive buffer per micro-batch for the activations (all but the first stage)
and for their gradients (all but the last), and the last stage keeps every micro-batch's logits for the step's merged
output (:func:`pipeline_buffers`); without them the last stage's peak was 17% under the measured one. The
bubble, the
idle fraction of a step with equal stage costs, is ``(p-1)/(v*m + p-1)`` for ``v`` stages per rank (GPipe and 1F1B:
``v = 1``); the zero-bubble schedules are not modelled and say so.
"""

from __future__ import annotations

from typing import Any

from torch import nn

IN_FLIGHT_ALL = ("GPipe",)
"""Schedules that run every micro-batch's forward before any backward."""
BUBBLE_MODELLED = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
"""Schedules whose bubble is ``(p-1)/(v*m + p-1)`` ([Note: pipeline stages in the estimate])."""


def bubble_fraction(schedule: str, pp: int, micro_batches: int, stages_per_rank: int = 1) -> float | None:
    """The idle fraction of a step with equal stage costs; None for a schedule not modelled."""
    if schedule not in BUBBLE_MODELLED:
        return None
    return (pp - 1) / (stages_per_rank * micro_batches + pp - 1)


def in_flight(schedule: str, pp: int, micro_batches: int, pp_rank: int = 0, stages_per_rank: int = 1) -> int:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at once, per stage it runs ([Note: pipeline
    stages in the estimate]); the interleaved schedules' warm-up is counted per stage as 1F1B's."""
    if schedule in IN_FLIGHT_ALL:
        return micro_batches
    return min(micro_batches, pp - pp_rank)


def pipeline_buffers(pp: int, pp_rank: int, micro_batches: int, boundary: int, output: int) -> tuple[int, int]:
    """(receive buffers, outputs kept) of pipeline rank ``pp_rank`` for a step, in bytes ([Note: pipeline stages in
    the estimate]): torch's stages allocate one activation receive buffer per micro-batch (every stage but the
    first) and one gradient receive buffer per micro-batch (every stage but the last), each a boundary activation
    (``boundary`` bytes); the last stage keeps every micro-batch's output (``output`` bytes: the logits) until the
    step merges them."""
    first, last = pp_rank == 0, pp_rank == pp - 1
    receive = micro_batches * boundary * ((not first) + (not last))
    return receive, micro_batches * output if last else 0


def stage_ids(pp: int, stages_per_rank: int, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, as ``engine/parallelize.py`` gives them (looped)."""
    return list(range(pp_rank, pp * stages_per_rank, pp))


def layer_list(model: nn.Module) -> Any:
    """The repeated layers a pipeline cuts (the project's GPT's ``blocks``, a decoder's ``model.layers``)."""
    inner = getattr(model, "model", None)
    return inner.layers if inner is not None and hasattr(inner, "layers") else model.blocks


def attention_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(layers, key/value heads, head dimension) of a decoder: a transformers config's, or the project's GPT's; None
    for a model that says neither."""
    cfg = getattr(model, "config", None)
    if hasattr(cfg, "num_hidden_layers"):
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cfg.num_hidden_layers, kv, head_dim
    cfg = getattr(model, "cfg", None)
    if all(hasattr(cfg, a) for a in ("n_layer", "n_head", "d_model")):
        return cfg.n_layer, cfg.n_head, cfg.d_model // cfg.n_head
    return None


def ring_bytes(
    rows: int,
    seq_len: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    layers: int,
    cp: int,
    passes: int = 1,
    merged: bool = False,
) -> tuple[int, int]:
    """(bytes one rank sends around the context-parallel ring, bytes it reduce-scatters in backward) per
    micro-batch. Gathered ([Note: which context attention] in ``sequence_parallel/ring.py``): every layer passes the
    keys and values of its sequence chunks in ``cp - 1`` steps (``passes``: 2 when a checkpointed block runs its
    forward again in backward), and reduce-scatters their gradients, each ``(cp - 1) / cp`` of the whole sequence's
    keys and values. ``merged`` (the log-sum-exp-merged ring, [Note: the log-sum-exp merge] in
    ``sequence_parallel/ring_attention.py``): a rank's own chunk (``1/cp`` of them) sent ``cp - 1`` times per forward
    pass, ``cp - 1`` times again in backward and its gradient ``cp`` times; nothing reduce-scattered."""
    whole = 2 * rows * kv_heads * seq_len * head_dim * itemsize  # keys and values of the whole sequence
    if merged:
        return layers * whole // cp * (passes * (cp - 1) + (cp - 1) + cp), 0
    moved = layers * whole * (cp - 1) // cp
    return passes * moved, moved


def gathered_keys_values(
    rows: int, seq_len: int, kv_heads: int, head_dim: int, itemsize: int, cp: int = 1, merged: bool = False
) -> int:
    """The keys and values of one layer the ring attention holds while it attends: the whole sequence's (gathered),
    or (``merged``) a rank's own chunk and the two in flight, ``3 / cp`` of them."""
    whole = 2 * rows * kv_heads * seq_len * head_dim * itemsize
    return 3 * whole // cp if merged else whole


__all__ = [
    "attention_shape",
    "bubble_fraction",
    "gathered_keys_values",
    "in_flight",
    "layer_list",
    "pipeline_buffers",
    "ring_bytes",
    "stage_ids",
]
