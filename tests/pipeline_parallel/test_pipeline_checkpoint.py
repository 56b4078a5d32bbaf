"""Checkpoints of a pipeline-parallel engine: a save at pp 2 resumes bit for bit at pp 2, and loads at pp 1 and pp 4
(one manifest of the model's logical tensors, each stage writing its own, [Note: stages keep the model's names])."""

from __future__ import annotations

import torch

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

VOCAB, SEQ, GAS, MICRO = 32, 8, 2, 2


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layer=4, n_head=2))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps * GAS):
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _engine(pp: int, seed: int = 0, stage: int = 1) -> shardtrain.Engine:
    model = _model(seed)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "pipeline_parallel_size": pp,
        # GAS micro-batches: 1F1B needs one per stage, GPipe runs at any number of stages
        "pipeline": {"schedule": "GPipe" if pp > GAS else "1F1B"},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    # SGD with momentum: state to resume, and no normalisation that turns a zero gradient's rounding (the attention
    # key bias, [Note: parity bounds]) into full steps, so pp 1 and pp 2 stay within rounding of each other
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return shardtrain.initialize(model, config, optimizer=optimizer)


def _train(engine: shardtrain.Engine, batches: list, steps: range) -> list[float]:
    losses = []
    for s in steps:
        micro = batches[s * GAS : (s + 1) * GAS]
        if engine.topology.pp > 1:
            losses.append(float(engine.train_batch(iter(micro))))
            continue
        total = 0.0
        for x, y in micro:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss) / GAS
        losses.append(total)
    return losses


def _save_and_resume(path: str, stage: int = 1) -> dict:
    batches = _batches(4)
    engine = _engine(pp=2, stage=stage)
    _train(engine, batches, range(2))
    engine.save_checkpoint(path, tag="step2")
    saved = engine.full_state_dict()
    straight = _train(engine, batches, range(2, 4))
    final = engine.full_state_dict()
    engine.close()
    # other initial weights: everything must come from the checkpoint
    resumed_engine = _engine(pp=2, seed=1, stage=stage)
    resumed_engine.load_checkpoint(path, tag="step2")
    resumed = _train(resumed_engine, batches, range(2, 4))
    out = {
        "straight": straight,
        "resumed": resumed,
        "global_step": resumed_engine.global_step,
        "saved": saved,
        "final": final,
        "resumed final": resumed_engine.full_state_dict(),
    }
    resumed_engine.close()
    return out


def _load_at(path: str, pp: int = 1) -> dict:
    engine = _engine(pp=pp, seed=1)
    engine.load_checkpoint(path, tag="step2")
    loaded = engine.full_state_dict()
    losses = _train(engine, _batches(4), range(2, 4))
    out = {"loaded": loaded, "losses": losses, "final": engine.full_state_dict()}
    engine.close()
    return out


def _assert_resumed_exactly(first: dict) -> None:
    assert first["resumed"] == first["straight"] and first["global_step"] == 4
    assert first["final"].keys() == first["resumed final"].keys() == first["saved"].keys()
    for name, value in first["final"].items():
        assert torch.equal(value, first["resumed final"][name]), name


def test_pp2_checkpoint_resumes_exactly_and_loads_at_pp1_and_pp4(tmp_path):
    path = str(tmp_path / "ckpt")
    first, _ = run_distributed(_save_and_resume, 2, path)
    _assert_resumed_exactly(first)
    (one,) = run_distributed(_load_at, 1, path)
    # four stages of one layer each (world 4), every rank reading its layer's tensors and optimizer state
    four = run_distributed(_load_at, 4, path, 4)[0]
    for other in (one, four):
        assert other["loaded"].keys() == first["saved"].keys()
        for name, value in first["saved"].items():
            assert torch.equal(other["loaded"][name], value), name
        # the same training from there: the pipeline's summation order only
        for a, b in zip(other["losses"], first["straight"]):
            assert abs(a - b) <= 1e-5 * abs(b), (other["losses"], first["straight"])
        for name, value in first["final"].items():
            assert torch.allclose(other["final"][name], value, rtol=1e-4, atol=1e-6), name


def test_pp2_dp2_zero3_checkpoint_resumes_exactly(tmp_path):
    """At ZeRO-3 over each stage's two data-parallel ranks, each rank writes its shards of its stage's tensors."""
    first = run_distributed(_save_and_resume, 4, str(tmp_path / "ckpt"), 3)[0]
    _assert_resumed_exactly(first)
