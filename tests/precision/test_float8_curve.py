"""The fp8 loss curve (issue 50): the project's GPT trained 200 steps on the demo's data (the Markov corpus of
``shardtrain demo``) with its linears converted as ``fp8`` converts them (emulated) stays within 2% of the same
training without fp8, window by window."""

import pytest
import torch

from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.models.markov import MarkovCorpus
from shardtrain.plan.policies import Float8Policy
from shardtrain.precision.float8 import convert_to_float8

STEPS, WINDOW, ROWS = 200, 20, 8
GPT_CFG = GPTConfig(vocab_size=96, seq_len=32, d_model=64, n_layer=2, n_head=4, tie_embeddings=True)


def _curve(fp8: bool, dtype: torch.dtype = torch.float32) -> list[float]:
    """``STEPS`` AdamW steps (the demo's optimizer: lr 3e-3, weight decay 0.01, clipping at 1) from the same
    weights on the same batches; each step's loss. ``dtype``: the compute dtype (bf16 under CPU autocast)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend (40x slower on a loaded 2-core machine)
    try:
        return _train(fp8, dtype)
    finally:
        torch.set_num_threads(threads)


def _train(fp8: bool, dtype: torch.dtype) -> list[float]:
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    if fp8:
        done = convert_to_float8(model, Float8Policy(True, "tensorwise", True))
        assert len(done.converted) == 4 * GPT_CFG.n_layer  # qkv, proj and the MLP's two; the tied head kept
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    corpus, data = MarkovCorpus(GPT_CFG.vocab_size, seed=0), torch.Generator().manual_seed(1000)
    losses = []
    for _ in range(STEPS):
        x, y = corpus.batch(ROWS, GPT_CFG.seq_len, data)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _windows(losses: list[float]) -> list[float]:
    return [sum(losses[i : i + WINDOW]) / WINDOW for i in range(0, len(losses), WINDOW)]


# [Note: the fp8 loss curve] The reference is the fp32 run: on the CPU it is the exact curve, and fp8's high-precision
# side here is fp32, so the gap is float8's alone; bf16 (CPU autocast) is checked against it too, as the issue's
# "bf16's curve". Measured (mean loss of each 20-step window): fp32 3.660 -> 1.227, fp8 3.663 -> 1.228 (at most 0.25%
# from fp32, at window 3), bf16 3.661 -> 1.227 (at most 0.04%). Bound: 2%, the issue's; 8x the measured gap.
CURVE_RTOL = 0.02


@pytest.mark.soak  # ~50 s here: 600 steps, the float8 ones emulated
def test_fp8_loss_curve_over_200_steps_of_the_demo_gpt_stays_within_2_percent_of_fp32():
    fp32, fp8 = _windows(_curve(False)), _windows(_curve(True))
    bf16 = _windows(_curve(False, torch.bfloat16))
    assert fp32[-1] < 0.6 * fp32[0], fp32  # it learns: the comparison is of a falling curve
    for i, (want, got, half) in enumerate(zip(fp32, fp8, bf16)):
        assert abs(got - want) <= CURVE_RTOL * want, f"window {i}: fp8 {got:.4f} vs fp32 {want:.4f}"
        assert abs(half - want) <= CURVE_RTOL * want, f"window {i}: bf16 {half:.4f} vs fp32 {want:.4f}"
    assert fp8 != fp32  # the float8 casts ran
