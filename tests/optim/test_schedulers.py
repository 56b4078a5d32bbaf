"""Our DeepSpeed-named schedulers follow DeepSpeed's formulas: against the formulas DeepSpeed documents and, step by
step, against DeepSpeed's own classes (``deepspeed.runtime.lr_schedules``, a test-only dependency)."""

import math
import os

import pytest
import torch

from shardtrain.config.sections import SchedulerConfig
from shardtrain.optim.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: no GPU probing


def _opt():
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)


def _lrs(sched, n):
    out = []
    for _ in range(n):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.optimizer.step()
        sched.step()
    return out


def test_warmup_log_and_linear():
    # DeepSpeed's step k runs at its formula for k - 1 steps taken, and at warmup_min_lr when built: steps 0 and 1
    # both run at the minimum (log(0 + 1) = 0)
    log = _lrs(WarmupLR(_opt(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10), 13)
    assert log[:2] == [0.0, 0.0]
    assert log[4] == pytest.approx(math.log(4) / math.log(10))
    assert log[11:] == [1.0, 1.0]
    lin = _lrs(WarmupLR(_opt(), warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=4, warmup_type="linear"), 7)
    assert lin == pytest.approx([0.1, 0.1, 0.35, 0.6, 0.85, 1.1, 1.1])


def test_warmup_lr_defaults_to_the_optimizers_lr():
    assert _lrs(WarmupLR(_opt(), warmup_num_steps=2, warmup_type="linear"), 4) == [0.0, 0.0, 0.5, 1.0]


def test_warmup_decay_reaches_zero():
    lrs = _lrs(
        WarmupDecayLR(_opt(), total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=2, warmup_type="linear"), 13
    )
    assert lrs[:4] == pytest.approx([0.0, 0.0, 0.5, 1.0])
    assert lrs[7] == pytest.approx(0.5)  # (10 - 6) / (10 - 2)
    assert lrs[11:] == [0.0, 0.0]


def test_build_from_config():
    sched = build_scheduler(
        SchedulerConfig(type="WarmupDecayLR", params={"total_num_steps": 5, "warmup_num_steps": 1}), _opt()
    )
    assert isinstance(sched, WarmupDecayLR)
    assert sched.total_num_steps == 5


# -- WarmupCosineLR and OneCycle: every step's lr against DeepSpeed's documented formulas -----------------------------
# Written per optimizer step k (from 0), the form DeepSpeed's docs give: its schedulers step after each optimizer step
# from the lr they set when built, so step k runs at their formula for k - 1 steps taken (k = 0: the lr when built).


def _cosine_expected(k, base, total, warmup, min_ratio, cos_min, kind):
    if k == 0:
        return 0.0  # DeepSpeed's WarmupCosineLR sets lr 0 when built
    i, warmup = k - 1, max(2, warmup)
    if i < warmup:
        rise = math.log(i + 1) / math.log(warmup) if kind == "log" else i / warmup
        return base * (min_ratio + (1 - min_ratio) * rise)
    progress = min(1.0, (i - warmup + 1) / max(1, total - warmup))
    return base * max(0.0, cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress)))


def _steps(sched, n, key="lr"):
    out = []
    for _ in range(n):
        out.append(sched.optimizer.param_groups[0][key])
        sched.optimizer.step()
        sched.step()
    return out


@pytest.mark.parametrize(
    "params",
    [
        {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear", "cos_min_ratio": 0.1},
        {"total_num_steps": 10, "warmup_num_steps": 3, "warmup_min_ratio": 0.2, "cos_min_ratio": 0.0},
        {"total_num_steps": 3, "warmup_num_steps": 5, "warmup_type": "linear"},  # total inside the warm-up
        {"total_num_steps": 6, "warmup_num_steps": 1},  # log warm-up over one step: DeepSpeed makes it two
    ],
)
def test_warmup_cosine_lr_every_step(params):
    base = 0.4
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    lrs = _steps(WarmupCosineLR(opt, **params), 16)
    full = {"warmup_min_ratio": 0.0, "cos_min_ratio": 0.0001, "warmup_type": "log", **params}
    expected = [
        _cosine_expected(
            k, base, full["total_num_steps"], full["warmup_num_steps"], full["warmup_min_ratio"],
            full["cos_min_ratio"], full["warmup_type"],
        )
        for k in range(16)
    ]  # fmt: skip
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert lrs[0] == 0.0 and lrs[-1] == pytest.approx(base * full["cos_min_ratio"])  # flat at the end


def test_warmup_cosine_lr_scales_each_group_by_its_own_lr():
    a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.5}])
    sched = WarmupCosineLR(opt, total_num_steps=8, warmup_num_steps=2, warmup_type="linear")
    for _ in range(3):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([_cosine_expected(3, lr, 8, 2, 0, 1e-4, "linear")
                                                                  for lr in (1.0, 0.5)])  # fmt: skip


