"""The planner's arithmetic of the axes built after its fake run: pipeline stages, context parallelism's ring, fp8.

[Note: pipeline stages in the estimate]
A pipeline rank holds its stages' layers only, cut as ``initialize`` cuts them (``pipeline_parallel/cut.py``'s
:func:`~shardtrain.pipeline_parallel.cut.cut_model`, run on the fake model), so its model state is the engine's layout
of those parameters over the stage's ``world / pp`` ranks. Its activations are not a fake run of the stage (a middle
stage takes hidden states, not token ids): the whole model's saved activations of one micro-batch (its fake run
replays the whole model's ZeRO layout at the stage's shard group) are scaled by the stage's share of the layers, and
held for as many micro-batches as the schedule keeps in flight on it: under 1F1B stage ``s`` of ``p`` starts
``min(m, p - s)`` forwards before its first backward (the first stage the most), under GPipe all ``m``; the
multi-stage schedules, the zero-bubble ones included, are counted per stage as 1F1B. The forward/backward peak of the
micro-batch in work is that share of the saved activations plus the whole model's temporaries above them (an upper
bound of a stage's): charging a stage the whole model's saved activations put the first stage's peak at pp 2 30% above
the engine's measured one (tests/estimate/test_estimate_pipeline_peak.py). Beside them, torch's stages allocate a
receive buffer per micro-batch for the activations (all but the first stage) and for their gradients (all but the
last), and the last stage keeps every micro-batch's logits for the step's merged output (:func:`pipeline_buffers`);
without them the last stage's peak was 17% under the measured one. The bubble, the idle fraction of a step with equal
stage costs, is ``(p-1)/(m + p-1)`` for GPipe and 1F1B, and for the multi-stage schedules the idle time of torch's own
action lists ([Note: a schedule's bubble from its own actions] in pipeline_parallel/order.py): it is
``(p-1)/(v*m + p-1)`` for the interleaved ones, ``(p-1)/(3*v*m + p-1)`` for the zero-bubble ones at ``v = 2`` once
``m >= 2p`` (ZBVZeroBubble's warm-up leaves more below).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardtrain.pipeline_parallel.order import is_multi_stage, simulated_bubble, stage_ids_of_rank

IN_FLIGHT_ALL = ("GPipe",)
"""Schedules that run every micro-batch's forward before any backward."""


def bubble_fraction(schedule: str, pp: int, micro_batches: int, stages_per_rank: int = 1) -> float | None:
    """The idle fraction of a step with equal stage costs ([Note: pipeline stages in the estimate]); None for a
    schedule not modelled."""
    if is_multi_stage(schedule):
        return simulated_bubble(schedule, pp, micro_batches, stages_per_rank)
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / (micro_batches + pp - 1)
    return None


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


def stage_ids(pp: int, stages_per_rank: int, pp_rank: int, schedule: str = "1F1B") -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, as ``engine/parallelize.py`` gives them (looped, or V-shaped)."""
    return stage_ids_of_rank(schedule, pp, stages_per_rank, pp_rank)


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
    rows: int, seq_len: int, kv_heads: int, head_dim: int, itemsize: int, layers: int, cp: int, passes: int = 1
) -> int:
    """Bytes one rank sends around the context-parallel ring per micro-batch (the log-sum-exp-merged ring, [Note: the
    log-sum-exp merge] in ``sequence_parallel/ring_attention.py``): in every layer a rank's own chunk (``1/cp`` of the
    sequence's keys and values) sent ``cp - 1`` times per forward pass (``passes``: 2 when a checkpointed block runs
    its forward again in backward), ``cp - 1`` times again in backward and its gradient ``cp`` times."""
    whole = 2 * rows * kv_heads * seq_len * head_dim * itemsize  # keys and values of the whole sequence
    return layers * whole // cp * (passes * (cp - 1) + (cp - 1) + cp)


def ring_keys_values(rows: int, seq_len: int, kv_heads: int, head_dim: int, itemsize: int, cp: int) -> int:
    """The keys and values of one layer the ring attention holds while it attends: a rank's own chunk and the two in
    flight, ``3 / cp`` of the sequence's (at cp 2 the other rank's one chunk: all of it)."""
    return min(3, cp) * (2 * rows * kv_heads * seq_len * head_dim * itemsize) // cp


__all__ = [
    "attention_shape",
    "bubble_fraction",
    "in_flight",
    "layer_list",
    "pipeline_buffers",
    "ring_bytes",
    "ring_keys_values",
    "stage_ids",
]
