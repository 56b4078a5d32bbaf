"""A Hugging Face causal LM (built from a small config, random weights, nothing downloaded) trains under
ZeRO stage 3 exactly like one process."""

import functools

import pytest
import torch

import shardtrain
from shardtrain.testing import run_distributed

from helpers.parity import assert_params_near

transformers = pytest.importorskip("transformers")  # a dev dependency; always installed by `make test`

VOCAB, SEQ, STEPS, GAS, MICRO = 96, 16, 6, 2, 2


def make_hf_model() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def batches(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g) for _ in range(STEPS * GAS)]


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


@functools.cache
def reference(world: int) -> dict:
    """One process, the global batch, in fp32; ``exact``: the same in float64 ([Note: parity bounds])."""
    ref = _reference(world, torch.float32)
    ref["exact"] = _reference(world, torch.float64)["state"]
    return ref


def _reference(world: int, dtype: torch.dtype) -> dict:
    model = make_hf_model().to(dtype)
    opt = optimizer(model)
    data = batches(world)
    losses, norms = [], []
    for s in range(STEPS):
        total = 0.0
        for m in range(GAS):
            loss = model(input_ids=data[s * GAS + m], labels=data[s * GAS + m]).loss
            (loss / GAS).backward()
            total += loss.item() / GAS
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def _train(world: int, stage: int = 3) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = make_hf_model()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage},
    }
    engine = shardtrain.initialize(model, config=config, optimizer=optimizer(model))
    data = batches(world)
    losses, norms = [], []
    for s in range(STEPS):
        total = 0.0
        for m in range(GAS):
            x = data[s * GAS + m][rank * MICRO : (rank + 1) * MICRO]
            out = engine(input_ids=x, labels=x)  # a ModelOutput, walked like any nested output
            engine.backward(out.loss)
            engine.step()
            total += out.loss.item() / GAS
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    units = [u.name for u in engine._runtime.units] if stage == 3 else []
    return {"losses": losses, "norms": norms, "state": engine.full_state_dict(), "units": units}


@pytest.mark.parametrize("world", [2, 3])
def test_gpt2_stage3_parity(world):
    ref = reference(world)
    results = run_distributed(_train, world, world, timeout=300)
    assert results[0]["units"] == ["transformer.h.1", "transformer.h.0", "<root>"]
    for s in range(STEPS):
        loss = sum(r["losses"][s] for r in results) / world
        assert abs(loss - ref["losses"][s]) <= 1e-5 * ref["losses"][s], s
        assert abs(results[0]["norms"][s] - ref["norms"][s]) <= 1e-4 * ref["norms"][s], s
    assert_params_near(results[0]["state"], ref["state"], make_hf_model().state_dict(), exact=ref["exact"])


def test_gpt2_stage3_and_stage0_end_with_the_same_parameters():
    stage0 = run_distributed(_train, 3, 3, 0, timeout=300)[0]
    stage3 = run_distributed(_train, 3, 3, 3, timeout=300)[0]
    assert_params_near(stage3["state"], stage0["state"], make_hf_model().state_dict())
    assert stage0["losses"] == pytest.approx(stage3["losses"], rel=1e-6)
