"""Mixed precision: bf16/fp16 compute with fp32 masters under every ZeRO stage, and the loss scaler."""

import functools

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.errors import ConfigError, ShardtrainError
from shardtrain.precision.loss_scaler import LossScaler
from shardtrain.testing import run_distributed

from helpers.parity import VOCAB, Recipe, global_micro_batches, make_model, make_optimizer

RECIPE = Recipe(steps=10, gas=2, micro=2, clip=0.5, lr=3e-3)


def _zero(stage: int) -> dict:
    return {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}


@functools.cache
def bf16_reference(world: int) -> dict:
    """One process, same recipe: bf16 compute, fp32 masters made from the fp32 init, AdamW on the masters,
    gradients summed in fp32 over micro-steps, bf16 parameters refreshed from the masters."""
    model = make_model(RECIPE)
    opt = make_optimizer(model, RECIPE)
    params = [p for g in opt.param_groups for p in g["params"]]
    masters = {p: p.detach().clone() for p in params}
    for g in opt.param_groups:
        g["params"] = [masters[p] for p in g["params"]]
    model.to(torch.bfloat16)
    batches = global_micro_batches(RECIPE, world)
    losses, norms = [], []
    for step in range(RECIPE.steps):
        total = 0.0
        for m in range(RECIPE.gas):
            x, y = batches[step * RECIPE.gas + m]
            loss = model(x, y)
            (loss / RECIPE.gas).backward()
            for p in params:
                masters[p].grad = p.grad.float() + (masters[p].grad if masters[p].grad is not None else 0)
                p.grad = None
            total += loss.item() / RECIPE.gas
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(masters.values()), RECIPE.clip)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in params:
                p.copy_(masters[p])
        losses.append(total)
    return {"losses": losses, "norms": norms, "params": {n: p.detach().float() for n, p in model.named_parameters()}}


def _bf16_run(stage: int, world: int, exact: bool = False) -> dict:
    rank = dist.get_rank()
    model = make_model(RECIPE)
    config = {
        "train_micro_batch_size_per_gpu": RECIPE.micro,
        "gradient_accumulation_steps": RECIPE.gas,
        "gradient_clipping": RECIPE.clip,
        "bf16": {"enabled": True},
        "zero_optimization": _zero(stage),
    }
    if exact:  # shardtrain's exact choice, by name (DeepSpeed's default is the compute dtype for both)
        config |= {"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}}
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, RECIPE))
    dtypes = {p.dtype for p in model.parameters()} | {
        p.dtype for g in engine.optimizer.param_groups for p in g["params"]
    }
    batches = global_micro_batches(RECIPE, world)
    lo, hi = rank * RECIPE.micro, (rank + 1) * RECIPE.micro
    losses, norms = [], []
    for step in range(RECIPE.steps):
        total = 0.0
        for m in range(RECIPE.gas):
            x, y = batches[step * RECIPE.gas + m]
            loss = engine(x[lo:hi], y[lo:hi])
            engine.backward(loss)
            engine.step()
            total += loss.item() / RECIPE.gas
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    full = engine.full_state_dict()
    params = {n: v.float() for n, v in full.items()} if full is not None else None
    return {"losses": losses, "norms": norms, "params": params, "dtypes": dtypes, "state": engine.state_bytes()}


BF16_CASES = [(stage, world, False) for stage in range(4) for world in (1, 2, 3)]
BF16_CASES += [(1, 3, True), (3, 2, True)]  # fp32 reduction and accumulation, by name


@pytest.mark.parametrize(("stage", "world", "exact"), BF16_CASES)
def test_bf16_parity(stage, world, exact):
    """DeepSpeed's defaults (bf16 reduction and accumulation) and the exact choice, against one process that sums
    in fp32."""
    ref = bf16_reference(world)
    results = run_distributed(_bf16_run, world, stage, world, exact)
    assert results[0]["dtypes"] == {torch.bfloat16, torch.float32}  # bf16 model, fp32 masters
    for s in range(RECIPE.steps):
        loss = sum(r["losses"][s] for r in results) / world
        assert abs(loss - ref["losses"][s]) <= 1e-3 * ref["losses"][s], (s, loss, ref["losses"][s])
        # bf16 gradients: a few parts in a thousand apart; a sum instead of a mean would be off by the world size
        norm = results[0]["norms"][s]
        assert abs(norm - ref["norms"][s]) <= 2e-2 * ref["norms"][s], (s, norm, ref["norms"][s])
    # final bf16 parameters: Adam turns bf16 rounding of near-zero gradients (attention key biases) into whole
    # steps element by element, so the bound is on the total: far closer to the reference than it moved
    init = make_model(RECIPE).state_dict()
    err = sum((results[0]["params"][n] - want).abs().sum().item() for n, want in ref["params"].items())
    moved = sum((want - init[n].to(torch.bfloat16).float()).abs().sum().item() for n, want in ref["params"].items())
    assert err <= 0.1 * moved, (err, moved)


