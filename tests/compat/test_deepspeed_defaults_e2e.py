"""A DeepSpeed config that leaves everything to the defaults trains here as it trains under real DeepSpeed (issue 54).

The config names only the micro-batch, the ZeRO stage and ``{"optimizer": {"type": "AdamW", "params": {"lr": ...}}}``
(``tests/helpers/ds_defaults.py``). Real DeepSpeed 0.19.8 (CPU accelerator, gloo, world 2) builds its FusedAdam from it
(the CPU build of the same class: its default ``weight_decay`` 0.0) and clips at its default 1.0; the loss is
multiplied so that every step's gradient norm is 50-70, and the clipping changes every update. The same loop under
``shardtrain.compat.deepspeed`` must give the same losses and the same consolidated parameters and Adam moments
(``deepspeed.utils.safe_get_full_*`` on both sides) at ZeRO 2 and 3. With shardtrain's defaults before issue 54
emulated on the shim's side only (``gradient_clipping: 0``, or ``weight_decay: 0.01``) the same comparison misses by
1e-3 on the losses and 5e-4 to 60x on the states (``-m soak`` checks that it does).

bf16: the same loop with a NaN planted in one element of ``fc.weight``'s gradient on the last rank at one step. Both
skip that step (``skipped_steps``, the fp32 masters bitwise unchanged across it) and go on to the same losses.

Default cost: two starts of two processes, about 20 s on 2 cores (most of it importing DeepSpeed); world 3 and the
emulated old defaults (about 45 s) under ``-m soak``. The first run on a machine also builds DeepSpeed's CPU FusedAdam
(about 100 s once per venv, cached in it by ``tests/conftest.py``, as ``test_migrate_deepspeed_optimizers.py`` does).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardtrain.testing import run_distributed

from helpers.ds import clear_stale_extension_builds
from helpers.ds_defaults import NAN_STEP, STEPS, train_each

DS, OURS = "deepspeed", "shardtrain.compat.deepspeed"
STAGES = [2, 3]

# [Note: DeepSpeed's CPU Adam rounds 1 - beta2 in float32]
# DeepSpeed's CPU Adam kernel (csrc/includes/cpu_adam.h, the FusedAdam of DS_ACCELERATOR=cpu) computes
# `float betta2_minus1 = 1 - _betta2` from beta2 = 0.999 as a float: 1 - 0.99900001 = 0.00099998713, 1.29e-5 below
# torch's 0.001. Every term of exp_avg_sq carries that factor, so DeepSpeed's exp_avg_sq is torch's times V_FACTOR
# (measured 1.3e-5 apart without it, 1.7e-6 with it), and its update's denominator sqrt(v) is 6.4e-6 smaller, which
# moves the parameters by up to 3.2e-6 (norm-relative) and the losses by 6e-7 in 5 steps. A rounding of the kernel,
# not a default: DeepSpeed's CUDA FusedAdam takes beta2 as a double. Tolerances: those measured bounds, 1.5-3x over.
V_FACTOR = (1 - float(np.float32(0.999))) / (1 - 0.999)
FP32_LOSS_RTOL = 1e-6  # measured 6.4e-7 (stage 2), 5.6e-7 (stage 3)
FP32_PARAM_RTOL = 1e-5  # norm-relative per tensor, as the two below; measured 3.2e-6
FP32_EXP_AVG_RTOL = 5e-6  # measured 1.8e-6: the gradients of parameters 3e-7 apart
FP32_EXP_AVG_SQ_RTOL = 5e-6  # after V_FACTOR: measured 1.7e-6; 1.3e-5 without it
# bf16: the two engines round the forward in different places (DeepSpeed's stage 2 and stage 3 differ from each other
# by 3e-4 at step 0); bf16's epsilon is 7.8e-3. Measured: 2.5e-3.
BF16_LOSS_RTOL = 1e-2


def _relative_gap(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.double() - theirs.double()).norm() / theirs.double().norm())


def _assert_states_agree(ours: dict, theirs: dict, where: str) -> None:
    for key, rtol, factor in (
        ("param", FP32_PARAM_RTOL, 1.0),
        ("exp_avg", FP32_EXP_AVG_RTOL, 1.0),
        ("exp_avg_sq", FP32_EXP_AVG_SQ_RTOL, V_FACTOR),  # [Note: DeepSpeed's CPU Adam rounds 1 - beta2 in float32]
    ):
        assert ours[key].keys() == theirs[key].keys(), f"{where} {key}: different parameters"
        assert theirs[key], f"{where}: DeepSpeed gave no {key}"
        # trained values, not initial ones: every moment is far from zero after the steps
        assert all(v.abs().max() > 1e-6 for v in theirs[key].values()), f"{where}: a {key} of DeepSpeed is zero"
        for name, value in theirs[key].items():
            gap = _relative_gap(ours[key][name] * factor, value)
            assert gap <= rtol, f"{where} {key} of {name}: {gap:.2e} apart (tolerance {rtol:.0e})"


def _train(world: int, dtype: str, shardtrain_extra: dict | None = None, nan_step: int | None = None) -> list[dict]:
    clear_stale_extension_builds()  # a FusedAdam build killed by an earlier run would make this one wait forever
    return run_distributed(train_each, world, STAGES, dtype, shardtrain_extra, nan_step, timeout=600)


@pytest.fixture(scope="module")
def fp32_runs() -> list[dict]:
    return _train(2, "fp32")


@pytest.fixture(scope="module")
def bf16_nan_runs() -> list[dict]:
    return _train(2, "bf16", nan_step=NAN_STEP)


@pytest.mark.parametrize("stage", STAGES)
def test_a_config_naming_only_lr_builds_deepspeeds_defaults(fp32_runs, stage):
    """Both sides clip at 1.0 from a config without ``gradient_clipping``, DeepSpeed with the FusedAdam its config
    builds (not a torch stand-in), and the gradient norm is above 1.0 at every step: the clipping acts."""
    for rank, result in enumerate(fp32_runs):
        ds, ours = result[DS][stage], result[OURS][stage]
        assert ds["optimizer"] == "FusedAdam", f"rank {rank}: DeepSpeed built {ds['optimizer']}"
        assert ds["clipping"] == ours["clipping"] == 1.0
        for side in (ds, ours):
            assert len(side["grad_norm"]) == STEPS and min(side["grad_norm"]) > 10.0, side["grad_norm"]
        assert ds["skipped"] == ours["skipped"] == [0] * STEPS


@pytest.mark.parametrize("stage", STAGES)
def test_a_config_naming_only_lr_trains_as_real_deepspeed(fp32_runs, stage):
    """Per-step global losses, then every trainable parameter's fp32 master, ``exp_avg`` and ``exp_avg_sq``, whole,
    after the last step: with clipping off or a weight decay of 0.01 these miss by 1e-3 and 5e-4 or more."""
    for rank, result in enumerate(fp32_runs):
        ds, ours = result[DS][stage], result[OURS][stage]
        where = f"rank {rank} stage {stage}"
        torch.testing.assert_close(
            torch.tensor(ours["loss"], dtype=torch.float64), torch.tensor(ds["loss"], dtype=torch.float64),
            rtol=FP32_LOSS_RTOL, atol=0, msg=lambda m, w=where: f"{w} losses: {m}",
        )  # fmt: skip
        torch.testing.assert_close(
            torch.tensor(ours["grad_norm"]), torch.tensor(ds["grad_norm"]), rtol=FP32_LOSS_RTOL * 10, atol=0
        )
        _assert_states_agree(ours["final"], ds["final"], where)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_nan_step_is_skipped_as_deepspeed_skips_it(bf16_nan_runs, stage):
    """The step with the planted NaN is skipped on every rank by both (the count after each step is
    ``[0, 0, 1, 1, 1]``), the fp32 masters and moments are bitwise the same before and after it, and the later
    losses are finite and agree within bf16's precision."""
    for rank, result in enumerate(bf16_nan_runs):
        ds, ours = result[DS][stage], result[OURS][stage]
        where = f"rank {rank} stage {stage}"
        expected = [int(step >= NAN_STEP) for step in range(STEPS)]
        assert ds["skipped"] == expected, f"{where}: real DeepSpeed skipped {ds['skipped']}"
        assert ours["skipped"] == expected, f"{where}: the shim skipped {ours['skipped']}"
        for name, side in (("DeepSpeed", ds), ("shim", ours)):
            for key in ("param", "exp_avg", "exp_avg_sq"):
                before, after = side["before_nan"][key], side["after_nan"][key]
                assert before.keys() == after.keys()
                changed = [n for n in before if not torch.equal(before[n], after[n])]
                assert not changed, f"{where}: {name}'s {key} of {changed} changed across the skipped step"
        assert all(np.isfinite(ours["loss"])), ours["loss"]
        # the norm reported for the skipped step is inf on both (the gradients' own norm is NaN: DeepSpeed reports
        # inf, and so does the engine, for the Trainer's grad_norm log); every other step's is finite on both
        assert ds["grad_norm"][NAN_STEP] == ours["grad_norm"][NAN_STEP] == float("inf")
        assert all(np.isfinite(side["grad_norm"][s]) for side in (ds, ours) for s in range(STEPS) if s != NAN_STEP)
        torch.testing.assert_close(
            torch.tensor(ours["loss"]), torch.tensor(ds["loss"]), rtol=BF16_LOSS_RTOL, atol=0,
            msg=lambda m, w=where: f"{w} bf16 losses: {m}",
        )  # fmt: skip


