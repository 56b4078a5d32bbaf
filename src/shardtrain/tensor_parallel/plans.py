"""Tensor-parallel plans: what they are, Hugging Face's own plans, and the plans shipped for known models.

A plan maps name patterns to styles (:mod:`.styles`). A pattern is a module (or parameter) name as
``model.named_modules()`` spells it, where a ``*`` component stands for any one path component:
``model.layers.*.self_attn.q_proj`` names the ``q_proj`` of every layer. When several patterns match one name,
the one with the fewest ``*`` wins; two equally specific patterns that disagree are an error.

A :class:`TPPlan` adds ``per_rank_attributes``: integer module attributes that count something the plan splits
(heads, split sizes) and that the model's code reads in its forward. :func:`parallelize` divides them by the
tensor-parallel size, so the model code stays free of parallelism (GPT-2's attention splits its fused output by
``self.split_size``, a full-width size unless told otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from torch import nn

from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel.styles import TPStyle, packed_colwise


@dataclass(frozen=True)
class TPPlan:
    """Name patterns -> styles, and name patterns -> attributes to divide by the tensor-parallel size."""

    styles: Mapping[str, str | TPStyle]
    per_rank_attributes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for pattern in (*self.styles, *self.per_rank_attributes):
            if not isinstance(pattern, str) or not pattern or any(not c for c in pattern.split(".")):
                raise LayoutError(f"plan pattern {pattern!r} is not a dotted module name (use * for one component)")
        object.__setattr__(self, "styles", MappingProxyType(dict(self.styles)))
        object.__setattr__(self, "per_rank_attributes", MappingProxyType(dict(self.per_rank_attributes)))

    def __reduce__(self):
        """Picklable (a read-only mapping is not): a plan travels to fresh processes, as a parity recipe's does."""
        return (type(self), (dict(self.styles), dict(self.per_rank_attributes)))


def as_plan(plan: Mapping[str, str | TPStyle] | TPPlan) -> TPPlan:
    return plan if isinstance(plan, TPPlan) else TPPlan(styles=plan)


def matches(pattern: str, name: str) -> bool:
    """Whether ``name`` (dotted) fits ``pattern``, where a ``*`` component matches any one component."""
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have))


def best_match(patterns: Mapping[str, object], name: str) -> str | None:
    """The most specific pattern matching ``name`` (fewest ``*``), or None; raises if two tie and disagree."""
    hits = [p for p in patterns if matches(p, name)]
    if not hits:
        return None
    fewest = min(p.count("*") for p in hits)
    best = [p for p in hits if p.count("*") == fewest]
    if len({repr(patterns[p]) for p in best}) > 1:
        raise LayoutError(
            f"{name}: plan patterns {best} match it equally well but give different values; make one more specific."
        )
    return best[0]


# [Note: plans that change their model]
# A few plans that transformers ships split a module whose output a later, unsplit computation reads whole. The
# split itself is legal (every check of parallelize passes), and the forward then fails deep inside torch with a
# shape error, or would compute something else. They are refused by the architecture's name, with the reason, when
# the model's own plan is used; an explicit plan is the user's to choose.
OWN_PLANS_REFUSED: Mapping[str, str] = MappingProxyType(
    {
        "doge": (
            "its plan splits the attention's key/value heads (k_proj/v_proj colwise) but makes dt_proj rowwise, so "
            "every rank computes the dynamic mask gate of *every* key/value head and DogeAttention adds it to the "
            "scores of this rank's heads only: the forward fails on a head-count mismatch"
        ),
        "esmc": (
            "its attention normalizes the query and key projections with one LayerNorm over the full hidden width "
            "(q_norm, k_norm: all heads together), and its plan splits q_proj/k_proj colwise: a rank holds only its "
            "heads' columns, and a norm over all heads cannot be computed from them"
        ),
    }
)


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The plan a Hugging Face model declares for itself, resolved as ``transformers`` 5.x resolves it.

    The base model's plan is its class's ``_tp_plan`` updated with ``config.base_model_tp_plan``; when it is not
    empty and the base model has an ``embed_tokens`` embedding, that embedding is vocab-parallel
    (``embedding_rowwise``) unless the plan names it. A model with a head (``LlamaForCausalLM``) prefixes that
    plan with the base model's attribute (``base_model_prefix``: ``model.``) and adds its class's
    ``_tp_plan`` (``{"lm_head": "colwise_gather_output"}``). Raises :class:`LayoutError` if the model has none,
    or if its plan is one of :data:`OWN_PLANS_REFUSED` ([Note: plans that change their model]).
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in OWN_PLANS_REFUSED:
        raise LayoutError(
            f"{type(model).__name__} ({model_type}): its own tensor-parallel plan cannot keep the model's meaning: "
            f"{OWN_PLANS_REFUSED[model_type]}. Train it without tensor_parallel.size, or pass a plan of your own "
            "that leaves those modules replicated (initialize(tp_plan=...))."
        )
    base, prefix = _base_model(model)
    base_plan = dict(getattr(type(base), "_tp_plan", None) or {})
    base_plan.update(getattr(config, "base_model_tp_plan", None) or {})
    if base_plan and isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        base_plan = {"embed_tokens": "embedding_rowwise", **base_plan}
    plan = dict(getattr(type(model), "_tp_plan", None) or {}) if base is not model else {}
    plan.update({prefix + k: v for k, v in base_plan.items()})
    if not plan:
        raise LayoutError(
            f"{type(model).__name__} declares no tensor-parallel plan (no _tp_plan on its class, no "
            "base_model_tp_plan in its config) and shardtrain ships none for its model type "
            f"({model_type!r}; shipped: {', '.join(sorted(SHIPPED_PLANS))}). Pass one: initialize(tp_plan=...) or "
            "parallelize(model, plan, tp_comm), e.g. GPT2_TP_PLAN for GPT-2, or a dict of module-name patterns to "
            "styles."
        )
    return plan


