"""Context-parallel attention (``context_parallel_size``, docs/context-parallel.md): each rank of a cp group holds
two chunks of every sequence and attends its queries to the keys and values of the whole sequence.

[Note: load-balanced chunks]
A sequence of ``S`` tokens is cut into ``2 * C`` chunks of ``S / 2C``; cp rank ``r`` holds chunk ``r`` and chunk
``2C - 1 - r`` (a head and a tail, torch's ``_HeadTailLoadBalancer`` layout). Under causal attention a query of
chunk ``m`` reads the keys of chunks ``0..m``, so rank ``r`` reads ``r + 1`` and ``2C - r`` chunks: ``2C + 1`` on
every rank, the causal work equal. Every per-token input is cut this way (``positions_of``), so the model sees its
tokens in the order ``[chunk r, chunk 2C-1-r]`` and only attention needs to know where each token lies.

[Note: why not torch's context_parallel]
``torch.distributed.tensor.experimental.context_parallel`` (torch 2.13) replaces SDPA's CUDA ops
(``_scaled_dot_product_flash_attention``, ``_efficient_attention``, ``_cudnn_attention``) by a ring of them merged
by their log-sum-exp. It serves neither these models on the CPU (SDPA dispatches
``_scaled_dot_product_flash_attention_for_cpu`` there, which it does not replace) nor any mask beyond ``is_causal``
(packed documents, padding and windows need one; its load balancer requires ``is_causal``). So here each rank's
keys and values go around the cp group's ring (``Communicator.ring_step``), attended as they arrive and merged by
log-sum-exp ([Note: the log-sum-exp merge] in :mod:`shardtrain.sequence_parallel.ring_attention`), masked from
global positions ([Note: masks from global positions]).

[Note: which context attention]
Every cp size runs the log-sum-exp-merged ring. Its alternative, all the keys and values gathered first and attended
by one SDPA call per local query chunk (Llama 3's all-gather context parallelism), served ``C = 2`` until issue
49's close removed it. Measured (docs/benchmarks.md, issue 49, gloo on 2 shared CPU cores): at ``C = 2`` its
attention saved 5.42x the ``1/C`` share of one process's activations for backward (9,191,424 bytes against the
ring's 1,695,744, a Llama at ``S`` 1536: torch's CPU SDPA saves its ``(S/C) x S`` float mask, every layer), so it
missed the ``1/C`` goal and grew with ``S^2``. What it had for it at ``C = 2``: half the ring's bytes (its backward
one reduce-scatter, the ring's a chunk step and two gradient steps) and, with one ring step and nothing to overlap,
perhaps time: the ring took 0.99x-1.73x its time over two runs of one attention on this loaded machine, which could
not separate the two. Nothing needed it (the ring serves every mask it served), so no config key keeps it; the time
is to be measured on GPUs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError
from shardtrain.sequence_parallel.ring_attention import ContextSplit, ring_attention
from shardtrain.sequence_parallel.ulysses import kv_repeats, ulysses


def positions_of(length: int, size: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global indices of the tokens cp rank ``rank`` of ``size`` holds, in its order: chunk ``rank`` then chunk
    ``2 * size - 1 - rank`` of ``2 * size`` ([Note: load-balanced chunks])."""
    chunk = length // (2 * size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([head, tail])


def context_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    comm: Communicator,
    split: ContextSplit,
    scale: float | None = None,
    what: str = "attention",
    window: int | None = None,
) -> torch.Tensor:
    """This rank's queries ``[b, h, s, d]`` attending to the whole sequence's keys and values (this rank's ``[b, kv,
    s, d]`` and the other cp ranks'), masked as [Note: masks from global positions] says (``window``: a sliding
    window), by the log-sum-exp-merged ring ([Note: which context attention]). Returns ``[b, h, s, d]``, in the order
    of this rank's tokens."""

    def positions(rank: int) -> torch.Tensor:
        return positions_of(split.length, comm.size, rank, query.device)

    return ring_attention(query, key, value, comm, split, positions, scale, window, what)


# -- transformers models ---------------------------------------------------------------------------------------------
_counter = itertools.count()


def refuse_unserved(model: nn.Module) -> None:
    """What context attention does not serve in a transformers model, refused at initialize: an attention
    implementation other than sdpa or eager, attention dropout."""
    config = model.config
    name = type(model).__name__
    inner = config._attn_implementation or "sdpa"
    if inner.startswith("shardtrain_"):
        raise ConfigError(f"{name} already runs shardtrain's attention ({inner}): initialize it once")
    if inner not in ("sdpa", "eager"):
        raise ConfigError(
            f"attn_implementation {inner!r} under context parallelism is not built; load the model with "
            "attn_implementation='sdpa' or 'eager'"
        )
    # decoders name it attention_dropout, BERT and its kin attention_probs_dropout_prob
    dropout = getattr(config, "attention_dropout", 0.0) or getattr(config, "attention_probs_dropout_prob", 0.0) or 0.0
    if dropout:
        raise ConfigError(
            f"{name} has attention_dropout {dropout}: context attention applies none; set it to 0.0 to train with "
            "context_parallel_size"
        )


