"""``optimizer.params.bias_correction: false``: DeepSpeed's fused Adam update, built as ``DeepSpeedAdam``.

The update is checked three ways: against FusedAdam's formula (DeepSpeed's ``multi_tensor_adam`` kernel and
``DeepSpeedCPUAdam`` compute the same one) written out element by element in float64; against torch's Adam and
AdamW, which it must equal when it does correct the bias; and, in the soak run, against DeepSpeed's own
``DeepSpeedCPUAdam`` (a C++ extension JIT-compiled on first use, minutes on a small machine). Then through a config
at ZeRO stages 2 and 3, odd world size included, with optimizer offload, against one process stepping the same
optimizer over the whole batch.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import shardtrain
from shardtrain.config.sections import load_config, optimizer_class_and_kwargs
from shardtrain.errors import ConfigError
from shardtrain.optim.adam import DeepSpeedAdam
from shardtrain.testing import run_distributed

from helpers.parity import Recipe, assert_parity, global_micro_batches, make_model, train_step

MODES = [(bc, w) for bc in (True, False) for w in (True, False)]
IDS = [f"bias_correction={bc}-adam_w_mode={w}" for bc, w in MODES]
HYPER = {"lr": 2e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}


def _fused_adam_formula(p, grads, lr, betas, eps, weight_decay, adam_w_mode, bias_correction):
    """FusedAdam's update (deepspeed/ops/csrc/adam/multi_tensor_adam.cu), one element-wise expression per line."""
    beta1, beta2 = betas
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        if not adam_w_mode:  # ADAM_MODE_0: L2 penalty added to the gradient
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        c1 = 1 - beta1**t if bias_correction else 1.0
        c2 = 1 - beta2**t if bias_correction else 1.0
        update = (m / c1) / (v.sqrt() / math.sqrt(c2) + eps)
        if adam_w_mode:  # ADAM_MODE_1: decoupled decay, added to the update
            update = update + weight_decay * p
        p = p - lr * update
    return p


def _gradients(shape, steps, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # scales spread over decades: eps matters for the small ones, the moments' bias for all
    scale = torch.logspace(-4, 1, shape[-1], dtype=torch.float64)
    return [(torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype) for _ in range(steps)]


def _stepped(cls, p0, grads, **kwargs):
    p = torch.nn.Parameter(p0.clone())
    opt = cls([p], **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


@pytest.mark.parametrize(("bias_correction", "adam_w_mode"), MODES, ids=IDS)
def test_update_is_fused_adams_formula(bias_correction, adam_w_mode):
    p0 = torch.randn(4, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = _gradients((4, 50), 6, torch.float64)
    want = _fused_adam_formula(p0, grads, adam_w_mode=adam_w_mode, bias_correction=bias_correction, **HYPER)
    got, opt = _stepped(DeepSpeedAdam, p0, grads, adam_w_mode=adam_w_mode, bias_correction=bias_correction, **HYPER)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)
    assert (got - p0).abs().max() > 3 * HYPER["lr"]  # six steps moved it: the comparison is not of p0 with itself
    # torch's Adam state layout, which ZeRO offload and checkpoints rely on
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["step"].dtype == torch.float32 and state["step"].device.type == "cpu" and float(state["step"]) == 6


def test_bias_correction_changes_the_update():
    p0 = torch.zeros(3, 8, dtype=torch.float64)
    grads = _gradients((3, 8), 1, torch.float64)
    with_bc, _ = _stepped(DeepSpeedAdam, p0, grads, bias_correction=True, **HYPER)
    without, _ = _stepped(DeepSpeedAdam, p0, grads, bias_correction=False, **HYPER)
    # first step: m / sqrt(v) is (1 - beta1) / sqrt(1 - beta2) = 0.2 / sqrt(0.05) times sign(g) without correction
    big = grads[0].abs() > 1e-2  # where eps is negligible
    ratio = (without / with_bc)[big]
    torch.testing.assert_close(ratio, torch.full_like(ratio, 0.2 / math.sqrt(0.05)), rtol=1e-3, atol=0)


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["AdamW", "Adam"])
def test_with_bias_correction_it_is_torchs_adam(adam_w_mode):
    p0 = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    grads = _gradients((4, 50), 6, torch.float32)
    want, _ = _stepped(torch.optim.AdamW if adam_w_mode else torch.optim.Adam, p0, grads, **HYPER)
    got, _ = _stepped(DeepSpeedAdam, p0, grads, adam_w_mode=adam_w_mode, **HYPER)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)


