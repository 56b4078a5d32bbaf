"""Encoder-decoder models under tensor parallelism with the plans shardtrain ships ([Note: encoder-decoder plans]).

* Through the engine against one process (losses, global gradient norms, final parameters; SGD): T5 (relative
  attention bias split by heads, the decoder's cross-attention) at tp 2 (ZeRO-3) and, with its gated feed-forward,
  at tp 3 (ZeRO-2); BART at tp 2 (ZeRO-1) and tp 3 (ZeRO-0), in the jobs of ``helpers.tp_hf_cases.outcomes``.
* In one process: a shipped plan is what ``parallelize(model, None, ...)`` applies when transformers declares none
  (the cross-attention's projections split, the relative attention bias split by heads, the head counts divided),
  a model's own plan wins over it, and a model type with neither is refused naming the shipped ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel import SHIPPED_PLANS, T5_TP_PLAN, own_plan, parallelize

from helpers.tp_arch_cases import build
from helpers.tp_hf_cases import make_model, outcomes


@pytest.mark.parametrize("world", [2, 3])
def test_t5_and_bart_match_one_process(world):
    got = {k: v for k, v in outcomes(world).items() if k[0] in ("t5", "t5_gated", "bart")}
    assert len(got) == 2 and not any(got.values()), got


def test_the_shipped_t5_plan_splits_heads_and_cross_attention():
    model = make_model("t5")
    placements = parallelize(model, None, SimpleNamespace(rank=0, size=2), check_replicated_grads=False)
    cross = model.decoder.block[0].layer[1].EncDecAttention
    assert cross.n_heads == 3 and cross.inner_dim == 24, (cross.n_heads, cross.inner_dim)
    for name in (
        "decoder.block.1.layer.1.EncDecAttention.k.weight",
        "decoder.block.0.layer.2.DenseReluDense.wi.weight",
        "encoder.block.1.layer.0.SelfAttention.q.weight",
    ):
        assert placements[name].dim == 0, (name, placements[name])
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert placements[bias].dim == 1 and model.get_parameter(bias).shape == (32, 3)
    assert placements["decoder.block.0.layer.1.EncDecAttention.o.weight"].dim == 1
    assert not placements["shared.weight"].is_split


def test_a_models_own_plan_wins_and_a_model_with_none_is_refused_naming_the_shipped_ones():
    assert own_plan(make_model("bart")).styles["model.encoder.layers.*.fc1"] == "colwise"
    assert own_plan(make_model("t5")).per_rank_attributes == dict(T5_TP_PLAN.per_rank_attributes)
    assert "lm_head" in own_plan(build("llama")).styles  # transformers' own
    refused = r"declares no tensor-parallel plan .* ships none for its model type \('bert'; shipped: bart, .*, t5\)"
    with pytest.raises(LayoutError, match=refused):
        own_plan(build("bert"))
    assert {"t5", "mt5", "bart", "marian"} <= set(SHIPPED_PLANS)
