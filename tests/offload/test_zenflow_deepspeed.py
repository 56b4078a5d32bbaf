"""Stall-free offload against DeepSpeed 0.19.8's own ZenFlow (CPU accelerator, its ZeRO-2 CPU offload with
ZenFlowCPUAdam, ``overlap_step`` false): the same config file, the same start, losses within the measured gap.
DeepSpeed's ZenFlow runs on the CPU but is not self-consistent there (the test says where), so the comparison is a
bound, not equality; the exact check of the rule is tests/offload/test_zenflow.py's one-process reference. A soak
test: DeepSpeed's CPU Adam is a C++ extension JIT-built on first use (about 100 s on 2 cores)."""

from __future__ import annotations

import os

import pytest
import torch

from shardtrain.testing import run_distributed

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere in this process

STEPS = 10
CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "zenflow": {
            "topk_ratio": 0.25,
            "update_interval": 2,
            "select_strategy": "step",
            "select_interval": 4,
            "full_warm_up_rounds": 0,
            "overlap_step": False,
        },
    },
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _train(engine, backward) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def deepspeed_run() -> tuple[list[float], dict[str, torch.Tensor]]:
    """DeepSpeed's losses, and its module's weights as ``initialize`` left them (see the test)."""
    import deepspeed

    model = _model()
    config = {**CONFIG, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    start = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return _train(engine, engine.backward), start


def shardtrain_losses(start: dict[str, torch.Tensor]) -> list[float]:
    import shardtrain

    model = _model()
    model.load_state_dict(start)
    engine = shardtrain.initialize(model, config=CONFIG)
    return _train(engine, engine.backward)


@pytest.mark.soak
def test_losses_equal_deepspeeds_zenflow():
    pytest.importorskip("deepspeed")
    from helpers.ds import clear_stale_extension_builds

    clear_stale_extension_builds()
    ((theirs, start),) = run_distributed(deepspeed_run, 1, timeout=600)
    # DeepSpeed 0.19.8's ZenFlow lays 2-D weights out column-major in its flat buffer (zenflow_utils'
    # _flatten_dense_tensors) and, on this path, views that buffer row-major: after initialize each matrix holds
    # W.t() read in W's shape. Its training from there is consistent, so ours starts from the same weights.
    model = _model()
    assert torch.equal(start["0.weight"], model[0].weight.detach().t().contiguous().view(32, 16))
    (ours,) = run_distributed(shardtrain_losses, 1, start)
    assert ours[0] == theirs[0]  # the same weights before the first update
    # Measured: the trajectories part from the first update on (step 1: 0.9947 here, 0.9882 DeepSpeed) and stay
    # within 3.2% over 10 steps. DeepSpeed's selected-column update reads the gradient through its transposed view
    # (stage_1_and_2's ZenFlow branch) while the weight it updates is the row-major view above, so its columns are
    # not the weight's columns and no exact comparison exists; the bound pins the measured gap.
    gap = max(abs(a - b) / b for a, b in zip(ours, theirs))
    assert gap < 0.05, (gap, ours, theirs)
