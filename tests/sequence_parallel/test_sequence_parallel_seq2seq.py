"""Sequence parallelism for encoder-decoder models (T5, BART): both sequences split, the cross-attention through the
same exchange, against one process on the same global batch ([Note: encoder-decoder models under Ulysses] in
``shardtrain/sequence_parallel/seq2seq.py``).

The encoder's sequence (11 tokens) and the decoder's (7) divide by neither 2 nor 3: both are padded inside the
engine at every group size. From the second micro-step on, one row per data-parallel rank has encoder padding (a
2-D ``attention_mask``) and its labels end in -100, so the whole-sequence masks, a slice without a real target and
the loss over unequal real-token counts are all exercised. The decoder's inputs are made by the model from the
labels (shifted right over the whole sequence). 6 heads: sequence-parallel groups of 2 and 3 divide them.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from shardtrain.errors import ShardtrainError
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import Recipe, assert_params_near, engine_run, reference_run

from helpers.sp_cases import keyword_recipe

VOCAB, ENC, DEC, ROWS, STEPS, GAS = 64, 11, 7, 2, 2, 2


def _model(case: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    attn = "eager" if case.endswith("eager") else "sdpa"
    if case.startswith("t5"):
        cfg = transformers.T5Config(
            vocab_size=VOCAB,
            d_model=48,
            d_kv=8,
            d_ff=64,
            num_heads=6,
            num_layers=2,
            num_decoder_layers=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            attn_implementation=attn,
        )
        model = transformers.T5ForConditionalGeneration(cfg)
    elif case.startswith("bart"):
        cfg = transformers.BartConfig(
            vocab_size=VOCAB,
            d_model=48,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=6,
            decoder_attention_heads=6,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=ENC,  # padding runs past the table: its positions are held at the last
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            pad_token_id=1,
            decoder_start_token_id=2,
            attn_implementation=attn,
        )
        model = transformers.BartForConditionalGeneration(cfg)
    else:
        raise ValueError(case)
    if case.endswith("checkpointed"):  # the layers run again in backward: the position bias must still be found
        model.gradient_checkpointing_enable()
    return model.to(dtype)


def _batches(dp: int) -> list[dict[str, torch.Tensor]]:
    """Keyword inputs of each micro-step, ``ROWS * dp`` rows: encoder ids (the last row of every data-parallel
    rank padded at the end from the second micro-step on) and decoder labels (a fifth dropped to -100, the padded
    rows' last three)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(STEPS * GAS):
        x = torch.randint(3, VOCAB, (ROWS * dp, ENC), generator=g)
        y = torch.randint(3, VOCAB, (ROWS * dp, DEC), generator=g)
        labels = torch.where(torch.rand(y.shape, generator=g) < 0.8, y, -100)
        batch = {"input_ids": x, "labels": labels}
        if i:
            mask, decoder_mask = torch.ones_like(x), torch.ones_like(y)
            mask[ROWS - 1 :: ROWS, ENC - 4 :] = 0
            decoder_mask[ROWS - 1 :: ROWS, DEC - 3 :] = 0
            labels[ROWS - 1 :: ROWS, DEC - 3 :] = -100
            batch["attention_mask"] = mask
            if i % 2:  # the decoder's padding mask too, on every other micro-step
                batch["decoder_attention_mask"] = decoder_mask
        out.append(batch)
    return out


def _recipe(case: str, sp: int, stage: int, dp: int) -> Recipe:
    """``case`` at ``sequence_parallel_size`` ``sp`` and ZeRO ``stage``, on batches of ``dp`` data-parallel ranks'
    rows."""
    config = {"sequence_parallel_size": sp, "zero_optimization": {"stage": stage}}
    return keyword_recipe(partial(_model, case), partial(_batches, dp), GAS, config)


def _exchanges(engine) -> dict:
    return {"all_to_all": engine._sp.comm.stats()["all_to_all"]["calls"]}  # the sequence-parallel group's


def _check_parity(case: str, world: int, sp: int, stage: int) -> None:
    dp = world // sp
    recipe = _recipe(case, sp, stage, dp)
    results = run_distributed(engine_run, world, recipe, _exchanges, init_process_group=False)
    ref = reference_run(recipe, dp)
    losses = [sum(r["losses"][s] for r in results[::sp]) / dp for s in range(STEPS)]
    for s, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {s}: loss {got} vs one process {want}"
    for r in results:
        for s, (got, want) in enumerate(zip(r["norms"], ref["norms"])):
            assert abs(got - want) <= 1e-4 * want, f"step {s}: gradient norm {got} vs one process {want}"
        # q, k, v and the output of 2 encoder, 2 decoder and 2 cross-attention layers, forward and backward (and
        # forward again in backward under activation checkpointing)
        passes = 3 if case.endswith("checkpointed") else 2
        assert r["all_to_all"] == 4 * 6 * passes * STEPS * GAS, r["all_to_all"]
    buffers = {name for name, _ in _model(case).named_buffers()}  # BART's final_logits_bias: never trained
    got, want = ({k: v for k, v in d.items() if k not in buffers} for d in (results[0]["params"], ref["params"]))
    assert_params_near(got, want, ref["init"], exact=ref["exact"], require_moved=True)


@pytest.mark.parametrize(("case", "world", "sp", "stage"), [("t5", 2, 2, 3), ("bart", 3, 3, 3)])
def test_parity_with_one_process(case, world, sp, stage):
    """T5 (relative position bias, made from the whole lengths after the exchange) and BART (learned positions,
    offset per slice) at ZeRO-3, the stage the other sequence-parallel model tests use."""
    _check_parity(case, world, sp, stage)


@pytest.mark.soak
@pytest.mark.parametrize(
    ("case", "world", "sp", "stage"),
    [("t5", 3, 3, 3), ("bart", 2, 2, 3), ("t5_eager", 3, 3, 1), ("bart_eager", 2, 2, 0), ("t5", 4, 2, 3)]
    + [("t5_checkpointed", 2, 2, 3), ("bart_checkpointed", 3, 3, 1)],
)
def test_parity_more_cases(case, world, sp, stage):
    """Groups of 2 and 3 for both models, eager attention (the additive masks), other stages, and two
    data-parallel ranks of sequence-parallel pairs."""
    _check_parity(case, world, sp, stage)


def _refusal(build) -> str:
    from types import SimpleNamespace

    from shardtrain.sequence_parallel import make_splitter

    try:
        make_splitter(build(), SimpleNamespace(size=1, rank=0, global_rank=0))
    except ShardtrainError as err:
        return str(err)
    return "no error"


def test_encoder_decoders_it_cannot_serve_are_refused_by_their_real_reason():
    import transformers

    seq2seq = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, max_position_embeddings=16)
    seq2seq.update(encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)
    t5 = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=32, num_heads=4, num_layers=1)
    got = {
        "m2m": _refusal(lambda: transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**seq2seq))),
        "switch": _refusal(
            lambda: transformers.SwitchTransformersForConditionalGeneration(
                transformers.SwitchTransformersConfig(**t5, num_experts=2, num_sparse_encoder_layers=1)
            )
        ),
        "pooled": _refusal(lambda: transformers.BartForSequenceClassification(transformers.BartConfig(**seq2seq))),
        "led": _refusal(lambda: transformers.LEDForConditionalGeneration(transformers.LEDConfig(**seq2seq))),
    }
    assert "M2M100ForConditionalGeneration's encoder makes its positions in a way" in got["m2m"], got["m2m"]
    assert "routes tokens to experts" in got["switch"], got["switch"]
    assert "BartForSequenceClassification's head reads one pooled token" in got["pooled"], got["pooled"]
    assert "no encoder" in got["led"] and "attention interface" in got["led"], got["led"]
    for build in (lambda: _model("t5"), lambda: _model("bart")):
        assert _refusal(build) == "no error"
    # a decoder whose heads the group does not divide, refused at initialize rather than at the first exchange
    from types import SimpleNamespace

    from shardtrain.sequence_parallel import make_splitter

    heads = {**seq2seq, "d_model": 48, "encoder_attention_heads": 6, "decoder_attention_heads": 4}
    odd = transformers.BartForConditionalGeneration(transformers.BartConfig(**heads))
    with pytest.raises(ShardtrainError, match="sequence_parallel_size 3 does not divide the 4 attention heads"):
        make_splitter(odd, SimpleNamespace(size=3, rank=0, global_rank=0))
