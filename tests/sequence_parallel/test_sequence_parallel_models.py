"""Sequence parallelism beyond the causal decoder: a masked LM (bidirectional attention, labels not shifted), a
mixture of experts with the router's load-balancing loss, and sliding-window attention, each against one process on
the same global batch; and the models still refused, by their real reason (docs/sequence-parallel.md).

From the second micro-step on, one row per data-parallel rank is padded at the end (a 2-D ``attention_mask``; the
first micro-step has none, so the unmasked path runs too), and the masked LM's slices are often without a real
target: the whole-sequence mask, the loss over unequal real-token counts and the zero-target slice are all
exercised.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from shardtrain.errors import ShardtrainError
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import Recipe, assert_params_near, engine_run, reference_run

from helpers.sp_cases import keyword_recipe

VOCAB, SEQ, ROWS, STEPS, GAS = 64, 12, 2, 2, 2


def _model(case: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=6)
    if case in ("bert", "bert_eager"):
        cfg = transformers.BertConfig(
            **common,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager" if case == "bert_eager" else "sdpa",
        )
        model = transformers.BertForMaskedLM(cfg)
    elif case == "roberta":  # numbers its positions from padding_idx + 1, not 0: the engine must do as it does
        cfg = transformers.RobertaConfig(
            **common,
            intermediate_size=64,
            max_position_embeddings=SEQ + 2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = transformers.RobertaForMaskedLM(cfg)
    elif case in ("mixtral", "qwen2_moe"):
        moe = dict(
            **common,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            output_router_logits=True,
            router_aux_loss_coef=0.5,  # large, so that a per-slice aux term would show
            tie_word_embeddings=False,
            experts_implementation="eager",  # a loop over experts: also in float64 (the exact reference)
        )
        if case == "mixtral":
            cfg = transformers.MixtralConfig(**moe, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
            model = transformers.MixtralForCausalLM(cfg)
        else:
            cfg = transformers.Qwen2MoeConfig(
                **moe,
                intermediate_size=64,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
            )
            model = transformers.Qwen2MoeForCausalLM(cfg)
    elif case in ("mistral_window", "mistral_window_eager"):
        cfg = transformers.MistralConfig(
            **common,
            intermediate_size=64,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            sliding_window=5,  # shorter than a sequence and longer than a slice at sp 3
            tie_word_embeddings=False,
            attn_implementation="eager" if case.endswith("eager") else "sdpa",
        )
        model = transformers.MistralForCausalLM(cfg)
    elif case == "gemma2":  # sliding and full layers alternate, soft-capped logits (eager, as Gemma2 prefers)
        cfg = transformers.Gemma2Config(
            **common,
            intermediate_size=64,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=SEQ,
            sliding_window=4,
            attn_implementation="eager",
        )
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        raise ValueError(case)
    return model.to(dtype)


def _masked(case: str) -> bool:
    return case.startswith(("bert", "roberta"))


def _batches(dp: int, masked_lm: bool) -> list[dict[str, torch.Tensor]]:
    """Keyword inputs of each micro-step, ``ROWS * dp`` rows: the last row of every data-parallel rank padded at
    the end (mask 0, labels -100). A masked LM's labels: 15% of the tokens, the rest -100 (slices with no real
    target are common); a causal LM's: the tokens' ids, a fifth dropped."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(STEPS * GAS):
        x = torch.randint(0, VOCAB, (ROWS * dp, SEQ), generator=g)
        mask = torch.ones_like(x)
        if i:
            mask[ROWS - 1 :: ROWS, SEQ - 3 :] = 0
        keep = torch.rand(x.shape, generator=g) < (0.15 if masked_lm else 0.8)
        labels = torch.where(keep & (mask == 1), x, -100)
        out.append({"input_ids": x, "labels": labels, **({"attention_mask": mask} if i else {})})
    return out


def _recipe(case: str, sp: int = 1, stage: int = 0, dp: int = 1) -> Recipe:
    """``case`` at ``sequence_parallel_size`` ``sp`` and ZeRO ``stage``, on batches of ``dp`` data-parallel ranks'
    rows."""
    config = {"sequence_parallel_size": sp, "zero_optimization": {"stage": stage}}
    return keyword_recipe(partial(_model, case), partial(_batches, dp, _masked(case)), GAS, config)


def _check_parity(case: str, world: int, sp: int, stage: int) -> None:
    dp = world // sp
    recipe = _recipe(case, sp, stage, dp)
    results = run_distributed(engine_run, world, recipe, init_process_group=False)
    ref = reference_run(recipe, dp)
    losses = [sum(r["losses"][s] for r in results[::sp]) / dp for s in range(STEPS)]
    for s, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {s}: loss {got} vs one process {want}"
    for r in results:
        for s, (got, want) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(got - want) <= 1e-4 * want, f"step {s}: gradient norm {got} vs one process {want}"
    assert_params_near(results[0]["params"], ref["params"], ref["init"], exact=ref["exact"], require_moved=True)


@pytest.mark.parametrize(
    ("case", "world", "sp", "stage"),
    [("bert", 2, 2, 3), ("roberta", 2, 2, 3), ("mixtral", 2, 2, 3), ("mistral_window", 2, 2, 1)],
)
def test_parity_with_one_process(case, world, sp, stage):
    """A masked LM (labels not shifted, bidirectional attention and padding mask; RoBERTa's positions its own), a
    mixture of experts whose load-balancing loss is the whole sequence's, and sliding-window attention applied after
    the exchange."""
    _check_parity(case, world, sp, stage)


