"""``deepspeed.utils``: the full fp32 value, gradient and optimizer state of a sharded parameter, and the logger.

[Note: safe_get_full_* on fragments]
DeepSpeed's ``safe_get_full_fp32_param(p)`` (and ``_grad``, ``_optimizer_state``) is collective: each rank writes its
fragment into a zero tensor of ``p``'s shape and an all-reduce sums the whole. Here the fragment is the optimizer's (the
fp32 master under mixed precision; :meth:`ShardedOptimizer.fragment_of`) and the ranks its bucket's shard group (for an
expert parameter the expert-data-parallel group, so the tensor is this rank's experts', as in DeepSpeed-MoE); stage 0
communicates nothing. ``safe_set_full_*`` is local, as in DeepSpeed: each rank copies its slice, so every rank must pass
the same value. A parameter no engine steps gives None, as one without an fp32 copy does in DeepSpeed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from shardtrain.compat.deepspeed.unsupported import not_provided
from shardtrain.compat.deepspeed.zero import engine_of
from shardtrain.distributed.communicator import Reduce

logger = logging.getLogger("shardtrain")
"""DeepSpeed's ``deepspeed.utils.logger``: here shardtrain's logger (``transformers`` sets its level)."""


def _place(param: nn.Parameter) -> tuple[Any, torch.Tensor, int, int, Any] | None:
    """(sharded optimizer, what it steps for ``param``, first element, length, the communicator of the ranks the
    fragments are spread across) of ``param``'s fragment on this rank; None for a parameter no engine steps."""
    engine = engine_of(param)
    if engine is None:
        return None
    opt = engine._optimizer
    place = opt.fragment_of(param)
    if place is None:
        return None
    _, bucket, i = place
    comm = opt.expert_comm if bucket.expert and opt.expert_comm is not None else opt.comm
    if not opt.sharded:
        return opt, opt.stepped_of(param), 0, param.numel(), comm
    f = bucket.fragments[i]
    return opt, opt.stepped_of(param), f.start, f.length, comm


def _global_shape(param: nn.Parameter) -> torch.Size:
    """The parameter's shape across the tensor-parallel group; an expert parameter's is this rank's experts' (what
    its fragments over the expert-data-parallel group cover)."""
    engine = engine_of(param)
    record = engine.layout.record_of(param) if engine is not None else None
    if record is not None and record.ep is not None:
        return torch.Size(record.ep.local_shape(engine.layout.ep))
    return torch.Size(record.global_shape) if record is not None else param.shape


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` on every rank (collective); None for a parameter no engine steps."""
    place = _place(param)
    if place is None:
        return None
    opt, stepped, start, _, comm = place
    what = f"safe_get_full_fp32_param of {tuple(param.shape)}"
    return _whole_of(param, opt.sharded, comm, opt.readable(stepped), start, what)


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` (``exp_avg``, ``exp_avg_sq``, ...) of ``param`` on every rank
    (collective); None before the first step, for a key the optimizer does not keep per element, or for a
    parameter no engine steps."""
    place = _place(param)
    if place is None:
        return None
    opt, stepped, start, length, comm = place
    value = opt.state_of(stepped).get(optim_state_key)
    has = torch.tensor([float(torch.is_tensor(value) and value.numel() == length)])
    if opt.sharded:  # every rank takes the same branch: some ranks own no element of a small parameter
        comm.all_reduce(has, op=Reduce.MAX, what=f"safe_get_full_optimizer_state {optim_state_key!r} present")
    if has.item() == 0:
        return None
    if not (torch.is_tensor(value) and value.numel() == length):
        value = torch.zeros(length, dtype=torch.float32, device=stepped.device)
    return _whole_of(param, opt.sharded, comm, value, start, f"safe_get_full_optimizer_state {optim_state_key!r}")


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The whole gradient of ``param`` on every rank (collective), reduced over the data-parallel ranks: valid after
    the backward of an accumulation boundary, before ``step()``; under fp16 still multiplied by the loss scale, as
    DeepSpeed's. None for a parameter no engine steps."""
    place = _place(param)
    if place is None:
        return None
    opt, _, start, length, comm = place
    _, bucket, i = opt.fragment_of(param)
    if not opt.sharded:
        grad = opt.reducer.param_grad(bucket, i)
    else:
        f = bucket.fragments[i]
        grad = opt.reducer.shard_grad(bucket)[f.shard_offset : f.shard_offset + length]
    return _whole_of(param, opt.sharded, comm, grad, start, f"safe_get_full_grad of {tuple(param.shape)}")


