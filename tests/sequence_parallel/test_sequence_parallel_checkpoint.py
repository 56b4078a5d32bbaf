"""Checkpoints under sequence parallelism: the format does not know the sp axis, so a checkpoint saved at one
(sp, tp) layout loads at another and training goes on as if it had not stopped."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.testing import run_distributed
from test_sequence_parallel_tp import ROWS, batches, loss_of, model_of, optimizer_of, plan_of

from helpers.parity import assert_params_near

CASE = "gpt"  # 12 heads; under tensor parallelism its fused q/k/v is saved as strided blocks


def _engine(sp: int, tp: int, stage: int):
    model = model_of(CASE)
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "sequence_parallel_size": sp,
        "tensor_parallel": {"size": tp},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    return shardtrain.initialize(model, config=config, optimizer=optimizer_of(model), tp_plan=plan_of(CASE))


def save_then_train(sp: int, tp: int, stage: int, path: str) -> dict:
    """Train one step, save, train one more: the saved weights, the loss of the step after and the weights then."""
    engine = _engine(sp, tp, stage)
    data = batches(1)
    out = {}
    for step in range(2):
        if step == 1:
            engine.save_checkpoint(path)
            out["saved"] = engine.full_state_dict()
        loss = loss_of(CASE, engine, *data[step])
        engine.backward(loss)
        engine.step()
        out["next_loss"] = loss.item()
    out["after"] = engine.full_state_dict()
    return out


def load_then_train(sp: int, tp: int, stage: int, path: str) -> dict:
    engine = _engine(sp, tp, stage)
    engine.load_checkpoint(path)
    loaded = engine.full_state_dict()
    loss = loss_of(CASE, engine, *batches(1)[1])
    engine.backward(loss)
    engine.step()
    return {"loaded": loaded, "next_loss": loss.item(), "after": engine.full_state_dict(), "step": engine.global_step}


def check_resumes(tmp_path, saved_at: tuple[int, int, int], loaded_at: tuple[int, int, int]) -> None:
    """``(sp, tp, stage)`` of the saving and the loading run (one data-parallel rank each)."""
    path = str(tmp_path / "ckpt")
    sp, tp, stage = saved_at
    saved = run_distributed(save_then_train, sp * tp, sp, tp, stage, path, init_process_group=False)[0]
    sp, tp, stage = loaded_at
    loaded = run_distributed(load_then_train, sp * tp, sp, tp, stage, path, init_process_group=False)[0]
    assert loaded["step"] == 2
    assert loaded["loaded"].keys() == saved["saved"].keys()
    for k, v in saved["saved"].items():
        assert torch.equal(loaded["loaded"][k], v), k
    # the next step: Adam's moments and step count came back too (a restarted optimizer moves differently)
    assert abs(loaded["next_loss"] - saved["next_loss"]) <= 1e-5 * saved["next_loss"]
    assert_params_near(loaded["after"], saved["after"], saved["saved"], require_moved=True)


def test_saved_at_sp2_tp2_loads_into_one_process(tmp_path):
    """(sp 2, tp 2, ZeRO-3) -> one process (ZeRO-2): the sequence split gone, the tensor-parallel blocks joined."""
    check_resumes(tmp_path, (2, 2, 3), (1, 1, 2))


@pytest.mark.soak
@pytest.mark.parametrize(
    ("saved_at", "loaded_at"), [((2, 2, 3), (3, 1, 1)), ((3, 1, 3), (2, 2, 1)), ((2, 1, 2), (1, 2, 3))]
)
def test_sequence_and_tensor_layouts_change_across_a_checkpoint(tmp_path, saved_at, loaded_at):
    """From sp 2 x tp 2 to sp 3; from sp 3 to sp 2 x tp 2; from sp 2 to tp 2 without sequence parallelism."""
    check_resumes(tmp_path, saved_at, loaded_at)