def test_state_dict_round_trip_resumes_the_same_update():
    p0 = torch.randn(5, 7, generator=torch.Generator().manual_seed(3))
    grads = _gradients((5, 7), 6, torch.float32)
    straight, _ = _stepped(DeepSpeedAdam, p0, grads, bias_correction=False, **HYPER)
    half, opt = _stepped(DeepSpeedAdam, p0, grads[:3], bias_correction=False, **HYPER)
    p = torch.nn.Parameter(half.clone())
    resumed = DeepSpeedAdam([p], bias_correction=True, **HYPER)  # the loaded groups bring bias_correction back
    resumed.load_state_dict(opt.state_dict())
    assert resumed.param_groups[0]["bias_correction"] is False
    for g in grads[3:]:
        p.grad = g.clone()
        resumed.step()
    torch.testing.assert_close(p.detach(), straight, rtol=0, atol=0)


def test_config_builds_it_in_deepspeeds_weight_decay_mode():
    def built(kind, **params):
        return optimizer_class_and_kwargs(load_config({"optimizer": {"type": kind, "params": params}}).optimizer)

    # DeepSpeed's fused Adam: weight_decay 0.0 when the config gives none
    no_decay = {"weight_decay": 0.0, "bias_correction": False, "adam_w_mode": True}
    assert built("Adam", bias_correction=False) == (DeepSpeedAdam, no_decay)
    assert built("Adam", bias_correction=False, adam_w_mode=False)[1]["adam_w_mode"] is False
    assert built("AdamW", bias_correction=False, adam_w_mode=False)[1]["adam_w_mode"] is True  # as in DeepSpeed
    assert built("AdamW", bias_correction=True) == (torch.optim.AdamW, {"weight_decay": 0.0})
    for params, fragment in (
        ({"bias_correction": "no"}, "optimizer.params.bias_correction: expected true or false, got 'no'"),
        ({"bias_correction": False, "amsgrad": True}, "optimizer.params.amsgrad"),  # FusedAdam refuses it too
        ({"bias_correction": False, "lr": -1.0}, "Invalid learning rate: -1.0"),
    ):
        with pytest.raises(ConfigError) as err:
            built("Adam", **params)
        assert fragment in str(err.value)
    with pytest.raises(ConfigError) as err:  # not an SGD argument (DeepSpeed's SGD would not take it either)
        built("SGD", lr=0.1, bias_correction=False)
    assert "optimizer.params.bias_correction" in str(err.value)


# -- through a config, with ZeRO -------------------------------------------------------------------------------------

RECIPE = Recipe(steps=4, gas=2, lr=1e-2)
ADAM = {"lr": RECIPE.lr, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.05, "bias_correction": False}


def _config(adam_w_mode: bool, zero: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": RECIPE.micro,
        "gradient_accumulation_steps": RECIPE.gas,
        "gradient_clipping": RECIPE.clip,
        "optimizer": {"type": "Adam", "params": {**ADAM, "adam_w_mode": adam_w_mode}},
        "zero_optimization": {"reduce_bucket_size": 2000, "allgather_bucket_size": 2000, **zero},
    }


def _engine_run(config: dict, world: int) -> dict:
    import torch.distributed as dist

    engine = shardtrain.initialize(make_model(RECIPE), config=config)
    assert type(engine.optimizer) is DeepSpeedAdam
    batches = global_micro_batches(RECIPE, world)
    losses, norms = [], []
    for step in range(RECIPE.steps):
        losses.append(train_step(engine, RECIPE, batches, step, dist.get_rank()))
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "params": engine.full_state_dict()}


def _reference(adam_w_mode: bool, world: int, dtype: torch.dtype) -> dict:
    """One process over the global batch, stepping the optimizer the config builds."""
    model = make_model(RECIPE).to(dtype)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cls, kwargs = optimizer_class_and_kwargs(load_config(_config(adam_w_mode, {})).optimizer)
    opt = cls(model.parameters(), **kwargs)
    batches = global_micro_batches(RECIPE, world)
    losses, norms = [], []
    for step in range(RECIPE.steps):
        total = 0.0
        for m in range(RECIPE.gas):
            x, y = batches[step * RECIPE.gas + m]
            loss = model(x, y)
            (loss / RECIPE.gas).backward()
            total += loss.item() / RECIPE.gas
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE.clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "params": model.state_dict(), "init": init}


