"""bf16 and fp16 with tensor parallelism inside each pipeline stage (pp 2 x tp 2, world 4) against one process: bf16
against one process's bf16 training (bf16 compute, fp32 masters), fp16 against one process's fp16 engine with the
same dynamic loss scaler (the same overflows and scale after every step), as tests/pipeline_parallel/
test_pipeline_bf16.py and test_pipeline_fp16.py do at pp 2 alone."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.tensor_parallel import GPT_TP_PLAN
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import train_one_process_bf16
from test_pipeline_fp16 import FP16
from test_pipeline_fp16 import STEPS as FP16_STEPS
from test_pipeline_fp16 import _batches as fp16_batches
from test_pipeline_fp16 import _run as fp16_one_process

from helpers.pipeline import CLIP, GAS, MICRO, STEPS, global_batches, make_model, make_optimizer


def _config(stage: int, precision: dict) -> dict:
    return {
        "pipeline_parallel_size": 2,
        "tensor_parallel": {"size": 2},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **precision,
    }


def _run(stage: int, precision: dict, batches: list, steps: int) -> dict:
    model = make_model("gpt")
    engine = shardtrain.initialize(
        model, _config(stage, precision), optimizer=make_optimizer(model), tp_plan=GPT_TP_PLAN
    )
    t = engine.topology
    assert (t.pp, t.tp, t.dp) == (2, 2, 1)
    dtypes = {p.dtype for p in engine.module.parameters()}
    losses, norms, scales, skipped = [], [], [], []
    for step in range(steps):
        losses.append(float(engine.train_batch(iter(batches[step * GAS : (step + 1) * GAS]))))
        norms.append(engine.get_global_grad_norm())
        scales.append(engine.scaler.scale if engine.scaler is not None else None)
        skipped.append(engine.skipped_steps)
    full = engine.full_state_dict()
    params = {n: v.float() for n, v in full.items()} if full is not None else None
    engine.close()
    return {"losses": losses, "norms": norms, "scales": scales, "skipped": skipped, "params": params, "dtypes": dtypes}


@pytest.mark.soak
@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_pp2_tp2_matches_one_process(stage):
    model = make_model("gpt")
    batches = global_batches("gpt", 1)
    ref = train_one_process_bf16(model, make_optimizer(model), lambda m, i: m(*batches[i]), STEPS, GAS, CLIP)
    results = run_distributed(_run, 4, stage, {"bf16": {"enabled": True}}, batches, STEPS)
    assert all(r["dtypes"] == {torch.bfloat16} for r in results)  # every stage's tp block computes in bf16
    for s in range(STEPS):
        for r in results:  # the same loss and norm on every rank
            assert abs(r["losses"][s] - ref["losses"][s]) <= 1e-3 * ref["losses"][s], (s, r["losses"], ref["losses"])
            assert abs(r["norms"][s] - ref["norms"][s]) <= 2e-2 * ref["norms"][s], (s, r["norms"], ref["norms"])
    # final bf16 parameters, the tp blocks joined: closer to the reference than it moved ([Note: parity bounds])
    init, final = ref["init"], {n: v.float() for n, v in ref["params"].items()}
    got = results[0]["params"]
    assert got.keys() == final.keys()
    err = sum((got[n] - want).abs().sum().item() for n, want in final.items())
    moved = sum((want - init[n].to(torch.bfloat16).float()).abs().sum().item() for n, want in final.items())
    assert err <= 0.1 * moved, (err, moved)


@pytest.mark.soak
def test_fp16_pp2_tp2_matches_one_process_with_the_same_scaler():
    (one,) = run_distributed(fp16_one_process, 1, 1, 1)
    results = run_distributed(_run, 4, 1, {"fp16": FP16}, fp16_batches(), FP16_STEPS)
    assert one["skipped"][-1] >= 1, one  # the run overflows, and recovers
    for r in results:
        # the same overflows on every rank (each sees the others' through the norm), so the same scale
        assert r["scales"] == one["scales"] and r["skipped"] == one["skipped"], (r, one)
        for a, b in zip(r["losses"], one["losses"]):
            assert abs(a - b) <= 2e-3 * abs(b), (r["losses"], one["losses"])
    got, want = results[0]["params"], one["params"]
    assert got.keys() == want.keys()
    err = sum((got[n].float() - v.float()).abs().sum().item() for n, v in want.items())
    size = sum(v.float().abs().sum().item() for v in want.values())
    assert err <= 2e-3 * size, (err, size)
