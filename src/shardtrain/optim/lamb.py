"""LAMB (You et al., "Large Batch Optimization for Deep Learning", Algorithm 2) with its per-tensor trust ratio
computed across ZeRO's shards.

[Note: LAMB's norms across shards]
LAMB's step is Adam's, element-wise, except one scalar per tensor: the trust ratio ||w|| / ||r + λw||. On a ZeRO
fragment those norms are the fragment's, another algorithm (the probe in zero/elementwise.py refuses such a class).
:class:`Lamb` computes each tensor's two squared sums on what it steps and hands them to its ``tensor_norms``: in one
process (or ZeRO stage 0) the tensors are whole and the sums are the norms'; under ZeRO 1-3 the engine binds
:class:`shardtrain.zero.shard_sums.ShardSums`, which adds the group's sums over the shard group in one all-reduce per
param group, so every fragment of a tensor is scaled by the whole tensor's ratio. No value is read on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

SumAcross = Callable[[torch.Tensor], torch.Tensor]
"""Adds a (tensors, 2) matrix of squared sums over the pieces of each tensor (collective where they are sharded)."""


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam's moments with bias correction, ``r = m̂ / (sqrt(v̂) + eps) + weight_decay * w``, and the step
    ``w -= lr * (||w|| / ||r||) * r`` (the ratio 1 where either norm is 0). See [Note: LAMB's norms across shards]."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        if min(lr, eps, weight_decay) < 0.0:
            raise ValueError(f"Lamb: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.tensor_norms: SumAcross | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        # every parameter of the group, with or without a gradient, has a row: the rows line up across the ranks
        params = group["params"]
        updates: list[torch.Tensor | None] = []
        squares = torch.zeros(len(params), 2, dtype=torch.float32, device=params[0].device if params else None)
        for row, p in enumerate(params):
            if p.grad is None:
                updates.append(None)
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            step = state["step"].to(p.device)
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            m_hat = state["exp_avg"] / (1 - beta1**step)
            v_hat = state["exp_avg_sq"] / (1 - beta2**step)
            update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
            squares[row, 0] = p.float().square().sum()
            squares[row, 1] = update.float().square().sum()
            updates.append(update)
        if self.tensor_norms is not None:
            squares = self.tensor_norms(squares)
        norms = squares.sqrt()
        trust = torch.where(
            (norms[:, 0] > 0) & (norms[:, 1] > 0), norms[:, 0] / norms[:, 1], torch.ones_like(norms[:, 0])
        )
        for row, (p, update) in enumerate(zip(params, updates)):
            if update is not None:
                p.sub_(update * (group["lr"] * trust[row]).to(update.dtype))