@pytest.mark.soak
@pytest.mark.parametrize(
    ("old_default", "extra"),
    [
        ("gradient_clipping 0 (no clipping)", {"gradient_clipping": 0}),
        ("AdamW weight_decay 0.01 (torch's)", {"optimizer": {"params": {"weight_decay": 0.01}}}),
    ],
)
def test_shardtrains_defaults_before_issue_54_fail_the_comparison(old_default, extra):
    """The comparison can tell: with one of the old defaults given on the shim's side only, the losses or the
    states miss by far more than the tolerances."""
    results = _train(2, "fp32", shardtrain_extra=extra)
    for stage in STAGES:
        ds, ours = results[0][DS][stage], results[0][OURS][stage]
        loss_gap = max(abs(a - b) / abs(b) for a, b in zip(ours["loss"], ds["loss"], strict=True))
        assert loss_gap > 100 * FP32_LOSS_RTOL, f"{old_default}, stage {stage}: losses only {loss_gap:.1e} apart"
        with pytest.raises(AssertionError, match="apart"):
            _assert_states_agree(ours["final"], ds["final"], f"stage {stage}")


@pytest.mark.soak
def test_a_config_naming_only_lr_trains_as_real_deepspeed_at_world_3():
    results = _train(3, "fp32")
    for rank, result in enumerate(results):
        for stage in STAGES:
            ds, ours = result[DS][stage], result[OURS][stage]
            torch.testing.assert_close(
                torch.tensor(ours["loss"], dtype=torch.float64), torch.tensor(ds["loss"], dtype=torch.float64),
                rtol=FP32_LOSS_RTOL, atol=0,
            )  # fmt: skip
            _assert_states_agree(ours["final"], ds["final"], f"world 3 rank {rank} stage {stage}")