def _one_cycle_expected(k, p):
    """(lr, beta1) at optimizer step k from DeepSpeed's OneCycle docs: a triangle (in stairs), then decay."""
    first = p["cycle_first_step_size"]
    second = p.get("cycle_second_step_size") or first
    total = first + second
    lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
    mom_lo, mom_hi = p.get("cycle_min_mom", 0.8), p.get("cycle_max_mom", 0.9)
    if k == 0:
        return lo, mom_lo
    if k <= total:  # the k-th step of the cycle (k == total: back at the bottom)
        scale = k / first if k <= first else (total - k) / second
        stairs = p.get("cycle_first_stair_count", 0) if k <= first else p.get("cycle_second_stair_count", 0)
        if stairs:
            scale = math.floor(scale * stairs) / stairs
        return lo + (hi - lo) * scale, mom_hi - (mom_hi - mom_lo) * scale
    n = (k - total) / p["decay_step_size"] if p.get("decay_step_size") else 0.0
    return lo / (1 + p.get("decay_lr_rate", 0.0) * n), mom_hi * (1 + p.get("decay_mom_rate", 0.0) * n)


@pytest.mark.parametrize(
    "params",
    [
        {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4},
        {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3, "cycle_second_step_size": 5},
        {
            "cycle_min_lr": 0.02, "cycle_max_lr": 0.2, "cycle_first_step_size": 6, "cycle_second_step_size": 4,
            "cycle_first_stair_count": 3, "cycle_second_stair_count": 2,
        },
        {
            "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2, "decay_step_size": 2,
            "decay_lr_rate": 0.5, "decay_mom_rate": 0.01, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
        },
    ],
)  # fmt: skip
def test_one_cycle_lr_and_momentum_every_step(params):
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0, betas=(0.9, 0.999))
    sched = OneCycle(opt, **params)
    got = []
    for _ in range(16):
        got.append((opt.param_groups[0]["lr"], *opt.param_groups[0]["betas"]))
        opt.step()
        sched.step()
    for k, (lr, beta1, beta2) in enumerate(got):
        want_lr, want_beta1 = _one_cycle_expected(k, params)
        assert lr == pytest.approx(want_lr, rel=1e-12), f"step {k}"
        assert beta1 == pytest.approx(want_beta1, rel=1e-12), f"step {k}"
        assert beta2 == 0.99  # DeepSpeed sets beta2 to 0.99 while it cycles beta1


def test_one_cycle_leaves_momentum_of_optimizers_without_betas(caplog):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0, momentum=0.5)
    params = {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 2}
    with caplog.at_level("WARNING", logger="shardtrain"):
        lrs = _steps(OneCycle(opt, **params), 6)
    assert "cycle_momentum is off" in caplog.text
    assert lrs == pytest.approx([_one_cycle_expected(k, params)[0] for k in range(6)])
    assert opt.param_groups[0]["momentum"] == 0.5 and "betas" not in opt.param_groups[0]


def test_deepspeed_schedulers_resume_from_their_state_dict():
    def fresh(kind):
        opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.3)
        if kind == "cos":
            return WarmupCosineLR(opt, total_num_steps=9, warmup_num_steps=3)
        return OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.3, cycle_first_step_size=3)

    for kind in ("cos", "one_cycle"):
        whole = _steps(fresh(kind), 8)
        first = fresh(kind)
        _steps(first, 4)
        resumed = fresh(kind)
        resumed.load_state_dict(first.state_dict())
        resumed.optimizer.load_state_dict(first.optimizer.state_dict())
        assert whole[4:] == pytest.approx(_steps(resumed, 4)), kind


