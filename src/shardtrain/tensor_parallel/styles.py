"""The style vocabulary of tensor-parallel plans: Hugging Face's names, and what each one does here.

A plan maps module (or parameter) names to styles. The names are Hugging Face's (``transformers``
``distributed/tensor_parallel.py`` in 5.x, and the ``local*``/``gather`` names of the 4.5x documentation), so a
model's own ``base_model_tp_plan`` works unchanged. Each name resolves to a :class:`TPStyle`, a frozen record of
which layer replaces the module and how; a plan may also give a :class:`TPStyle` directly, e.g.
``packed_colwise(3)`` for a fused Q/K/V projection, which Hugging Face's names (stride 2 only) cannot say.

Styles that need machinery this package does not have (sequence parallelism, expert parallelism, grouped-GEMM
expert kernels) are refused by name, with the reason, rather than silently treated as replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from shardtrain.errors import LayoutError

Layer = Literal[
    "column",
    "row",
    "vocab_embedding",
    "hidden_embedding",
    "vocab_loss",
    "region",
    "latent_kv",
    "identity_share",
    "none",
]


@dataclass(frozen=True)
class TPStyle:
    """What a plan entry does to the module (or parameter) it names.

    ``layer``: the replacement -- ``column``/``row`` (:mod:`.layers`), ``vocab_embedding``/``hidden_embedding``
    (:mod:`.embedding`), ``vocab_loss`` (:mod:`.loss`), ``region`` (the module's output is a partial sum to
    all-reduce and its input enters the region: ``gather``/``all_reduce``), ``latent_kv`` (multi-head latent
    attention's shared key/value projection, kept replicated: :mod:`.latent`), ``identity_share`` (an identity
    expert inside a fused experts region: its input divided by the tp size, :mod:`.experts`), or ``none``
    (nothing is replaced).
    ``stride``: fused groups along the split dimension ([Note: strided blocks]).
    ``gather_output``: a column layer all-gathers its output. ``split_input``: a row layer splits a replicated
    input itself. ``communicate``: False for ``local_*``, whose communication an enclosing ``gather`` does.
    ``partial_grad``: the module's parameters stay replicated but their gradients are partial sums.
    ``experts``: a ``region`` over a fused mixture-of-experts module, checked by :func:`~.experts.check_experts`.
    """

    name: str
    layer: Layer
    stride: int = 1
    gather_output: bool = False
    split_input: bool = False
    communicate: bool = True
    partial_grad: bool = False
    experts: bool = False

    def __post_init__(self) -> None:
        if self.stride < 1:
            raise ValueError(f"style {self.name!r}: stride must be >= 1, got {self.stride}")


def packed_colwise(stride: int = 2) -> TPStyle:
    """A column-parallel style for a weight that stacks ``stride`` projections on its output (Q,K,V: 3)."""
    return replace(STYLES["packed_colwise"], stride=stride)


def packed_rowwise(stride: int = 2) -> TPStyle:
    """A row-parallel style for a weight whose input stacks ``stride`` groups (split like ``packed_colwise``)."""
    return replace(STYLES["packed_rowwise"], stride=stride)


STYLES: dict[str, TPStyle] = {
    # column-parallel: weight split on the output features, input replicated
    "colwise": TPStyle("colwise", "column"),
    "colwise_gather_output": TPStyle("colwise_gather_output", "column", gather_output=True),
    "colwise_rep": TPStyle("colwise_rep", "column", gather_output=True),
    "packed_colwise": TPStyle("packed_colwise", "column", stride=2),
    "local_colwise": TPStyle("local_colwise", "column", communicate=False),
    # row-parallel: weight split on the input features, output all-reduced, bias added once
    "rowwise": TPStyle("rowwise", "row"),
    "rowwise_split_input": TPStyle("rowwise_split_input", "row", split_input=True),
    "rowwise_rep": TPStyle("rowwise_rep", "row", split_input=True),
    "packed_rowwise": TPStyle("packed_rowwise", "row", stride=2),
    "local_rowwise": TPStyle("local_rowwise", "row", communicate=False),
    "local_packed_rowwise": TPStyle("local_packed_rowwise", "row", stride=2, communicate=False),
    # embeddings
    "embedding_rowwise": TPStyle("embedding_rowwise", "vocab_embedding"),
    "embedding_colwise": TPStyle("embedding_colwise", "hidden_embedding"),
    # a module whose output is the sum over ranks of what its local_* children computed
    "gather": TPStyle("gather", "region"),
    "all_reduce": TPStyle("all_reduce", "region"),
    # a fused experts module whose parameters the plan splits per expert ([Note: experts under tensor parallelism])
    "moe_tp_experts": TPStyle("moe_tp_experts", "region", experts=True),
    # an identity expert inside one: its input divided by the tp size, so that the region's sum is the identity
    "moe_identity_expert": TPStyle("moe_identity_expert", "identity_share"),
    # multi-head latent attention's shared projection: replicated, f on its rotary key columns
    "mla_kv_a_proj": TPStyle("mla_kv_a_proj", "latent_kv"),
    # nothing to replace
    "replicate": TPStyle("replicate", "none"),
    "local": TPStyle("local", "none", communicate=False),
    "local_params": TPStyle("local_params", "none", communicate=False),
    "replicated_with_grad_allreduce": TPStyle("replicated_with_grad_allreduce", "none", partial_grad=True),
    # shardtrain's own: the loss behind a head that keeps its logits split
    "vocab_parallel_loss": TPStyle("vocab_parallel_loss", "vocab_loss"),
}

# Hugging Face styles this package knows and does not implement, with the reason given to the user.
REFUSED: dict[str, str] = {
    "sequence_parallel": "sequence parallelism (activations split on the sequence dimension) is not implemented",
    "grouped_gemm": "grouped-GEMM expert kernels (expert parallelism) are not supported",
    "ep_dispatch_experts": "expert parallelism is not supported",
    "ep_router": "expert parallelism is not supported",
    "isolated": "expert isolation is not supported",
}


def resolve_style(style: str | TPStyle, target: str) -> TPStyle:
    """The :class:`TPStyle` for a plan value; ``target`` (the module or parameter it applies to) names it in errors."""
    if isinstance(style, TPStyle):
        return style
    if not isinstance(style, str):
        raise LayoutError(f"{target}: a plan value must be a style name or a TPStyle, got {type(style).__name__}")
    if style in STYLES:
        return STYLES[style]
    if style in REFUSED:
        raise LayoutError(
            f"{target}: style {style!r} is not supported ({REFUSED[style]}). Remove it from the plan, or leave "
            "this module out of tensor parallelism."
        )
    raise LayoutError(f"{target}: unknown tensor-parallel style {style!r}; known styles: {', '.join(sorted(STYLES))}.")
