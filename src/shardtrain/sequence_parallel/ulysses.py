"""Ulysses attention: each rank attends its share of the heads over the whole sequence.

Attention is plugged in from outside the model: a transformers model through its attention interface
(``AttentionInterface.register`` and ``config._attn_implementation``, so the model's code is not edited), the
project's GPT through its ``attention`` method. Around the model's own attention function (sdpa, eager, ...) the
query, key and value go through one all-to-all each (``[b, h, s/P, d] -> [b, h/P, s, d]``) and the output through
the reverse one. After the exchange a rank holds whole sequences, so the attention function's ordinary causal
(or, for an encoder, bidirectional) attention is the global one, with no mask to rewrite.

[Note: sliding windows under Ulysses]
A sliding-window layer (Mistral's ``sliding_window``, Gemma2/3's local layers) gets its window from its mask, which
transformers builds per layer type; under Ulysses the model is handed one whole-sequence mask (or none) for every
layer ([Note: masks under Ulysses] in :mod:`shardtrain.sequence_parallel.inputs`). The attention module passes its
window to the attention function (``sliding_window=``, None on a full layer), so after the exchange, where a rank
holds the whole sequence for its heads, the window is intersected with that mask as transformers defines it: key
``j`` visible from query ``i`` when ``j > i - window`` (and ``j <= i``) for causal attention, ``|i - j| <= window``
for bidirectional. The window costs an ``S x S`` mask where plain causal attention needs none.

[Note: key/value heads under Ulysses]
A rank keeps query heads ``[r * h/P, (r + 1) * h/P)``. With grouped-query attention (``kv`` key/value heads, each
serving ``g = h/kv`` consecutive query heads) the key/value heads those query heads read are ``[r * kv/P, ...)``
when ``P`` divides ``kv``: splitting them the same way keeps each query head with its key/value head. When it does
not (``kv < P`` included), each key/value head is first repeated ``k`` times (``k`` the smallest divisor of ``g``
with ``P | kv * k``): still a valid grouped layout, ``g / k`` query heads per key/value head, at ``k`` times the
key/value bytes. ``h`` itself must divide by ``P``.

[Note: Ulysses under tensor parallelism]
With tensor parallelism the q/k/v projections are column-parallel: tp rank ``t`` holds query heads ``[t * h/tp, (t + 1)
* h/tp)`` and the key/value heads they read. Ulysses runs inside each tp rank's heads: a rank's sp group is the ranks
with its tp (and dp) rank, holding the same heads for the other slices, and the all-to-all trades the sequence split for
a split of those ``h/tp`` heads. Everything above holds with ``h/tp``, ``kv/tp`` for ``h``, ``kv``: ``P`` must divide
``h/tp``; fewer than ``P`` key/value heads per tp rank are repeated. The row-parallel output projection sums the tp
ranks' heads per token as without sequence parallelism.

[Note: attention sinks]
GPT-OSS and Flint learn one sink logit per query head (``module.sinks``, ``[h]``), which their attention function
reads from the module (eager) or as ``s_aux``. After the exchange a rank holds query heads ``[r * h/P, (r + 1) *
h/P)``, so it is handed those heads' sinks: the slice, taken inside autograd, so that each rank's gradient lands on
its heads' entries and the sum over the group (ZeRO reduces over data x sequence ranks) is the whole sequence's.
Under tensor parallelism the slice is taken of the sinks the module holds when they are one per head it holds (a
plan that splits them with the heads); that combination is not tested yet (the sweep's models have 6 heads: tp 2 x
sp 2 does not divide them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError
from shardtrain.sequence_parallel.all_to_all import all_to_all


def kv_repeats(heads: int, kv_heads: int, p: int, tp: int = 1) -> int:
    """How many times each key/value head is repeated before the exchange (see [Note: key/value heads under
    Ulysses]). ``heads``, ``kv_heads``: those one tensor-parallel rank holds (the model's at ``tp`` 1)."""
    if heads % p:
        held = f"the {heads} attention heads"
        if tp > 1:
            held += f" a tensor-parallel rank holds ({heads * tp} / tensor_parallel.size {tp})"
        raise ConfigError(
            f"sequence_parallel_size {p} does not divide {held}: Ulysses gives each rank of a sequence-parallel "
            f"group heads / size of them; choose a sequence_parallel_size that divides {heads}"
            + (" (or another tensor_parallel.size)" if tp > 1 else "")
        )
    if kv_heads < 1 or heads % kv_heads:
        raise ConfigError(f"{heads} query heads are not a multiple of the {kv_heads} key/value heads")
    group = heads // kv_heads
    return next(k for k in range(1, group + 1) if group % k == 0 and (kv_heads * k) % p == 0)


def ulysses(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    comm: Communicator,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    what: str,
) -> torch.Tensor:
    """``query [b, h, s/P, d]``, ``key``/``value [b, kv, s/P, d]`` (this rank's slice of the sequence) ->
    ``attend(q [b, h/P, s, d], k, v [b, kv'/P, s, d])``, which returns ``[b, s, h/P, d]``, -> ``[b, s/P, h, d]``."""
    k = kv_repeats(query.shape[1], key.shape[1], comm.size)
    if k > 1:
        key, value = key.repeat_interleave(k, dim=1), value.repeat_interleave(k, dim=1)
    q, key, value = (all_to_all(t, comm, 1, 2, f"the {n} of {what}") for t, n in zip((query, key, value), "qkv"))
    out = attend(q, key, value)  # [b, s, h/P, d]
    return all_to_all(out, comm, 1, 2, f"the output of {what}")  # [b, s/P, h, d]


# -- transformers models ---------------------------------------------------------------------------------------------
class _HeadsView:
    """The attention module as the inner attention function sees it after the exchange: ``num_key_value_groups``
    is the ratio of the heads this rank holds (transformers' sdpa and eager read it to repeat key/value heads)."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


_counter = itertools.count()


class WholeAttentionInputs(Protocol):
    """What the attention of a model with several kinds of attention (an encoder-decoder's encoder, decoder and
    cross-attention) is given after the exchange instead of the mask and position bias the model made for its
    slices: [Note: encoder-decoder models under Ulysses] in :mod:`shardtrain.sequence_parallel.seq2seq`."""

    def whole_mask(self, module: nn.Module, device: torch.device) -> torch.Tensor | None:
        """The whole sequences' mask ``[b, 1, S_q, S_k]`` for ``module``'s attention, on ``device``; None: none
        (plain causal or unmasked attention)."""
        ...

    def whole_position_bias(self, module: nn.Module, heads: slice, queries: int, keys: int) -> torch.Tensor | None:
        """The additive position bias ``[1, h/P, S_q, S_k]`` of this rank's ``heads`` (a relative position bias,
        T5's), None: none."""
        ...


def install_hf(
    model: nn.Module,
    comm: Communicator,
    tp: int = 1,
    key_limit: Callable[[int], int | None] | None = None,
    whole_inputs: WholeAttentionInputs | None = None,
) -> str:
    """Route ``model``'s attention through Ulysses around its current implementation; returns the registered
    name. ``tp``: the tensor-parallel size (each rank holds ``1/tp`` of the heads, [Note: Ulysses under tensor
    parallelism]). transformers builds no mask for a name it has no mask function for: after the exchange a rank
    holds whole sequences, so sdpa's own causal attention (the module's ``is_causal``) is the global one, and eager
    attention is given the whole sequence's causal mask. A padding (or packing) mask reaches it as the whole
    sequence's ``[b, 1, S, S]`` mask the engine built before the split ([Note: masks under Ulysses] in
    :mod:`shardtrain.sequence_parallel.inputs`). ``key_limit(S)``: how many keys of a whole sequence of ``S`` are real
    when the sequence was padded inside the model (None: all of them); the others are dropped from the keys and
    values, [Note: vision transformers under Ulysses] in :mod:`shardtrain.sequence_parallel.vision`.
    ``whole_inputs``: where the whole sequences' masks and position biases come from instead (an encoder-decoder
    model's, :class:`WholeAttentionInputs`)."""
    from transformers import AttentionInterface

    if whole_inputs is not None and tp > 1:
        raise ConfigError(
            f"{type(model).__name__}: sequence parallelism for an encoder-decoder model with tensor_parallel.size "
            f"{tp} is not built (each rank's heads would be a tensor-parallel rank's share, which the encoder-decoder "
            "position bias does not slice yet); use one of the two"
        )
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int):  # refused at initialize rather than at the first forward
        kv = getattr(config, "num_key_value_heads", None) or heads
        kv_repeats(heads // tp, max(kv // tp, 1), comm.size, tp)
    inner_name = config._attn_implementation or "sdpa"
    if inner_name.startswith("shardtrain_ulysses"):
        raise ConfigError(f"{type(model).__name__} already runs Ulysses attention: initialize it once")
    if inner_name == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as inner
    elif inner_name == "eager":
        inner = _eager_of(model)
    else:
        raise ConfigError(
            f"attn_implementation {inner_name!r} under sequence parallelism is not built yet; load the model with "
            "attn_implementation='sdpa' or 'eager'"
        )

    def attention(module, query, key, value, attention_mask, *, dropout=0.0, scaling=None, **kwargs):
        kwargs.pop("is_causal", None)  # the module's own is_causal decides, as without sequence parallelism
        window = kwargs.get("sliding_window")  # None on a full-attention layer
        causal = getattr(module, "is_causal", True)

        heads = query.shape[1]  # this rank's heads before the exchange: the model's (or a tp rank's)
        sinks = getattr(module, "sinks", None)
        if torch.is_tensor(sinks) and sinks.dim() == 1 and sinks.shape[0] == heads:  # see [Note: attention sinks]
            sinks = sinks[_heads_after_exchange(heads, comm)]
            if "s_aux" in kwargs:
                kwargs["s_aux"] = sinks
        else:
            sinks = None

        def attend(q, k, v):
            view = _HeadsView(module, q.shape[1] // k.shape[1])
            if sinks is not None:
                view.sinks = sinks
            extra = dict(kwargs)
            if whole_inputs is None:
                mask = attention_mask  # the whole sequence's, built before the split
            else:  # the model's own mask and bias are its slices': replaced by the whole sequences'
                mask = whole_inputs.whole_mask(module, q.device)
                mine = _heads_after_exchange(heads, comm)
                bias = whole_inputs.whole_position_bias(module, mine, q.shape[2], k.shape[2])
                if bias is not None or "position_bias" in extra:
                    extra["position_bias"] = bias
            if window is not None:  # see [Note: sliding windows under Ulysses]
                mask = _with_window(mask, q, window, causal)
            if mask is not None:
                mask = _whole_mask_for(mask, q, inner_name, what, k)
            elif inner_name == "eager" and causal:
                mask = _causal_mask(q)  # sdpa makes the causal mask itself (no mask given); eager only adds one
            limit = key_limit(k.shape[2]) if key_limit is not None else None
            if limit is not None:  # padding made inside the model: dropped from the keys (no mask, flash stays)
                k, v = k[:, :, :limit], v[:, :, :limit]
                mask = mask[..., :limit] if mask is not None else None
            out, _ = inner(view, q, k, v, mask, dropout=dropout, scaling=scaling, **extra)
            return out

        what = f"{type(module).__name__} {getattr(module, 'layer_idx', '')}".strip()
        return ulysses(query, key, value, comm, attend, what), None

    name = f"shardtrain_ulysses_{next(_counter)}_{inner_name}"
    AttentionInterface.register(name, attention)
    config._attn_implementation = name
    if whole_inputs is not None:  # an encoder-decoder's stacks read copies of the config (T5's): each one too
        for m in model.modules():
            sub = getattr(m, "config", None)
            if sub is not config and getattr(sub, "_attn_implementation", None) == inner_name:
                sub._attn_implementation = name
    return name


def _heads_after_exchange(heads: int, comm: Communicator) -> slice:
    """The heads (of the ``heads`` a rank holds before the exchange) this rank attends after it."""
    per = heads // comm.size
    return slice(comm.rank * per, (comm.rank + 1) * per)


def _causal_mask(q: torch.Tensor) -> torch.Tensor:
    """The additive causal mask ``[1, 1, s, s]`` of the whole sequence, in ``q``'s dtype."""
    s = q.shape[2]
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return torch.zeros(s, s, dtype=q.dtype, device=q.device).masked_fill(future, torch.finfo(q.dtype).min)[None, None]


def _with_window(mask: torch.Tensor | None, q: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """``mask`` (the whole sequence's, boolean or additive; None: plain causal or bidirectional attention) with
    the sliding window of [Note: sliding windows under Ulysses], ``[b or 1, 1, S, S]``."""
    s = q.shape[2]
    i = torch.arange(s, device=q.device)[:, None]  # query
    j = torch.arange(s, device=q.device)[None, :]  # key
    band = ((j > i - window) & (j <= i)) if causal else ((i - j).abs() <= window)
    band = band[None, None]
    if mask is None:
        return band
    if mask.dtype == torch.bool:
        return mask & band
    return mask.masked_fill(~band, torch.finfo(mask.dtype).min)


def _whole_mask_for(
    mask: torch.Tensor, q: torch.Tensor, inner_name: str, what: str = "", k: torch.Tensor | None = None
) -> torch.Tensor:
    """The whole sequence's mask ``[b, 1, S_q, S_k]`` (``S_k`` the keys' length, ``S_q`` but for cross-attention) as
    the inner attention takes it: booleans for sdpa, the additive form (0 or the dtype's minimum, as transformers'
    ``eager_mask``) for eager."""
    s = q.shape[2]
    sk = k.shape[2] if k is not None else s
    if mask.dim() == 4 and mask.shape[1] > 1 and tuple(mask.shape[-2:]) != (s, sk):
        raise ConfigError(
            f"{what or 'the attention'} makes a mask of its own, one per head ({tuple(mask.shape)}), from its slice "
            "of the sequence (Doge's dynamic mask does): sequence parallelism gives attention the whole sequence "
            "only after the exchange, so that mask cannot be the whole sequence's. Not built: train this model "
            "without sequence_parallel_size"
        )
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (s, sk):
        raise ConfigError(
            f"the attention mask reaching Ulysses attention has shape {tuple(mask.shape)}, not the whole sequence's "
            f"[batch, 1, {s}, {sk}]: pass the model's attention_mask to the engine (which builds the whole mask), "
            "not a mask made for a slice"
        )
    if inner_name == "eager" and mask.dtype == torch.bool:
        return torch.where(mask, torch.zeros((), dtype=q.dtype, device=q.device), torch.finfo(q.dtype).min)
    return mask


def _eager_of(model: nn.Module) -> Callable:
    import importlib

    module = importlib.import_module(type(model).__module__)
    fn = getattr(module, "eager_attention_forward", None)
    if fn is None:
        raise ConfigError(
            f"{type(model).__name__}: no eager attention function found; load it with attn_implementation='sdpa'"
        )
    return fn


# -- the project's GPT -----------------------------------------------------------------------------------------------
def install_gpt(model: nn.Module, comm: Communicator, tp: int = 1) -> int:
    """Replace each ``CausalSelfAttention.attention`` of the project's GPT by its Ulysses form; returns how many."""
    from shardtrain.models.gpt import CausalSelfAttention

    count = 0
    for name, m in model.named_modules():
        if isinstance(m, CausalSelfAttention):
            # refused at initialize rather than at the first forward
            kv_repeats(m.n_head // tp, m.n_head // tp, comm.size, tp)
            inner = m.attention  # the bound method: [b, h, s, d] x3 -> [b, h, s, d]

            def attend(q, k, v, inner=inner):
                return inner(q, k, v).transpose(1, 2)  # [b, s, h/P, d]

            def attention(q, k, v, attend=attend, name=name):
                return ulysses(q, k, v, comm, attend, repr(name)).transpose(1, 2)  # [b, h, s/P, d]

            m.attention = attention
            count += 1
    return count


def install(
    model: nn.Module,
    comm: Communicator,
    tp: int = 1,
    key_limit: Callable[[int], int | None] | None = None,
    whole_inputs: WholeAttentionInputs | None = None,
) -> None:
    """Ulysses attention in ``model``: a transformers model or the project's GPT; anything else is refused.
    ``tp``: the tensor-parallel size the model was already split with; ``key_limit``, ``whole_inputs``: see
    :func:`install_hf`."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "_attn_implementation"):
        install_hf(model, comm, tp, key_limit, whole_inputs)
        return
    if install_gpt(model, comm, tp):
        return
    raise ConfigError(
        f"sequence_parallel_size > 1 needs to reach the attention of {type(model).__name__}: built for transformers "
        "models (through their attention interface) and shardtrain's GPT; another model is not supported yet"
    )


__all__ = ["WholeAttentionInputs", "install", "install_gpt", "install_hf", "kv_repeats", "ulysses"]
