"""``engine.eval_batch``: the forward schedule only, against one process's evaluation of the same global batch, at
ZeRO-3 over each stage's two data-parallel ranks (pp 2 x dp 2); what it does not build is refused by name."""

from __future__ import annotations

import torch

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

VOCAB, SEQ, GAS, MICRO, PP = 32, 8, 2, 2, 2


def _model() -> GPT:
    torch.manual_seed(0)
    # dropout on: an evaluation that left the module in training mode would not match the reference
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layer=4, n_head=2, dropout=0.2))


def _global_batches(dp: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(GAS):
        x = torch.randint(0, VOCAB, (MICRO * dp, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _message(call) -> str:
    try:
        call()
    except ConfigError as err:
        return str(err)
    return "no error"


def _evaluate() -> dict:
    model = _model()
    config = {
        "pipeline_parallel_size": PP,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine = shardtrain.initialize(model, config, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    t = engine.topology
    rows = slice(t.dp_rank * MICRO, (t.dp_rank + 1) * MICRO)

    def mine(seed: int) -> list:
        return [(x[rows], y[rows]) for x, y in _global_batches(t.dp, seed)]

    out = {"before": float(engine.eval_batch(iter(mine(1)))), "training": engine.module.training}
    engine.train_batch(iter(mine(2)))  # dropout on: not compared, but the evaluation after must see its step
    out["after"] = float(engine.eval_batch(iter(mine(1))))
    out["global_step"] = engine.global_step
    unbroadcast = engine.eval_batch(iter(mine(1)), bcast_loss=False)
    out["unbroadcast"] = None if unbroadcast is None else float(unbroadcast)
    out["logits"] = _message(lambda: engine.eval_batch(iter(mine(1)), return_logits=True))
    out["count"] = _message(lambda: engine.eval_batch(iter(mine(1)), num_micro_batches=GAS + 1))
    out["ran out"] = _message(lambda: engine.eval_batch(iter(mine(1)[:1])))
    out["params"] = engine.full_state_dict()
    engine.close()
    return out


def _reference_loss(model: GPT, dp: int, seed: int) -> float:
    model.eval()
    with torch.no_grad():
        return sum(float(model(x, y)) for x, y in _global_batches(dp, seed)) / GAS


def test_eval_batch_matches_one_process():
    results = run_distributed(_evaluate, 4)
    dp = 4 // PP
    before = _reference_loss(_model(), dp, 1)
    trained = _model()
    trained.load_state_dict(results[0]["params"])
    after = _reference_loss(trained, dp, 1)
    for r in results:
        assert abs(r["before"] - before) <= 1e-5 * before, (r["before"], before)
        assert abs(r["after"] - after) <= 1e-5 * after, (r["after"], after)
        assert r["after"] != r["before"] and r["global_step"] == 1  # evaluation steps nothing
        assert r["training"] is True  # the module is back in training mode
        assert "eval_batch with return_logits=True" in r["logits"] and "not built" in r["logits"], r["logits"]
        assert "num_micro_batches=3" in r["count"], r["count"]
        assert "data_iter ran out after 1 of the 2 micro-batches" in r["ran out"], r["ran out"]
        assert "give eval_batch an iterator" in r["ran out"], r["ran out"]
    # without the broadcast only the last stage's ranks hold the loss, as in DeepSpeed
    assert [r["unbroadcast"] is None for r in results] == [True, True, False, False]
    assert results[2]["unbroadcast"] == results[3]["unbroadcast"] == results[2]["after"]
