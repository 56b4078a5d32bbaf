"""fp16 under pipeline parallelism against one process's fp16 training with the same dynamic loss scaler: the
schedule's losses scaled as ``engine.backward`` scales a loss ([Note: fp16's loss scale in the schedule] in
pipeline_parallel/schedule.py), the overflowing steps skipped on every stage, the same scale after every step."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.testing import run_distributed

from helpers.pipeline import CLIP, GAS, MICRO, global_batches, make_model, make_optimizer

STEPS = 6
# 2**18 overflows fp16's 65504 in the first steps' gradients; a window of 2 grows it back within the run
FP16 = {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 2, "hysteresis": 1, "min_loss_scale": 1}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return (global_batches("gpt", 1) * 2)[: STEPS * GAS]


def _run(pp: int, stage: int) -> dict:
    model = make_model("gpt")
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "fp16": FP16,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if pp > 1:
        config["pipeline_parallel_size"] = pp
    engine = shardtrain.initialize(model, config, optimizer=make_optimizer(model))
    batches = _batches()
    losses, scales, skipped = [], [], []
    for step in range(STEPS):
        micro = batches[step * GAS : (step + 1) * GAS]
        if pp > 1:
            losses.append(float(engine.train_batch(iter(micro))))
        else:
            total = 0.0
            for x, y in micro:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                total += float(loss) / GAS
            losses.append(total)
        scales.append(engine.scaler.scale)
        skipped.append(engine.skipped_steps)
    out = {"losses": losses, "scales": scales, "skipped": skipped, "params": engine.full_state_dict()}
    engine.close()
    return out


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.soak)])
def test_fp16_pp2_matches_one_process_with_the_same_scaler(stage):
    (one,) = run_distributed(_run, 1, 1, stage)
    results = run_distributed(_run, 2, 2, stage)
    assert one["skipped"][-1] >= 1, one  # the run overflows, and recovers
    for r in results:
        # the same overflows on both stages (each sees the other's through the norm), so the same scale
        assert r["scales"] == one["scales"] and r["skipped"] == one["skipped"], (r, one)
        for a, b in zip(r["losses"], one["losses"]):
            assert abs(a - b) <= 2e-3 * abs(b), (r["losses"], one["losses"])
    got, want = results[0]["params"], one["params"]
    assert got.keys() == want.keys()
    err = sum((got[n].float() - v.float()).abs().sum().item() for n, v in want.items())
    size = sum(v.float().abs().sum().item() for v in want.values())
    assert err <= 2e-3 * size, (err, size)