def _check_parity(world: int, adam_w_mode: bool, zero: dict) -> None:
    results = run_distributed(_engine_run, world, _config(adam_w_mode, zero), world, timeout=240)
    ref = _reference(adam_w_mode, world, torch.float32)
    ref["exact"] = _reference(adam_w_mode, world, torch.float64)["params"]
    assert_parity(results, ref)


@pytest.mark.parametrize(
    ("world", "adam_w_mode", "zero"),
    [
        (3, True, {"stage": 2}),
        (2, False, {"stage": 3, "stage3_param_persistence_threshold": 0}),
    ],
    ids=["world3-stage2-AdamW", "world2-stage3-Adam"],
)
def test_zero_training_matches_one_process(world, adam_w_mode, zero):
    _check_parity(world, adam_w_mode, zero)


@pytest.mark.soak
@pytest.mark.parametrize(
    ("world", "adam_w_mode", "zero"),
    [
        (2, True, {"stage": 1}),
        (3, False, {"stage": 2}),
        (3, True, {"stage": 3, "stage3_param_persistence_threshold": 0}),
        (2, True, {"stage": 2, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 3000}),
        (3, False, {"stage": 3, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 3000}),
    ],
    ids=["world2-stage1", "world3-stage2-Adam", "world3-stage3", "world2-stage2-offload", "world3-stage3-offload"],
)
def test_zero_training_matches_one_process_wide(world, adam_w_mode, zero):
    _check_parity(world, adam_w_mode, zero)


def _exact_resume(root: str, stages: list[int], dtype: str) -> list[str]:
    """resume_helpers' save / fresh engine / load / continue check, its AdamW param groups (three learning rates,
    decay on matrices only) stepped by DeepSpeedAdam without bias correction."""
    from helpers import resume as resume_helpers

    torch_groups = resume_helpers.make_optimizer

    def make_optimizer(model, kind):
        if kind != "deepspeed_adam":
            return torch_groups(model, kind)
        groups = [
            {"params": g["params"], "lr": g["lr"], "weight_decay": g["weight_decay"]}
            for g in torch_groups(model, "adamw").param_groups
        ]
        return DeepSpeedAdam(groups, bias_correction=False)

    resume_helpers.make_optimizer = make_optimizer  # this rank's process only
    return resume_helpers.exact_resume(root, stages, ["deepspeed_adam"], dtype)


def test_checkpoint_resumes_bitwise(tmp_path):
    problems = run_distributed(_exact_resume, 3, str(tmp_path), [2, 3], "fp32", timeout=240)
    assert problems == [[], [], []]


@pytest.mark.soak
def test_checkpoint_resumes_bitwise_in_bf16(tmp_path):
    problems = run_distributed(_exact_resume, 2, str(tmp_path), [1, 3], "bf16", timeout=240)
    assert problems == [[], []]


# -- DeepSpeed's own kernel ------------------------------------------------------------------------------------------


def _deepspeed_cpu_adam():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as err:
        pytest.skip(f"deepspeed is not installed: {err}")
    return DeepSpeedCPUAdam


@pytest.mark.soak
@pytest.mark.parametrize(("bias_correction", "adam_w_mode"), MODES, ids=IDS)
def test_matches_deepspeed_cpu_adam(bias_correction, adam_w_mode):
    cpu_adam = _deepspeed_cpu_adam()
    p0 = torch.randn(4, 50, generator=torch.Generator().manual_seed(4))
    grads = _gradients((4, 50), 6, torch.float32)
    kwargs = dict(HYPER, bias_correction=bias_correction)
    want, _ = _stepped(cpu_adam, p0, grads, adamw_mode=adam_w_mode, **kwargs)
    got, _ = _stepped(DeepSpeedAdam, p0, grads, adam_w_mode=adam_w_mode, **kwargs)
    assert (want - p0).abs().max() > 3 * HYPER["lr"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
