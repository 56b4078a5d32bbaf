"""The state keys a resume must supply are asked of the optimizer that takes them, without touching it."""

from __future__ import annotations

import torch

from shardtrain.engine.optimizer_needs import state_keys_needed
from shardtrain.optim.adam import DeepSpeedAdam


def _params(n: int = 3) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(4)) for _ in range(n)]


def test_keys_per_group_of_torch_and_shardtrain_optimizers():
    ps = _params()
    adam = torch.optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "amsgrad": True}], lr=0.1)
    assert state_keys_needed(adam) == [
        frozenset({"step", "exp_avg", "exp_avg_sq"}),
        frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    ]
    assert state_keys_needed(DeepSpeedAdam(ps, bias_correction=False)) == [frozenset({"step", "exp_avg", "exp_avg_sq"})]
    assert state_keys_needed(torch.optim.SGD(ps, lr=0.1, momentum=0.9)) == [frozenset({"momentum_buffer"})]
    assert state_keys_needed(torch.optim.SGD(ps, lr=0.1)) == [frozenset()]


def test_the_probe_leaves_the_optimizer_alone():
    """No state, no step of the real parameters, no step counted by an LR scheduler (which wraps the instance's
    ``step``), the hooks not run."""
    ps = _params()
    opt = torch.optim.Adam(ps, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(a))
    for p in ps:
        p.grad = torch.ones(4)
    state_keys_needed(opt)
    assert len(opt.state) == 0 and all(torch.equal(p, torch.ones(4)) for p in ps)
    assert calls == [] and getattr(opt, "_opt_called", False) is False
    assert sched.last_epoch == 0 and len(opt.param_groups[0]["params"]) == 3


def test_other_libraries_are_not_probed():
    class Custom(torch.optim.SGD):
        pass

    Custom.__module__ = "someone_else.optim"
    assert state_keys_needed(Custom(_params(), lr=0.1)) == [None]