def test_build_deepspeed_schedulers_from_config():
    cos = build_scheduler(SchedulerConfig(type="WarmupCosineLR", params={"total_num_steps": 5}), _opt())
    cycle = build_scheduler(SchedulerConfig(type="OneCycle", params={"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}), _opt())
    assert isinstance(cos, WarmupCosineLR) and cos.total_num_steps == 5 and cos.cos_min_ratio == 0.0001
    assert isinstance(cycle, OneCycle) and cycle.first_step_size == cycle.second_step_size == 2000


# -- every scheduler against DeepSpeed's own class, step by step -----------------------------------------------------
# Both drive an optimizer the same way an engine does: the lr in the param groups is the lr of the next step, the
# scheduler steps once after each optimizer step. 60 steps cover warm-up, decay, the cycle and the decay after it.

_DEEPSPEED_CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.2, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 1, "warmup_type": "linear"}),  # max: the optimizer's lr; 1 step made 2
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_min_lr": 0.001, "warmup_max_lr": 0.1, "warmup_num_steps": 8}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 4, "warmup_num_steps": 6, "warmup_max_lr": 0.05}),  # total < warm-up
    ("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 8, "warmup_min_ratio": 0.1}),
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 5, "warmup_type": "linear", "cos_min_ratio": 0.0}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10}),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.02, "cycle_max_lr": 0.2, "cycle_first_step_size": 9, "cycle_second_step_size": 6,
            "cycle_first_stair_count": 3, "cycle_second_stair_count": 2, "decay_step_size": 4,
            "decay_lr_rate": 0.3, "decay_mom_rate": 0.02, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
        },
    ),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 7, "lr_range_test_step_rate": 0.5}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 5, "lr_range_test_staircase": True}),
]  # fmt: skip
_IDS = [f"{kind}-{i}" for i, (kind, _) in enumerate(_DEEPSPEED_CASES)]


def _two_group_adam(lr: float = 0.3) -> torch.optim.Optimizer:
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    return torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": lr / 2}], lr=lr, betas=(0.9, 0.999))


def _trace(opt: torch.optim.Optimizer, sched, steps: int) -> list[list[float]]:
    """lr, beta1, beta2 of every param group before each optimizer step."""
    out = []
    for _ in range(steps):
        out.append([x for g in opt.param_groups for x in (g["lr"], *g["betas"])])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize(("kind", "params"), _DEEPSPEED_CASES, ids=_IDS)
def test_every_step_equals_deepspeeds_scheduler(kind, params):
    from deepspeed.runtime import lr_schedules

    ours_opt, theirs_opt = _two_group_adam(), _two_group_adam()
    ours = build_scheduler(SchedulerConfig(type=kind, params=params), ours_opt)
    theirs = getattr(lr_schedules, kind)(theirs_opt, **params)
    got, want = _trace(ours_opt, ours, 60), _trace(theirs_opt, theirs, 60)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == pytest.approx(w, rel=1e-14, abs=1e-300), f"step {step}: ours {g}, DeepSpeed's {w}"
    assert ours.last_batch_iteration == theirs.last_batch_iteration == 59


@pytest.mark.parametrize(("kind", "params"), _DEEPSPEED_CASES, ids=_IDS)
def test_resume_from_deepspeeds_state_dict(kind, params):
    """A DeepSpeed checkpoint's scheduler state (``{'last_batch_iteration': k}``) loaded into ours, on a fresh
    optimizer, continues as DeepSpeed's scheduler does after its optimizer state was restored."""
    from deepspeed.runtime import lr_schedules

    theirs_opt = _two_group_adam()
    theirs = getattr(lr_schedules, kind)(theirs_opt, **params)
    _trace(theirs_opt, theirs, 17)
    saved = theirs.state_dict()
    assert saved == {"last_batch_iteration": 16}
    ours_opt = _two_group_adam()
    ours = build_scheduler(SchedulerConfig(type=kind, params=params), ours_opt)
    ours.load_state_dict(saved)
    got, want = _trace(ours_opt, ours, 30), _trace(theirs_opt, theirs, 30)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == pytest.approx(w, rel=1e-14, abs=1e-300), f"step {17 + step}: ours {g}, DeepSpeed's {w}"
    # and our own state dict round-trips as before
    again = build_scheduler(SchedulerConfig(type=kind, params=params), _two_group_adam())
    again.load_state_dict(ours.state_dict())
    assert again.last_epoch == ours.last_epoch == 47


def test_deepspeed_state_dict_refusals():
    sched = WarmupLR(_opt(), warmup_num_steps=3)
    with pytest.raises(ValueError, match=r"only 'last_batch_iteration'.*'extra'"):
        sched.load_state_dict({"last_batch_iteration": 3, "extra": 1})
    with pytest.raises(ValueError, match="integer >= -1, got 'x'"):
        sched.load_state_dict({"last_batch_iteration": "x"})


def test_lr_range_test_from_config_and_its_checks():
    sched = build_scheduler(SchedulerConfig(type="LRRangeTest", params={"lr_range_test_step_size": 2}), _opt())
    assert isinstance(sched, LRRangeTest)
    assert _lrs(sched, 4) == pytest.approx([0.001, 0.0015, 0.002, 0.0025])
    with pytest.raises(ValueError, match="lr_range_test_step_size must be a positive integer"):
        LRRangeTest(_opt(), lr_range_test_step_size=0)