def own_plan(model: nn.Module) -> TPPlan:
    """The plan ``parallelize(model, None, ...)`` applies: the model's own (:func:`hf_tp_plan`), else the one
    shardtrain ships for its model type (:data:`SHIPPED_PLANS`, prefixed like a base model's plan)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        return TPPlan(styles=hf_tp_plan(model))
    except LayoutError:
        if model_type not in SHIPPED_PLANS or model_type in OWN_PLANS_REFUSED:
            raise
    shipped = SHIPPED_PLANS[model_type]
    _, prefix = _base_model(model)
    return TPPlan(
        styles={prefix + k: v for k, v in shipped.styles.items()},
        per_rank_attributes={prefix + k: v for k, v in shipped.per_rank_attributes.items()},
    )


def replicate_experts(plan: TPPlan, experts: Mapping[str, Sequence[str]]) -> tuple[TPPlan, list[str]]:
    """``plan`` for a model whose experts modules (name -> its expert weights' names) expert parallelism splits
    beside tensor parallelism ([Note: experts beside tensor parallelism] in
    :mod:`shardtrain.expert_parallel.dispatch`): every pattern naming an experts module or anything inside it is
    dropped (transformers' ``moe_tp_experts`` and its ``packed_colwise`` / ``rowwise`` weights), and each expert
    weight is ``replicated_with_grad_allreduce``: whole on every tp rank, its gradients summed over the group. Returns
    the plan and the dropped patterns."""

    def inside(pattern: str) -> bool:
        parts = pattern.split(".")
        return any(
            len(parts) >= len(m.split(".")) and matches(".".join(parts[: len(m.split("."))]), m) for m in experts
        )

    dropped = [p for p in (*plan.styles, *plan.per_rank_attributes) if inside(p)]
    styles: dict[str, str | TPStyle] = {p: s for p, s in plan.styles.items() if not inside(p)}
    styles.update({f"{m}.{w}": "replicated_with_grad_allreduce" for m, weights in experts.items() for w in weights})
    attributes = {p: a for p, a in plan.per_rank_attributes.items() if not inside(p)}
    return TPPlan(styles=styles, per_rank_attributes=attributes), list(dict.fromkeys(dropped))


def _base_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The base model under a model with a head (``model.model``) and the prefix of its names (``"model."``)."""
    prefix_attr = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix_attr, None) if prefix_attr else None
    if not isinstance(base, nn.Module) or base is model:
        return model, ""
    return base, prefix_attr + "."


# The project's GPT (shardtrain.models.gpt): fused Q/K/V column-parallel with stride 3, the output projection
# row-parallel, the MLP column/row, the token embedding vocab-parallel, the head kept split and its loss computed
# vocab-parallel (so full logits never exist; without targets the model returns this rank's block of logits).
# With tie_embeddings the embedding and the head share one weight, cut once on the vocabulary dimension.
GPT_TP_PLAN = TPPlan(
    styles={
        "tok": "embedding_rowwise",
        "blocks.*.attn.qkv": packed_colwise(3),
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
        "head": "colwise",
        "loss": "vocab_parallel_loss",
    }
)

# Hugging Face GPT-2 (GPT2LMHeadModel), which declares no plan of its own. Its fused c_attn is a Conv1D whose
# output stacks Q, K and V: column-parallel with stride 3. GPT2Attention.forward splits that output with
# `.split(self.split_size)` where split_size is the full hidden size, so the plan divides `split_size` (and
# `num_heads`, kept consistent) by the tensor-parallel size. The LM head is tied to wte: both split the shared
# weight on the vocabulary dimension. The head gathers its logits so that GPT-2's own loss runs unchanged.
GPT2_TP_PLAN = TPPlan(
    styles={
        "transformer.wte": "embedding_rowwise",
        "transformer.h.*.attn.c_attn": packed_colwise(3),
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "colwise_gather_output",
    },
    per_rank_attributes={"transformer.h.*.attn": ("split_size", "num_heads")},
)


# [Note: encoder-decoder plans]
# transformers declares no tensor-parallel plan for its encoder-decoder models; these are derived as its plans for
# decoder-only models are (Llama's): each attention's query/key/value projections column-parallel (whole heads per
# rank) and its output projection row-parallel, each MLP's input projections column-parallel and its output one
# row-parallel, in the encoder's self-attention, the decoder's self-attention and the decoder's cross-attention
# alike. A cross-attention's key/value projections read the encoder's output, which is replicated: their f sums its
# gradient over the ranks, as for any column-parallel input. Embeddings, norms, positions and the head stay
# replicated (T5 and BART tie and scale them). Patterns a configuration does not build (T5's gated wi_0/wi_1 or
# plain wi) match nothing, as in a model's own plan.

# T5 and mT5. T5Attention reshapes by -1 heads but makes a zero position bias of self.n_heads heads (a layer without
# relative attention bias, when none is passed in: the decoder's first cross-attention), so n_heads (and inner_dim,
# kept consistent) are divided. The relative attention bias is an embedding of [buckets, heads]: its heads (the last
# dimension, a parameter's rowwise) are split, so each rank looks up the biases of its own heads.
_T5_ATTENTION = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
_T5_MLP = {"wi": "colwise", "wi_0": "colwise", "wi_1": "colwise", "wo": "rowwise"}
T5_TP_PLAN = TPPlan(
    styles={
        **{f"encoder.block.*.layer.0.SelfAttention.{k}": v for k, v in _T5_ATTENTION.items()},
        "encoder.block.*.layer.0.SelfAttention.relative_attention_bias.weight": "rowwise",
        **{f"encoder.block.*.layer.1.DenseReluDense.{k}": v for k, v in _T5_MLP.items()},
        **{f"decoder.block.*.layer.0.SelfAttention.{k}": v for k, v in _T5_ATTENTION.items()},
        "decoder.block.*.layer.0.SelfAttention.relative_attention_bias.weight": "rowwise",
        **{f"decoder.block.*.layer.1.EncDecAttention.{k}": v for k, v in _T5_ATTENTION.items()},
        **{f"decoder.block.*.layer.2.DenseReluDense.{k}": v for k, v in _T5_MLP.items()},
    },
    per_rank_attributes={
        "encoder.block.*.layer.0.SelfAttention": ("n_heads", "inner_dim"),
        "decoder.block.*.layer.0.SelfAttention": ("n_heads", "inner_dim"),
        "decoder.block.*.layer.1.EncDecAttention": ("n_heads", "inner_dim"),
    },
)

# BART and the models built like it (mBART, PLBart, Marian, Pegasus, Blenderbot, M2M100): attention reshapes by -1
# heads of head_dim, so nothing is divided.
_BART_ATTENTION = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "out_proj": "rowwise"}
BART_TP_PLAN = TPPlan(
    styles={
        **{f"encoder.layers.*.self_attn.{k}": v for k, v in _BART_ATTENTION.items()},
        "encoder.layers.*.fc1": "colwise",
        "encoder.layers.*.fc2": "rowwise",
        **{f"decoder.layers.*.self_attn.{k}": v for k, v in _BART_ATTENTION.items()},
        **{f"decoder.layers.*.encoder_attn.{k}": v for k, v in _BART_ATTENTION.items()},
        "decoder.layers.*.fc1": "colwise",
        "decoder.layers.*.fc2": "rowwise",
    }
)

# model type -> the plan shardtrain ships for it, relative to the base model (like a base_model_tp_plan)
SHIPPED_PLANS: Mapping[str, TPPlan] = MappingProxyType(
    {
        "t5": T5_TP_PLAN,
        "mt5": T5_TP_PLAN,
        **{
            k: BART_TP_PLAN
            for k in ("bart", "mbart", "plbart", "marian", "pegasus", "blenderbot", "blenderbot-small", "m2m_100")
        },
    }
)
