"""Megatron-style tensor parallelism, applied to a model from outside by a plan.

Files, lower ones never importing higher ones::

    parallelize.py    parallelize(model, plan, tp_comm) -> {parameter name: TPPlacement}; sum_partial_gradients
    plans.py          TPPlan, Hugging Face's own plans (hf_tp_plan, own_plan), GPT_TP_PLAN, GPT2_TP_PLAN, T5/BART
    experts.py        check_experts: a fused experts module's split keeps its meaning (moe_tp_experts)
    latent.py         multi-head latent attention's shared key/value projection (mla_kv_a_proj)
    styles.py         the style vocabulary (Hugging Face's names) -> TPStyle
    layers.py         ColumnParallelLinear, RowParallelLinear      (from nn.Linear or transformers' Conv1D)
    float8.py         their local matmul in float8 (fp8): torchao's casts with the whole tensors' scales
    embedding.py      VocabParallelEmbedding, HiddenParallelEmbedding
    loss.py           vocab_parallel_cross_entropy, VocabParallelCrossEntropy
    batch_check.py    check_same_batch: every tensor-parallel rank got the same inputs
    rng.py            RegionRNG: per-rank random streams inside tensor-parallel regions
    grad_check.py     ReplicatedGradCheck: replicated parameters get the same gradient on every tp rank
    communication.py  f, g, gather, scatter: the autograd Functions over a Communicator
    placement.py      TPPlacement and the block arithmetic (shard_block, assemble_blocks)

See docs/tensor-parallel.md.
"""

from shardtrain.distributed.placement import ParameterSharder, TPPlacement, assemble_blocks, shard_block
from shardtrain.tensor_parallel.batch_check import check_same_batch
from shardtrain.tensor_parallel.communication import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from shardtrain.tensor_parallel.embedding import HiddenParallelEmbedding, VocabParallelEmbedding
from shardtrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardtrain.tensor_parallel.loss import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from shardtrain.tensor_parallel.parallelize import parallelize, sum_partial_gradients
from shardtrain.tensor_parallel.plans import (
    BART_TP_PLAN,
    GPT2_TP_PLAN,
    GPT_TP_PLAN,
    SHIPPED_PLANS,
    T5_TP_PLAN,
    TPPlan,
    hf_tp_plan,
    own_plan,
    replicate_experts,
)
from shardtrain.tensor_parallel.rng import RegionRNG
from shardtrain.tensor_parallel.styles import STYLES, TPStyle, packed_colwise, packed_rowwise

__all__ = [
    "BART_TP_PLAN",
    "GPT2_TP_PLAN",
    "GPT_TP_PLAN",
    "SHIPPED_PLANS",
    "STYLES",
    "T5_TP_PLAN",
    "ColumnParallelLinear",
    "HiddenParallelEmbedding",
    "ParameterSharder",
    "RegionRNG",
    "RowParallelLinear",
    "TPPlacement",
    "TPPlan",
    "TPStyle",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "assemble_blocks",
    "check_same_batch",
    "copy_to_tp_region",
    "gather_from_tp_region",
    "hf_tp_plan",
    "own_plan",
    "packed_colwise",
    "packed_rowwise",
    "parallelize",
    "reduce_from_tp_region",
    "replicate_experts",
    "scatter_to_tp_region",
    "shard_block",
    "sum_partial_gradients",
    "vocab_parallel_cross_entropy",
]
