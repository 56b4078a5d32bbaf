"""Sequence parallelism on padded batches: parity with one process ([Note: masks under Ulysses]).

Each micro-batch has a right-padded row and a left-padded one (labels -100 at the padding), so the slices of a
sequence hold different numbers of real tokens and, at sp 3, a slice of the left-padded row is padding only. The
attention after the exchange must see the whole sequence's padding mask; positions are the model's own (``0..S-1``
for left padding too, as transformers makes them); the loss is the mean over the real tokens of the whole batch.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from shardtrain.testing import run_distributed
from shardtrain.testing.parity import Recipe, assert_params_near, engine_run, reference_run
from test_sequence_parallel_tp import ROWS, SEQ, VOCAB, model_of, optimizer_of

STEPS, GAS, PAD_ID = 2, 2, 0


def padded_batches(packed: bool = False) -> list[dict[str, torch.Tensor]]:
    """``input_ids``, ``attention_mask`` and ``labels`` (the tokens' own ids, transformers shifts them) of each
    micro-step. Row 0 is right-padded, row 1 left-padded, by 3 to 6 tokens. ``packed``: no mask, but row 0 holds two
    sequences told apart by ``position_ids`` restarting at 0 (transformers' packed format), every other micro-step
    with ``use_cache=False`` (only then does transformers keep them apart)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS * GAS):
        x = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
        if packed:
            cut = int(torch.randint(3, SEQ - 3, (1,), generator=g))
            positions = torch.arange(SEQ).repeat(ROWS, 1)
            positions[0, cut:] = torch.arange(SEQ - cut)
            labels = x.clone()
            labels[0, cut] = -100  # a new sequence's first token is no target of the previous one
            # without a cache transformers isolates the packed sequences; with one (use_cache's default) it does not
            cache = {"use_cache": False} if len(out) % 2 == 0 else {}
            out.append({"input_ids": x, "position_ids": positions, "labels": labels, **cache})
            continue
        mask = torch.ones_like(x)
        right, left = (int(n) for n in torch.randint(3, 7, (2,), generator=g))
        mask[0, SEQ - right :] = 0
        mask[1, :left] = 0
        x = torch.where(mask.bool(), x, PAD_ID)
        out.append({"input_ids": x, "attention_mask": mask, "labels": torch.where(mask.bool(), x, -100)})
    return out


def keyword_loss(model, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def recipe(attn: str, packed: bool, sp: int, tp: int, stage: int) -> Recipe:
    """The Llama with ``attn`` on :func:`padded_batches` (whole rows on every rank: one data-parallel rank), AdamW,
    clipping at 1."""
    return Recipe(
        make_model=partial(model_of, "llama", attn=attn),
        make_optimizer=optimizer_of,
        batches=partial(padded_batches, packed),
        loss=keyword_loss,
        gas=GAS,
        clip=1.0,
        config={"sequence_parallel_size": sp, "tensor_parallel": {"size": tp}, "zero_optimization": {"stage": stage}},
    )


def check_padded_parity(attn: str, sp: int, tp: int = 1, stage: int = 1, packed: bool = False) -> None:
    parity = recipe(attn, packed, sp, tp, stage)
    results = run_distributed(engine_run, sp * tp, parity, init_process_group=False)
    ref = reference_run(parity)
    for r in results:
        for step in range(STEPS):
            got, want = r["losses"][step], ref["losses"][step]
            assert abs(got - want) <= 1e-5 * want, f"step {step}: loss {got} vs one process {want}"
            got, want = r["norms"][step], ref["norms"][step]
            assert abs(got - want) <= 1e-4 * want, f"step {step}: gradient norm {got} vs one process {want}"
    assert_params_near(results[0]["params"], ref["params"], ref["init"], exact=ref["exact"], require_moved=True)


def test_padded_batch_parity():
    """sp 3 (odd), sdpa with the whole sequence's boolean mask after the exchange: the left-padded row's first slice
    is padding only, and its real tokens must not see the padding of the slices before theirs."""
    check_padded_parity("sdpa", 3)


@pytest.mark.soak
@pytest.mark.parametrize(
    ("attn", "sp", "tp", "stage", "packed"),
    [
        ("sdpa", 2, 1, 1, False),
        ("eager", 3, 1, 3, False),
        ("sdpa", 2, 2, 3, False),
        ("sdpa", 2, 1, 2, True),
        ("eager", 3, 1, 1, True),
    ],
)
def test_padded_and_packed_more_cases(attn, sp, tp, stage, packed):
    """sp 2; eager attention (the mask in its additive form); with tensor parallelism; sequences packed in a row."""
    check_padded_parity(attn, sp, tp, stage, packed)


def test_the_mask_reaching_attention_is_the_whole_sequences():
    """The mask built before the split equals the one transformers builds for one process (sdpa: booleans over the
    whole sequence), and is None where one process would use sdpa's causal path."""
    from transformers.masking_utils import create_causal_mask

    from shardtrain.sequence_parallel.inputs import whole_sequence_mask

    model = model_of("llama")
    batch = padded_batches()[0]
    x, mask = batch["input_ids"], batch["attention_mask"]
    embeds = model.get_input_embeddings()(x)
    positions = torch.arange(SEQ)[None]
    want = create_causal_mask(model.config, embeds, mask, None, positions)
    got = whole_sequence_mask(model.config, mask, positions, ROWS, SEQ, x.device)
    assert got.dtype == torch.bool and got.shape == (ROWS, 1, SEQ, SEQ) and torch.equal(got, want)
    assert not bool(got[1, 0, 0].any())  # left padding: the first query of row 1 attends to nothing
    assert whole_sequence_mask(model.config, torch.ones_like(mask), positions, ROWS, SEQ, x.device) is None