def test_bf16_state_bytes_follow_the_formulas():
    n_tensors = len([p for p in make_model(RECIPE).parameters() if p.requires_grad])
    for stage in (1, 2, 3):
        state = run_distributed(_bf16_run, 2, stage, 2)[0]["state"]
        p = state["params"]  # bf16 bytes this rank holds: 2 per parameter (stages 1-2) or 2/N (stage 3)
        n = p // 2 if stage < 3 else p  # elements (padded) of the whole model
        half = n // 2  # this rank's share at world 2
        optimizer = state["optimizer"] - 4 * n_tensors  # minus AdamW's scalar 'step' per parameter tensor
        assert optimizer == 12 * half  # fp32 master + two fp32 moments of this rank's half
        expected_grads = {1: 2 * n, 2: 2 * half, 3: 2 * half}[stage]  # bf16 accumulation: full, or shard
        assert state["grads"] == expected_grads, stage
        exact = run_distributed(_bf16_run, 2, stage, 2, True)[0]["state"]  # data_types.grad_accum_dtype "fp32"
        assert exact["grads"] == 2 * expected_grads, stage


PLANT_STEP = 2


def _fp16_overflow(stage: int, min_scale_case: bool = False, fused: bool = False) -> dict:
    """``fused``: torch's fused AdamW, which skips in its own kernel: the overflow is decided on the device and
    learned by the host at the next read (see [Note: an overflow learned a step later])."""
    rank = dist.get_rank()
    recipe = Recipe(steps=9, gas=1, micro=2)
    model = make_model(recipe)
    fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 1}
    if min_scale_case:
        fp16 = {"enabled": True, "initial_scale_power": 0, "min_loss_scale": 1, "hysteresis": 1}
    config = {"train_micro_batch_size_per_gpu": 2, "fp16": fp16, "zero_optimization": _zero(stage)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, fused=True) if fused else None
    engine = shardtrain.initialize(model, config=config, optimizer=optimizer or make_optimizer(model, recipe))
    plant = {"on": False}
    target = model.blocks[0].mlp[0].weight

    def poison(grad):  # an inf in one element of one rank's gradient
        if plant["on"] and rank == 1:
            grad = grad.clone()
            grad.view(-1)[3] = float("inf")
        return grad

    target.register_hook(poison)
    batches = global_micro_batches(recipe, dist.get_world_size())
    out = {"scales": [], "skipped": [], "losses": []}
    for step in range(recipe.steps):
        x, y = batches[step]
        x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
        plant["on"] = step == PLANT_STEP
        if step == PLANT_STEP:
            out["before"] = engine.full_state_dict()
            out["masters_before"] = [t.clone() for g in engine.optimizer.param_groups for t in g["params"]]
            out["moments_before"] = [
                v.clone() for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v)
            ]
        loss = engine(x, y)
        try:
            engine.backward(loss)
            engine.step()
            skipped = engine.skipped_steps  # a device-decided overflow at the minimum scale raises here
        except ShardtrainError as err:
            out["error"] = str(err)
            return out
        if step == PLANT_STEP:
            out["after"] = engine.full_state_dict()
            out["masters_after"] = [t.clone() for g in engine.optimizer.param_groups for t in g["params"]]
            out["moments_after"] = [
                v.clone() for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v)
            ]
            out["lr_after"] = engine.get_lr()
        out["scales"].append(engine.loss_scale)
        out["skipped"].append(skipped)
        out["losses"].append(loss.item())
    out["norms_finite"] = engine.get_global_grad_norm() is not None
    return out


OVERFLOW_CASES = [(0, 2, False), (1, 3, False), (2, 2, False), (3, 3, False), (1, 2, True), (3, 3, True)]


@pytest.mark.parametrize(("stage", "world", "fused"), OVERFLOW_CASES)
def test_fp16_overflow_skips_the_step_on_every_rank(stage, world, fused):
    results = run_distributed(_fp16_overflow, world, stage, False, fused)
    for r in results:
        # the step with the planted inf was skipped everywhere, and only that one
        assert r["skipped"] == [0, 0, 1, 1, 1, 1, 1, 1, 1]
        # dynamic scale: 256, halved by the overflow (hysteresis 1), doubled on the clean step that follows 3 clean
        # steps (DeepSpeed's DynamicLossScaler gives the same sequence)
        assert r["scales"] == [256, 256, 128, 128, 128, 128, 256, 256, 256]
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        for a, b in zip(r["masters_before"], r["masters_after"]):
            assert torch.equal(a, b)  # fp32 masters bitwise unchanged across the skip
        for a, b in zip(r["moments_before"], r["moments_after"]):
            assert torch.equal(a, b)  # optimizer state too
    before, after = results[0]["before"], results[0]["after"]
    for k in before:
        assert torch.equal(before[k], after[k]), k  # fp16 parameters bitwise unchanged


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_overflow_at_minimum_scale_is_a_clear_error(fused):
    for r in run_distributed(_fp16_overflow, 2, 2, True, fused):
        assert "overflow even at the minimum loss scale (1)" in r["error"]


