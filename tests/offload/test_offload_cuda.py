"""Optimizer offload on CUDA: with ``device: cpu`` (and ``nvme``) the fp32 masters and the optimizer state live in
host memory, the step runs on the CPU and the updated values are copied back into the GPU fragments. The numbers
match training without offload on the GPU within rounding (CPU and GPU kernels differ). Skipped without CUDA;
the CPU-only behaviour of ``device: cpu`` is tested in test_offload.py."""

from __future__ import annotations

import pytest
import torch

import shardtrain
from shardtrain.distributed.mesh import ensure_process_group
from shardtrain.testing import run_distributed

from helpers.parity import Recipe, global_micro_batches, make_model, make_optimizer

pytestmark = pytest.mark.gpu  # host offload of GPU training


def _train_on_cuda(zero_extra: dict | None, precision: str, optimizer: str = "adamw") -> dict:
    ensure_process_group(300.0)
    recipe = Recipe(steps=3, optimizer=optimizer)
    model = make_model(recipe)
    initial = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
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
    on_host = [t for t in opt.stepped_tensors() if t.device.type == "cpu" and t.numel()]
    pinned = all(t.is_pinned() for t in on_host) if on_host else None
    blocks = len({t.untyped_storage().data_ptr() for t in on_host})  # allocations the host masters live in
    copies = opt.offload.copies if opt.offload is not None else None

    def host_buffers() -> list[int]:
        return [g.data_ptr() for g in copies.grads if g.numel()] + [s.data_ptr() for s in copies.sources.values()]

    buffers = host_buffers() if copies is not None else []
    losses = []
    for step in range(recipe.steps):
        x, y = global_micro_batches(recipe, 1)[step]
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    reused = copies is not None and host_buffers() == buffers
    copy_blocks = copies.grad_arena.blocks + copies.back_arena.blocks if copies is not None else []
    copies_pinned = copies is not None and all(b.is_pinned() for b in copy_blocks)
    state_devices = {v.device.type for st in opt.optimizer.state.values() for v in st.values() if v.dim() > 0}
    params = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {
        "losses": losses,
        "stepped": stepped_devices,
        "state": state_devices,
        "params": params,
        "initial": initial,
        "pinned": pinned,
        "blocks": blocks,
        "host_masters": len(on_host),
        "copies": copies is not None,
        "reused": reused,
        "copies_pinned": copies_pinned,
    }


def _assert_close_relative_to_training(offloaded: dict, on_gpu: dict, bound: float) -> None:
    """Per tensor: the two runs differ by at most ``bound`` times the distance training moved the tensor (an
    absolute tolerance can exceed what a few steps move, and then passes even if the host step did nothing)."""
    moved_any = False
    for k, v in on_gpu["params"].items():
        moved = (v - on_gpu["initial"][k]).norm()
        if moved == 0:  # not trained (a buffer, a frozen weight): equal
            assert torch.equal(offloaded["params"][k], v), k
            continue
        moved_any = True
        diff = (offloaded["params"][k] - v).norm()
        assert diff <= bound * moved, f"{k}: differs by {diff:.3g}, training moved it by {moved:.3g}"
    assert moved_any


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
    # pin_memory: page-locked host masters, in one block (one sub-group of < 256 MiB), not one per fragment
    assert offloaded["pinned"] is True and offloaded["blocks"] == 1 < offloaded["host_masters"]
    # the overlapped copies ([Note: overlapped offload]): page-locked host buffers, the same ones every step
    assert offloaded["copies"] and offloaded["reused"] and offloaded["copies_pinned"]
    # the same forward and backward on the GPU; only the fp32 optimizer step runs on the CPU instead (rounding)
    for a, b in zip(offloaded["losses"], on_gpu["losses"]):
        assert abs(a - b) <= 1e-3 * abs(b)
    _assert_close_relative_to_training(offloaded, on_gpu, 1e-4 if precision == "fp32" else 1e-2)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_adagrad_state_made_at_construction_moves_to_the_host(device, tmp_path):
    """Adagrad makes ``sum`` at construction, on the GPU where the parameter is; with offload it must follow the
    host master (the first CPU step failed with a device mismatch, the nvme path on ``.numpy()`` of a CUDA tensor).
    The device-independent part is tested on CPU in test_offload.py."""
    offload = {"device": device} if device == "cpu" else {"device": "nvme", "nvme_path": str(tmp_path)}
    on_gpu = run_distributed(_train_on_cuda, 1, None, "bf16", "adagrad", init_process_group=False, timeout=300)[0]
    offloaded = run_distributed(
        _train_on_cuda, 1, {"offload_optimizer": offload}, "bf16", "adagrad", init_process_group=False, timeout=300
    )[0]
    assert offloaded["stepped"] == {"cpu"} and offloaded["state"] <= {"cpu"}
    _assert_close_relative_to_training(offloaded, on_gpu, 1e-2)


def test_cpu_offload_ratio_steps_the_first_sub_groups_on_the_host_and_the_rest_on_the_gpu():
    """``offload_optimizer: {device: cpu, ratio: 0.5}`` (DeepSpeed's partial offload): the first sub-groups holding
    half the elements have host masters and state and step on the CPU, the others stay on the GPU."""
    on_gpu = run_distributed(_train_on_cuda, 1, None, "bf16", init_process_group=False, timeout=300)[0]
    half = {"sub_group_size": 2000, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}
    partial = run_distributed(_train_on_cuda, 1, half, "bf16", init_process_group=False, timeout=300)[0]
    assert partial["stepped"] == {"cpu", "cuda"} and partial["state"] == {"cpu", "cuda"}
    _assert_close_relative_to_training(partial, on_gpu, 1e-2)


def test_host_blocks_are_page_locked_at_their_exact_size_outside_the_caching_allocator():
    """A host block is registered with CUDA at its size: CUDA's caching host allocator (which would round these
    bytes up to 2**25 and keep them) does not hold it; non-blocking copies into it complete on their event."""
    from shardtrain.offload.host_copies import host_block

    def cached() -> int:
        stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        return stats.get("reserved_bytes.all.current", stats.get("allocated_bytes.all.current", 0))

    n = (1 << 24) + 4096
    before = cached()
    block = host_block(n, pin=True)
    assert block.is_pinned() and block.numel() == n
    assert cached() == before
    values = torch.randn(n // 4, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block.view(torch.float32).copy_(values, non_blocking=True)
    event = stream.record_event()
    event.synchronize()
    assert torch.equal(block.view(torch.float32), values.cpu())