def refuse_eager_rows_without_keys(split: ContextSplit, inner: str, what: str) -> None:
    """Under a model loaded with eager attention, a query that reads no key (a left-padded row's first tokens, a
    row of padding only for an encoder) is refused: eager attention adds the dtype's minimum where SDPA masks, so
    such a row averages every value of the sequence, future ones included, where SDPA (and context attention, [Note:
    masks from global positions] in :mod:`shardtrain.sequence_parallel.ring_attention`) gives 0; the two train
    differently when that token's output has a target."""
    if inner != "eager" or split.real is None:
        return
    empty = ~split.real[:, 0] if split.causal else ~split.real.any(-1)
    if bool(empty.any()):
        raise ConfigError(
            f"{what}: rows {empty.nonzero().flatten().tolist()} begin with padding, whose queries read no key; the "
            "model's eager attention then averages every value and context attention gives 0 (as sdpa does). Load "
            "the model with attn_implementation='sdpa', or pad at the end"
        )


def _with_ulysses(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attend: Callable, sp: Communicator | None, what: str
) -> torch.Tensor:
    """``attend(q, k, v) -> [b, h, s, d]`` on this rank's tokens, or with ``sp`` (Ulysses within a cp rank, [Note:
    the context axis]) on all of its cp rank's tokens for ``h / sp`` heads, after the exchange. Returns ``[b, s, h,
    d]``."""
    if sp is None:
        return attend(query, key, value).transpose(1, 2)
    return ulysses(query, key, value, sp, lambda q, k, v: attend(q, k, v).transpose(1, 2), what)


def install_hf(
    model: nn.Module,
    comm: Communicator,
    current: Callable[[], ContextSplit],
    sp: Communicator | None = None,
    tp: int = 1,
) -> str:
    """Route ``model``'s attention through :func:`context_attention`, registered in transformers'
    ``AttentionInterface`` as Ulysses is; ``current()``: the split of the forward running; ``sp``: Ulysses' group
    within a cp rank (None without it); ``tp``: the tensor-parallel size (each rank attends ``1/tp`` of the heads
    over its own cp group). Returns the name."""
    from transformers import AttentionInterface

    refuse_unserved(model)
    inner = model.config._attn_implementation or "sdpa"
    heads = getattr(model.config, "num_attention_heads", None)
    if sp is not None and isinstance(heads, int):  # refused at initialize rather than at the first forward
        kv_heads = getattr(model.config, "num_key_value_heads", None) or heads
        kv_repeats(heads // tp, max(kv_heads // tp, 1), sp.size, tp)

    def attention(module, query, key, value, attention_mask, *, dropout=0.0, scaling=None, **kwargs):
        what = f"{type(module).__name__} {getattr(module, 'layer_idx', '')}".strip()
        if attention_mask is not None:  # the engine passes none: a mask made here would be a chunk's
            raise ConfigError(f"{what} was given an attention mask under context parallelism; pass none")
        if dropout and module.training:
            raise ConfigError(
                f"{what} applies attention dropout {dropout}; context attention applies none: set it to 0"
            )
        if kwargs.get("softcap") is not None:
            raise ConfigError(f"{what} uses softcap, which context attention does not apply yet")
        window = kwargs.get("sliding_window")  # this layer's window (None on a full layer), as transformers passes it
        if torch.is_tensor(getattr(module, "sinks", None)):
            raise ConfigError(f"{what} has attention sinks, which context attention does not apply yet")

        # a pipeline stage hands its micro-batch's split to every layer ([Note: a sequence split in a pipeline] in
        # engine/pipeline_sequence.py): kept with the layer's inputs, so a layer recomputed in backward reads its own
        given = kwargs.get("context_split")

        def attend(q, k, v):
            split = given if given is not None else current()
            refuse_eager_rows_without_keys(split, inner, what)
            return context_attention(q, k, v, comm, split, scaling, what, window)

        return _with_ulysses(query, key, value, attend, sp, what).contiguous(), None  # [b, s, h, d], as transformers'

    name = f"shardtrain_context_{next(_counter)}"
    AttentionInterface.register(name, attention)
    model.config._attn_implementation = name
    return name


# -- the project's GPT -----------------------------------------------------------------------------------------------
def install_gpt(
    model: nn.Module,
    comm: Communicator,
    current: Callable[[], ContextSplit],
    sp: Communicator | None = None,
    tp: int = 1,
) -> int:
    """Replace each ``CausalSelfAttention.attention`` of the project's GPT by context attention (inside Ulysses'
    exchange with ``sp``); returns how many."""
    from shardtrain.models.gpt import CausalSelfAttention

    count = 0
    for name, m in model.named_modules():
        if isinstance(m, CausalSelfAttention):
            if m.dropout:
                raise ConfigError(f"GPT dropout {m.dropout} under context parallelism: not applied; set it to 0.0")
            if sp is not None:
                kv_repeats(m.n_head // tp, m.n_head // tp, sp.size, tp)

            def attend(q, k, v, name=name):
                return context_attention(q, k, v, comm, current(), None, repr(name))

            def attention(q, k, v, attend=attend, name=name):
                return _with_ulysses(q, k, v, attend, sp, repr(name)).transpose(1, 2)  # [b, h, s, d]

            m.attention = attention
            count += 1
    return count


def install(
    model: nn.Module,
    comm: Communicator,
    current: Callable[[], ContextSplit],
    sp: Communicator | None = None,
    tp: int = 1,
) -> None:
    """Context attention over the cp group ``comm`` in ``model`` (a transformers model or the project's GPT;
    anything else is refused), inside Ulysses' exchange over ``sp`` when given."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "_attn_implementation"):
        install_hf(model, comm, current, sp, tp)
        return
    if install_gpt(model, comm, current, sp, tp):
        return
    raise ConfigError(
        f"context_parallel_size > 1 needs to reach the attention of {type(model).__name__}: built for transformers "
        "causal LMs (through their attention interface) and shardtrain's GPT; another model is not supported yet"
    )


__all__ = ["ContextSplit", "context_attention", "install", "positions_of"]