@pytest.mark.soak
@pytest.mark.parametrize(
    ("case", "world", "sp", "stage"),
    [("bert_eager", 3, 3, 1), ("bert", 3, 3, 3), ("qwen2_moe", 2, 2, 1), ("mixtral", 3, 3, 0)]
    + [("mistral_window", 3, 3, 0), ("mistral_window_eager", 2, 2, 3), ("gemma2", 2, 2, 3), ("gemma2", 3, 3, 1)],
)
def test_parity_more_models(case, world, sp, stage):
    _check_parity(case, world, sp, stage)


@pytest.mark.parametrize("case", ["bert", "bert_eager", "mistral_window", "mistral_window_eager", "gemma2"])
def test_attention_is_the_models_own_around_the_exchange(case):
    """Ulysses over a group of one (the exchanges are identities): bidirectional attention stays bidirectional and
    a sliding window is the model's own, with and without a padding mask, sdpa and eager."""
    from types import SimpleNamespace

    from shardtrain.sequence_parallel import install_ulysses
    from shardtrain.sequence_parallel.inputs import whole_sequence_mask
    from shardtrain.sequence_parallel.model_kinds import attention_is_causal

    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    pad = torch.ones_like(x)
    pad[1, -3:] = 0
    plain, wrapped = _model(case).eval(), _model(case).eval()
    causal = attention_is_causal(wrapped)
    assert causal is not _masked(case)
    install_ulysses(wrapped, SimpleNamespace(size=1))
    for mask in (None, pad):
        whole = whole_sequence_mask(wrapped.config, mask, None, ROWS, SEQ, "cpu", causal=causal)  # as the engine
        want = plain(input_ids=x, attention_mask=mask).logits
        got = wrapped(input_ids=x, attention_mask=whole).logits
        keep = pad.bool() if mask is not None else torch.ones_like(pad, dtype=torch.bool)
        assert (got - want)[keep].abs().max().item() <= 1e-5, (case, mask is not None)


def _refusal(build) -> str:
    from types import SimpleNamespace

    from shardtrain.sequence_parallel import SequenceSplitter

    try:
        SequenceSplitter(build(), SimpleNamespace(size=1, rank=0, global_rank=0))
    except ShardtrainError as err:
        return str(err)
    return "no error"


def test_what_is_not_built_is_refused_by_its_real_reason():
    import transformers

    tiny = dict(hidden_size=32, num_attention_heads=2, intermediate_size=32)
    t5 = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_ff=32, d_kv=16, num_heads=2, num_layers=1)
    vit = transformers.ViTConfig(**tiny, num_hidden_layers=1, image_size=8, patch_size=4)
    bert = transformers.BertConfig(vocab_size=VOCAB, num_hidden_layers=1, **tiny)
    pegasus = transformers.BigBirdPegasusConfig(
        vocab_size=VOCAB, d_model=32, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=32
    )
    got = {
        "t5": _refusal(lambda: transformers.T5ForConditionalGeneration(t5)),
        "pooled": _refusal(lambda: transformers.BertForSequenceClassification(bert)),
        "positions": _refusal(lambda: transformers.BigBirdPegasusForCausalLM(pegasus)),
        "mamba": _refusal(lambda: transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=VOCAB, **tiny))),
    }
    # an encoder-decoder has a splitter of its own (tests/sequence_parallel/test_sequence_parallel_seq2seq.py), and a
    # vision transformer is split after its embeddings (tests/sequence_parallel/test_sequence_parallel_vision.py)
    assert "T5ForConditionalGeneration is an encoder-decoder model" in got["t5"], got["t5"]
    assert "Seq2SeqSplitter" in got["t5"] and "causal" not in got["t5"], got["t5"]
    from types import SimpleNamespace

    from shardtrain.sequence_parallel import PatchSplitter, Seq2SeqSplitter, make_splitter

    comm = SimpleNamespace(size=1, rank=0, global_rank=0)
    assert isinstance(make_splitter(transformers.T5ForConditionalGeneration(t5), comm), Seq2SeqSplitter)
    assert isinstance(make_splitter(transformers.ViTForImageClassification(vit), comm), PatchSplitter)
    assert "BertForSequenceClassification's head reads one pooled token" in got["pooled"], got["pooled"]
    assert "BigBirdPegasusForCausalLM's forward takes no position_ids" in got["positions"], got["positions"]
    assert "MambaForCausalLM mixes its sequence outside attention" in got["mamba"], got["mamba"]
    assert _refusal(lambda: _model("bert")) == "no error"


@pytest.mark.parametrize(("model_type", "indexer"), [("axk2", "AXK2Indexer"), ("hy_v4", "HYV4Indexer")])
def test_sparse_attention_with_an_indexer_is_refused_by_name(model_type, indexer):
    """DeepSeek sparse attention's lightning indexer picks each query's keys inside the attention module, before the
    attention function the exchange wraps: on a slice it would pick among the slice's tokens."""
    from helpers.model_sweep import build

    message = _refusal(lambda: build("decoder-only", model_type))
    assert f"uses sparse attention with a lightning indexer ({indexer}" in message, message
    assert "this rank's slice" in message, message
