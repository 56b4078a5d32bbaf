"""The engine's API beyond parity: optimizer/scheduler forms, errors, rank checks, timeouts, launch modes."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardtrain
from shardtrain.errors import CollectiveTimeoutError, ConfigError, OptimizerError, RankMismatchError, ShardtrainError
from shardtrain.testing import DistributedFailure, run_distributed

from helpers.parity import Recipe, assert_params_near, make_model, make_optimizer


def _config_optimizer_and_scheduler(stage: int) -> dict:
    model = make_model(Recipe())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage},
    }
    engine = shardtrain.initialize(model, config=config)
    x = torch.randint(0, 64, (2, 16))
    lrs = []
    for _ in range(5):
        lrs.append(engine.get_lr()[0])
        engine.backward(engine(x, x))
        engine.step()
    return {
        "optimizer": type(engine.optimizer).__name__,
        "lrs": lrs,
        "global_step": engine.global_step,
        "full": engine.full_state_dict() is not None,
        "training": engine.train().module.training and not engine.eval().module.training,
    }


@pytest.mark.parametrize("stage", [0, 2])
def test_optimizer_and_scheduler_from_config(stage):
    results = run_distributed(_config_optimizer_and_scheduler, 2, stage)
    for rank, r in enumerate(results):
        assert r["optimizer"] == "AdamW"  # DeepSpeed's Adam defaults to adam_w_mode=True
        assert r["lrs"][0] == 0.0 and r["lrs"][4] == pytest.approx(0.01)  # log warm-up over 4 steps
        assert r["global_step"] == 5
        assert r["full"] == (rank == 0)  # full_state_dict only on rank 0
        assert r["training"]


def _user_objects(stage: int) -> dict:
    model = make_model(Recipe())
    opt = make_optimizer(model, Recipe())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = shardtrain.initialize(
        model, config={"zero_optimization": {"stage": stage}}, optimizer=opt, lr_scheduler=sched
    )
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        engine.backward(engine(x, x))
        engine.step()
    # the callable forms, at stage 2 (momentum buffers of fragments); every rank gets the same batch, so three
    # steps must equal torch's SGD on that batch in one process
    model2 = make_model(Recipe())
    engine2 = shardtrain.initialize(
        model2,
        config={"zero_optimization": {"stage": 2, "reduce_bucket_size": 3000}, "gradient_clipping": 0},
        optimizer=_sgd,
        lr_scheduler=_halving,
    )
    for _ in range(3):
        engine2.backward(engine2(x, x))
        engine2.step()
    return {
        "sgd_params": engine2.full_state_dict(),
        "same_optimizer": engine.optimizer is opt,
        "groups": [(len(g["params"]), g["weight_decay"], g["lr"]) for g in opt.param_groups],
        "n_params": [sum(1 for p in model.parameters() if p.requires_grad and p.dim() >= 2)],
        "callable": (type(engine2.optimizer).__name__, engine2.get_lr()[0]),
    }


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)


def _halving(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))


def test_user_optimizer_scheduler_and_callables():
    r = run_distributed(_user_objects, 2, 1)[0]
    reference = make_model(Recipe())
    opt = _sgd(reference.parameters())
    sched = _halving(opt)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    init = {k: v.clone() for k, v in reference.state_dict().items()}
    for _ in range(3):
        reference(x, x).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert_params_near(r["sgd_params"], reference.state_dict(), init)
    assert r["same_optimizer"]  # the user's object is kept (schedulers built on it keep working)
    decay, no_decay = r["groups"]
    assert decay[0] == r["n_params"][0] and decay[1] == 0.1 and no_decay[1] == 0.0
    assert decay[2] == pytest.approx(3e-3 * 0.25)  # StepLR halved the lr twice
    assert r["callable"] == ("SGD", pytest.approx(0.1 / 4))  # LambdaLR after three steps


def _optimizer_mistakes() -> list[str]:
    messages = []
    model = make_model(Recipe())

    def attempt(**kwargs):
        try:
            shardtrain.initialize(model, config=kwargs.pop("config", None), **kwargs)
        except (OptimizerError, ConfigError) as err:
            messages.append(str(err))
        else:
            messages.append("no error")

    attempt(optimizer=torch.optim.AdamW([nn.Parameter(torch.zeros(3))]))
    attempt(optimizer=torch.optim.AdamW([p for n, p in model.named_parameters() if "head" not in n]))
    stepped = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    stepped.step()
    attempt(optimizer=stepped)
    attempt(optimizer=torch.optim.AdamW(model.parameters()), config={"optimizer": {"type": "SGD"}})
    attempt()
    other = torch.optim.AdamW(make_model(Recipe()).parameters())
    attempt(optimizer=torch.optim.AdamW(model.parameters()), lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    return messages


def test_optimizer_mistakes_are_clear():
    foreign, missing, stepped, both, none, sched = run_distributed(_optimizer_mistakes, 1)[0]
    assert "is not a parameter of the model" in foreign
    assert "not in any optimizer param group: head.weight" in missing
    assert "already holds state" in stepped
    assert "keep one of them" in both
    assert "no optimizer" in none
    assert "different optimizer" in sched


def _loss_backward_outside_engine() -> str:
    model = make_model(Recipe())
    engine = shardtrain.initialize(
        model, config={"zero_optimization": {"stage": 2}}, optimizer=make_optimizer(model, Recipe())
    )
    x = torch.randint(0, 64, (2, 16))
    try:
        engine(x, x).backward()
    except ShardtrainError as err:
        return str(err)
    return "no error"


def test_plain_loss_backward_is_refused():
    assert "call engine.backward(loss)" in run_distributed(_loss_backward_outside_engine, 2)[0]


def _disagreeing_ranks(what: str) -> str:
    rank = dist.get_rank()
    model = make_model(Recipe())
    config = {"zero_optimization": {"stage": 1}}
    if what == "config" and rank == 1:
        config["gradient_clipping"] = 0.5  # the default is 1.0
    if what == "model" and rank == 1:
        model.extra = nn.Linear(2, 2)
    try:
        shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters()))
    except RankMismatchError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("what", ["config", "model"])
def test_ranks_that_disagree_fail_at_initialize(what):
    for message in run_distributed(_disagreeing_ranks, 3, what):
        assert f"ranks disagree on the {what}" in message and "ranks [1]" in message


def _rank_takes_extra_backward(woken: str) -> str:
    """Rank 0 runs a backward rank 1 never joins; rank 1 stays alive (its exit would end rank 0's wait too) until
    rank 0 has its outcome (the file ``woken`` exists), at most 30 s."""
    model = make_model(Recipe())
    engine = shardtrain.initialize(
        model,
        config={"zero_optimization": {"stage": 2}, "collective_timeout_s": 3, "desync_check": False},
        optimizer=make_optimizer(model, Recipe()),
    )
    x = torch.randint(0, 64, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    if dist.get_rank() == 0:
        try:
            engine.backward(engine(x, x))  # rank 1 never joins this reduction
        except CollectiveTimeoutError as err:
            return str(err)
        finally:
            Path(woken).touch()
        return "no error"
    deadline = time.monotonic() + 30
    while not Path(woken).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return "waited"


def test_diverging_ranks_fail_with_named_timeout(tmp_path):
    start = time.monotonic()
    message = run_distributed(
        _rank_takes_extra_backward, 2, str(tmp_path / "rank 0 has its outcome"), init_process_group=False, timeout=60
    )[0]
    assert message.startswith("rank 0: reduce_scatter of gradient bucket")
    assert "collective timeout 3s" in message
    assert time.monotonic() - start < 40


def _initial_state_from_rank_0(stage: int) -> dict:
    torch.manual_seed(dist.get_rank())  # every rank builds different weights and buffers
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
    model[1].running_mean.uniform_()
    zero = {"stage": stage} if stage < 3 else {"stage": 3, "stage3_param_persistence_threshold": 10}
    engine = shardtrain.initialize(
        model, config={"zero_optimization": zero}, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
    )
    return engine.full_state_dict() if stage == 3 else {k: v.clone() for k, v in engine.module.state_dict().items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_parameters_and_buffers_start_from_rank_0(stage):
    torch.manual_seed(0)
    want = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
    want[1].running_mean.uniform_()
    states = run_distributed(_initial_state_from_rank_0, 3, stage)
    for state in states[:1] if stage == 3 else states:
        for k, v in want.state_dict().items():
            assert torch.equal(state[k], v), k


def test_single_process_without_launcher(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, shardtrain\n"
        "model = torch.nn.Linear(4, 2)\n"
        "engine = shardtrain.initialize(model, config={'zero_optimization': {'stage': 2}},"
        " optimizer=torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "x = torch.ones(3, 4)\n"
        "before = model.weight.detach().clone()\n"
        "engine.backward(engine(x).pow(2).mean()); engine.step()\n"
        "assert not torch.equal(before, model.weight), 'no update'\n"
        "print('world', engine.topology.world_size, 'step', engine.global_step)\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    }
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "world 1 step 1" in out.stdout


def _fails_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        raise ValueError(f"planted failure on rank {bad}")
    dist.barrier()


def _hangs() -> None:
    time.sleep(60)


def test_harness_reports_rank_traceback_and_timeouts():
    with pytest.raises(DistributedFailure) as err:
        run_distributed(_fails_on_rank, 3, 2, timeout=60)
    assert "--- rank 2 ---" in str(err.value) and "planted failure on rank 2" in str(err.value)
    start = time.monotonic()
    with pytest.raises(DistributedFailure, match=r"rank\(s\) \[0, 1\] did not finish within 3s"):
        run_distributed(_hangs, 2, timeout=3)
    assert time.monotonic() - start < 20


@pytest.mark.timeout(20)
def test_harness_stops_at_the_tests_deadline_before_a_longer_timeout():
    """Under pytest-timeout's 20 s a ``timeout=600`` could never fire: the harness stops at the deadline conftest
    publishes (20 s less its margin, at least 1 s), names the ranks, and says which limit ended the wait."""
    start = time.monotonic()
    with pytest.raises(
        DistributedFailure, match=r"rank\(s\) \[0, 1\] did not finish within \d+s \(the test's deadline"
    ):
        run_distributed(_hangs, 2, timeout=600)
    assert time.monotonic() - start < 19


class _SubclassedAdamW(torch.optim.AdamW):
    """Changes a default only: keeps AdamW's element-wise step."""

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, lr=lr, weight_decay=0.0)


