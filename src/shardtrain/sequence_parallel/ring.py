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
keys and values go around the cp group's ring (``Communicator.ring_step``), attended either as they arrive, merged
by log-sum-exp ([Note: the log-sum-exp merge] in :mod:`shardtrain.sequence_parallel.ring_attention`), or all
gathered first and attended by one SDPA call per local query chunk over the keys up to its own (later chunks are
never read; backward: the reduce-scatter of their gradients), as Llama 3's all-gather context parallelism does for
document masks (Dubey et al., 2024, 3.3.2). Both mask from global positions ([Note: masks from global positions]).

[Note: which context attention]
The gathered path holds the whole sequence's keys and values of a layer while it attends, and its SDPA saves them
(repeated to every query head) for backward, in every layer; the merged ring saves this rank's own ``1/C`` and holds
at most two more chunks in flight. At ``C = 2`` the ring has one step, nothing to overlap, and its backward moves
three times the gathered path's bytes (``2C - 1`` chunks against ``C - 1``); measured on gloo (2 shared CPU cores,
docs/benchmarks.md) the gathered path was as fast or faster there, the two within noise at ``C = 3``. So the merged
ring serves from ``MERGED_RING_FROM_CP`` (3) ranks on, the gathered path below.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError
from shardtrain.sequence_parallel.ring_attention import ContextSplit, allowed, ring_attention
from shardtrain.sequence_parallel.ulysses import kv_repeats, ulysses


def positions_of(length: int, size: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global indices of the tokens cp rank ``rank`` of ``size`` holds, in its order: chunk ``rank`` then chunk
    ``2 * size - 1 - rank`` of ``2 * size`` ([Note: load-balanced chunks])."""
    chunk = length // (2 * size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([head, tail])


class _PassAround(torch.autograd.Function):
    """Every rank's chunks ``[..., s, d]`` passed around the ring (``C - 1`` steps, each rank sending what it last
    received to the next), concatenated along dimension -2 in rank order; backward: the reduce-scatter (sum) of the
    gradient, since every rank's attention read every rank's keys and values."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:
        ctx.comm, ctx.what = comm, what
        c, r = comm.size, comm.rank
        parts: list[torch.Tensor] = [x] * c
        held = x
        for step in range(1, c):
            received = torch.empty_like(held)
            comm.ring_step(received, held, what=f"{what} (context-parallel ring, step {step} of {c - 1})")
            parts[(r - step) % c] = held = received
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm = ctx.comm
        per = grad.shape[-2] // comm.size
        by_rank = torch.stack(grad.split(per, dim=-2)).contiguous()  # [C, ..., s, d]: chunk j is rank j's
        out = grad.new_empty(by_rank.shape[1:])
        what = f"the gradient of {ctx.what} (context-parallel reduce-scatter, backward)"
        comm.reduce_scatter(out.view(-1), by_rank.view(-1), what=what)
        return out, None, None


def whole_sequence(x: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:
    """``x [..., s, d]`` (this rank's chunks) -> ``[..., S, d]`` in the sequence's own order, differentiable."""
    passed = _PassAround.apply(x.contiguous(), comm, what)  # [..., C * s, d], rank-major
    length = passed.shape[-2]
    order = torch.cat([positions_of(length, comm.size, r, x.device) for r in range(comm.size)])
    return passed.index_select(-2, torch.argsort(order))


MERGED_RING_FROM_CP = 3


def merged_ring_serves(cp: int) -> bool:
    """[Note: which context attention]: the log-sum-exp-merged ring from ``MERGED_RING_FROM_CP`` ranks on."""
    return cp >= MERGED_RING_FROM_CP


def context_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    comm: Communicator,
    split: ContextSplit,
    scale: float | None = None,
    what: str = "attention",
    window: int | None = None,
    merged: bool | None = None,
) -> torch.Tensor:
    """This rank's queries ``[b, h, s, d]`` attending to the whole sequence's keys and values (this rank's ``[b, kv,
    s, d]`` and the other cp ranks'), masked as [Note: masks from global positions] says (``window``: a sliding
    window); merged by log-sum-exp as they arrive, or gathered first (``merged``; by default [Note: which context
    attention]). Returns ``[b, h, s, d]``, in the order of this rank's tokens."""
    c, r = comm.size, comm.rank

    def positions(rank: int) -> torch.Tensor:
        return positions_of(split.length, c, rank, query.device)

    if merged if merged is not None else merged_ring_serves(c):
        return ring_attention(query, key, value, comm, split, positions, scale, window, what)
    keys, values = whole_sequence(torch.stack([key, value]), comm, f"the keys and values of {what}").unbind(0)
    if keys.shape[1] != query.shape[1]:  # grouped-query attention: each key/value head serves a group of queries
        groups = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    chunk = query.shape[2] // 2
    outputs = []
    for half, m in enumerate((r, 2 * c - 1 - r)):  # the head chunk, then the tail chunk ([Note: load-balanced chunks])
        q = query[:, :, half * chunk : (half + 1) * chunk]
        # causal: the keys of chunks 0..m, the later ones all in the future; an encoder reads them all
        visible = (m + 1) * chunk if split.causal else split.length
        mine = torch.arange(m * chunk, (m + 1) * chunk, device=query.device)
        mask = allowed(split, mine, torch.arange(visible, device=query.device), window)
        out = F.scaled_dot_product_attention(
            q, keys[:, :, :visible], values[:, :, :visible], attn_mask=mask, scale=scale
        )
        outputs.append(out)
    return torch.cat(outputs, dim=2)


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


__all__ = ["ContextSplit", "context_attention", "install", "positions_of", "whole_sequence"]
