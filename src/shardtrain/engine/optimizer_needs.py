"""Which optimizer states a resume must supply, asked of the optimizer that will take them.

A torch optimizer that finds a parameter's state non-empty assumes every key it creates is there: Adam with
``exp_avg`` and ``exp_avg_sq`` but no ``step`` fails with ``KeyError: 'step'`` on the first ``step()``, long after
the load "succeeded". A checkpoint that holds some state for a parameter must hold all of it; this module says what
"all" is for the optimizer at hand, and the load refuses a checkpoint that lacks any of it by name.

What "all" is comes from the optimizer itself: a copy of it, sharing nothing it writes to, steps one small probe
tensor per param group with that group's hyperparameters (``amsgrad`` adds ``max_exp_avg_sq``), and the keys of
the probe's state are the answer. Only torch's and shardtrain's optimizers are probed; another class may do more
in ``step`` than update its state (a collective, a counter), and is not checked.
"""

from __future__ import annotations

import torch

from shardtrain.zero.elementwise import detached_copy

_PROBED_MODULES = ("torch.optim.", "shardtrain.")


def state_keys_needed(optimizer: torch.optim.Optimizer) -> list[frozenset[str] | None]:
    """Per param group, the state keys ``optimizer.step`` creates for a parameter of that group; None where that
    cannot be asked (an optimizer of another library, a group without parameters, a probe that failed)."""
    cls = type(optimizer)
    if not cls.__module__.startswith(_PROBED_MODULES):
        return [None] * len(optimizer.param_groups)
    out: list[frozenset[str] | None] = []
    for group in optimizer.param_groups:
        params = group["params"]
        if not params:
            out.append(None)
            continue
        like = params[0]
        probe_param = torch.zeros(2, dtype=like.dtype, device=like.device, requires_grad=True)
        probe_param.grad = torch.zeros_like(probe_param)
        probe = detached_copy(optimizer, group, [probe_param])
        try:
            with torch.no_grad():
                # the class's step: an LR scheduler replaces the instance's ``step`` by one bound to the original
                cls.step(probe)
        except Exception:
            out.append(None)
            continue
        out.append(frozenset(probe.state[probe_param]))
    return out