def test_dynamic_scaler_hysteresis_and_growth():
    s = LossScaler(initial_scale_power=4, window=2, hysteresis=2, min_scale=1)
    seq = []
    for overflow in [True, True, False, False, True, False, False, False]:
        s.update(overflow)
        seq.append(s.scale)
    # first overflow uses the allowance, second halves; the allowance is restored only by a growth, so the
    # overflow after 2 clean steps halves again; the clean step after 2 clean steps doubles (as DeepSpeed's
    # DynamicLossScaler does, checked in test_migrate_deepspeed_checkpoint.py)
    assert seq == [16, 8, 8, 8, 4, 4, 4, 8]
    static = LossScaler(static_scale=128.0)
    static.update(True)
    assert static.scale == 128.0 and not static.dynamic


def test_precision_config_errors():
    from shardtrain.config.sections import inspect_config, load_config
    from shardtrain.errors import ConfigError

    cases = {
        "both": ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "enable one of them"),
        "comm without mp": ({"communication_data_type": "bf16"}, "applies to mixed precision only"),
        "comm mismatch": ({"fp16": {"enabled": True}, "communication_data_type": "bf16"}, "use 'fp32'"),
    }
    keys = {
        "both": "config",
        "comm without mp": "config",
        "comm mismatch": "config",
    }
    for name, (config, message) in cases.items():
        with pytest.raises(ConfigError, match=message) as err:
            load_config(config)
        assert keys[name] in str(err.value), (name, str(err.value))
    # loss-scale keys in a bf16 section: DeepSpeed ignores them, so they are accepted and reported without effect
    report = inspect_config({"bf16": {"enabled": True, "loss_scale": 128}})
    assert report.ok and [n for n in report.no_effect if n.startswith("bf16.loss_scale: ")], report.no_effect


def _bf16_comm_dtype() -> dict:
    model = make_model(Recipe())
    config = {"bf16": {"enabled": True}, "communication_data_type": "bf16", "zero_optimization": {"stage": 2}}
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, Recipe()))
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.comm_stats(reset=True)
    engine.backward(engine(x, x))
    engine.step()
    return engine.comm_stats()


def test_communication_data_type_halves_reduction_bytes():
    bf16_wire = run_distributed(_bf16_comm_dtype, 2)[0]["reduce_scatter"]["bytes"]
    n = sum(p.numel() for p in make_model(Recipe()).parameters())
    assert n - 2 <= bf16_wire <= n + 64  # 2 bytes x n x (N-1)/N with N = 2 (+ padding)


def _low_precision_model(stage: int, dtype: str, precision: str | None) -> dict:
    """A model cast to ``dtype`` before initialize, with or without a mixed-precision config."""
    model = make_model(Recipe()).to(getattr(torch, dtype))
    before = {k: (v.clone(), v.dtype) for k, v in model.state_dict().items()}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": _zero(stage)}
    if precision:
        config[precision] = {"enabled": True}
    try:
        engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, Recipe()))
    except ConfigError as err:
        after = model.state_dict()
        untouched = all(torch.equal(v, after[k]) and after[k].dtype == d for k, (v, d) in before.items())
        hooks = any(p._backward_hooks or p._post_accumulate_grad_hooks for p in model.parameters())
        return {"error": str(err), "untouched": untouched and not hooks}
    x = torch.randint(0, VOCAB, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    state = engine.full_state_dict()
    moved = state is None or not torch.equal(state["head.weight"], before["head.weight"][0])
    stepped = {t.dtype for g in engine.optimizer.param_groups for t in g["params"]}
    return {"moved": moved, "stepped": stepped}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("dtype", "precision"), [("bfloat16", None), ("float16", None), ("float16", "bf16")])
def test_low_precision_parameters_without_matching_config_are_refused(stage, dtype, precision):
    """A bf16/fp16 model must not train silently (a no-op step) or without fp32 masters: refused at
    initialize, naming the parameters, their dtype and the key to set, with the model untouched."""
    r = run_distributed(_low_precision_model, 1, stage, dtype, precision)[0]
    assert "error" in r, r
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    assert f"torch.{dtype}" in r["error"] and "tok.weight" in r["error"]
    if precision is None:
        assert f'"{short}": {{"enabled": true}}' in r["error"]
    assert "fp32 master" in r["error"]
    assert r["untouched"]


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_model_with_bf16_config_trains_with_fp32_masters(stage):
    r = run_distributed(_low_precision_model, 1, stage, "bfloat16", "bf16")[0]
    assert r == {"moved": True, "stepped": {torch.float32}}
