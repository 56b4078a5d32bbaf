"""Optimizer offload on CUDA: with ``device: cpu`` (and ``nvme``) the fp32 masters and the optimizer state live in
host memory, the step runs on the CPU and the updated values are copied back into the GPU fragments. The numbers
match training without offload on the GPU within rounding (CPU and GPU kernels differ). Skipped without CUDA;
the CPU-only behaviour of ``device: cpu`` is tested in test_offload.py."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.mesh import ensure_process_group
from shardtrain.testing import run_distributed

from parity import Recipe, global_micro_batches, make_model, make_optimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: host offload of GPU training")


def _train_on_cuda(zero_extra: dict | None, precision: str) -> dict:
    ensure_process_group(300.0)
    recipe = Recipe(steps=3)
    model = make_model(recipe)
    config = {
        "train_micro_batch_size_per_gpu": recipe.micro,
        "gradient_clipping": recipe.clip,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 2000, **(zero_extra or {})},
    }
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, recipe))
    opt = engine._optimizer
    stepped_devices = {t.device.type for t in opt.stepped_tensors()}
    losses = []
    for step in range(recipe.steps):
        x, y = global_micro_batches(recipe, 1)[step]
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state_devices = {v.device.type for st in opt.optimizer.state.values() for v in st.values() if v.dim() > 0}
    params = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "stepped": stepped_devices, "state": state_devices, "params": params}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_offload_steps_on_the_host_and_matches_gpu_training(precision, tmp_path):
    on_gpu = run_distributed(_train_on_cuda, 1, None, precision, init_process_group=False, timeout=300)[0]
    offloaded = run_distributed(
        _train_on_cuda,
        1,
        {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
        precision,
        init_process_group=False,
        timeout=300,
    )[0]
    assert on_gpu["stepped"] == {"cuda"} and offloaded["stepped"] == {"cpu"}
    assert offloaded["state"] == {"cpu"}
    tol = 1e-5 if precision == "fp32" else 2e-2
    for a, b in zip(offloaded["losses"], on_gpu["losses"]):
        assert abs(a - b) <= tol * abs(b)
    for k, v in on_gpu["params"].items():
        assert torch.allclose(offloaded["params"][k], v, rtol=tol, atol=tol), k