def _whole_of(
    param: nn.Parameter, sharded: bool, comm: Any, fragment: torch.Tensor, start: int, what: str
) -> torch.Tensor:
    shape = _global_shape(param)
    if not sharded:
        return fragment.detach().to(torch.float32, copy=True).reshape(shape)
    full = torch.zeros(shape.numel(), dtype=torch.float32, device=fragment.device)
    full[start : start + fragment.numel()] = fragment.detach().reshape(-1)
    comm.all_reduce(full, what=what)
    return full.reshape(shape)


def _fragment_of(value: torch.Tensor, param: nn.Parameter, start: int, length: int) -> torch.Tensor:
    shape = _global_shape(param)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"the value has shape {tuple(value.shape)}; the parameter's is {tuple(shape)}")
    return value.detach().reshape(-1)[start : start + length]


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master to ``value`` (its whole shape; every rank passes the same value): this rank's
    fragment of it, and the parameter's compute-dtype values with it (DeepSpeed's reach the model at the next step).
    A parameter no engine steps is left alone."""
    place = _place(param)
    if place is None:
        return
    opt, stepped, start, length, _ = place
    with torch.no_grad():
        target = opt.readable(stepped)
        target.copy_(_fragment_of(value, param, start, length).reshape(target.shape))
        fragment, bucket, _ = opt.fragment_of(param)
        if bucket.gather_after_step:  # stages 0-2: every rank holds the whole parameter, and was given the value
            param.data.copy_(value.detach().reshape(param.shape))
        elif fragment is not target:  # stage 3: the compute-dtype fragment follows its master, as after a step
            fragment.copy_(target.reshape(fragment.shape))


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the optimizer state ``optim_state_key`` of ``param`` to ``value`` (its whole shape; every rank passes the
    same value). The state must exist (after the first step), as in DeepSpeed."""
    place = _place(param)
    if place is None:
        return
    opt, stepped, start, length, _ = place
    state = opt.state_of(stepped)
    if optim_state_key not in state:
        raise KeyError(f"safe_set_full_optimizer_state: the optimizer keeps no {optim_state_key!r} for this parameter "
                       f"yet (it has {sorted(state)}); set it after the first step")  # fmt: skip
    with torch.no_grad():
        target = state[optim_state_key]
        target.copy_(_fragment_of(value, param, start, length).reshape(target.shape))


class RepeatingLoader:
    """``deepspeed.utils.RepeatingLoader``: iterate ``loader`` forever, starting it again when it ends."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


_LOCAL = (
    "DeepSpeed defines it for ZeRO-3 partitions only; use its safe_get_full_* / safe_set_full_* counterpart "
    "(the whole tensor, on every rank)"
)
_INSTEAD = {
    **{
        f"safe_{op}_local_{what}": _LOCAL for op in ("get", "set") for what in ("fp32_param", "grad", "optimizer_state")
    },
    "safe_set_full_grad": "gradients are reduced into the engine's own buffers; scale the loss instead",
    "groups": "the process groups are shardtrain's mesh: engine.shardtrain_engine.topology names each axis",
    "set_z3_leaf_modules": "ZeRO-3 gathers whole units (zero_optimization.stage3_unit_classes or the default); "
    "a module class listed there is gathered as one",
}


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module 'shardtrain.deepspeed.utils' has no attribute {name!r}")
    raise not_provided(f"deepspeed.utils.{name}", _INSTEAD.get(name, ""))