class _OwnStepAdamW(torch.optim.AdamW):
    """Overrides step: its update may need whole tensors."""

    def step(self, closure=None):
        return super().step(closure)


class _UnknownOptimizer(torch.optim.Optimizer):
    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        return None


_NOT_ELEMENTWISE = {
    "Adafactor": lambda ps: torch.optim.Adafactor(ps),
    "LBFGS": lambda ps: torch.optim.LBFGS(ps),
    "SparseAdam": lambda ps: torch.optim.SparseAdam(ps),
    "_OwnStepAdamW": lambda ps: _OwnStepAdamW(ps),
    "_UnknownOptimizer": lambda ps: _UnknownOptimizer(ps),
}


def _optimizer_policy(stage: int, allow: bool) -> dict[str, str]:
    """What initialize says for each optimizer at ``stage``: 'ok' or the error message."""
    out = {}
    config = {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": allow}
    for name, build in {**_NOT_ELEMENTWISE, "_SubclassedAdamW": lambda ps: _SubclassedAdamW(ps)}.items():
        try:
            shardtrain.initialize(make_model(Recipe()), config=config, optimizer=build)
        except OptimizerError as err:
            out[name] = str(err)
        else:
            out[name] = "ok"
    # Muon takes 2-D parameters only: a model without biases or norms
    try:
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False))
        shardtrain.initialize(model, config=config, optimizer=torch.optim.Muon(model.parameters()))
    except OptimizerError as err:
        out["Muon"] = str(err)
    else:
        out["Muon"] = "ok"
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimizers_that_need_whole_tensors_are_refused_at_stages_1_to_3(stage):
    r = run_distributed(_optimizer_policy, 1, stage, False)[0]
    assert r.pop("_SubclassedAdamW") == "ok"  # a subclass that keeps AdamW's step
    for name, message in r.items():
        if stage == 0:
            assert message == "ok", (name, message)
        else:
            assert name in message and "1-D fragments" in message and f"stage {stage}" in message, (name, message)
            assert "zero_allow_untested_optimizer" in message


def test_untested_optimizers_are_allowed_by_the_config_key_unless_known_or_probed_not_elementwise():
    r = run_distributed(_optimizer_policy, 1, 2, True)[0]
    # a probe step on flat pieces agrees with the whole-tensor step: the key lets them through, as in DeepSpeed
    assert {n: r.pop(n) for n in ("_OwnStepAdamW", "_UnknownOptimizer", "_SubclassedAdamW")} == dict.fromkeys(
        ("_OwnStepAdamW", "_UnknownOptimizer", "_SubclassedAdamW"), "ok"
    )
    # known to need whole tensors: refused by name whatever the key says, with the ways out
    for name, message in r.items():
        assert name in message and "stage 2" in message and "ZeRO stage 0" in message, (name, message)
        assert "zero_allow_untested_optimizer does not lift this" in message, (name, message)
    assert "orthogonalizes each 2-D matrix" in r["Muon"] and "torch.optim._muon.Muon" in r["Muon"]
    assert "factors each matrix's second moment" in r["Adafactor"]
