"""Optimizers that DeepSpeed configs ask for and torch does not have.

:class:`DeepSpeedAdam` is the update of DeepSpeed's ``FusedAdam`` / ``DeepSpeedCPUAdam`` with their
``bias_correction`` switch: ``bias_correction: false`` (BERT's recipe, kept in many DeepSpeed example configs)
steps with the raw moments, ``m / (sqrt(v) + eps)``, where torch's Adam and AdamW always divide them by
``1 - beta^t``. ``initialize`` builds it from a config's ``optimizer`` section when ``bias_correction`` is false;
with the default ``true`` it builds torch's own Adam/AdamW (the same update).

Its state is torch's Adam state, per parameter: ``step`` (a float32 scalar tensor on the host), ``exp_avg`` and
``exp_avg_sq`` (like the parameter), so ZeRO's fragment stepping, optimizer offload (which moves the element-wise
keys and keeps ``step``) and checkpoints (``step`` scalar, the others element-wise) treat it as they treat torch's
Adam. The update is element-wise, so ZeRO may step it on 1-D fragments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


class DeepSpeedAdam(torch.optim.Optimizer):
    """Adam as DeepSpeed's fused and CPU kernels compute it, bias correction optional.

    Per element, with ``t`` the parameter's step count, ``g`` its gradient, ``p`` the parameter::

        g = g + weight_decay * p                  (adam_w_mode false: L2 penalty in the gradient)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        c1, c2 = (1 - beta1^t, 1 - beta2^t) if bias_correction else (1, 1)
        p = p - lr * weight_decay * p             (adam_w_mode true: decoupled decay, as AdamW)
        p = p - lr / c1 * m / (sqrt(v) / sqrt(c2) + eps)

    With ``bias_correction=True`` this is torch's AdamW (``adam_w_mode=True``) or Adam (``False``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
    ) -> None:
        # the same checks, in the same words, as torch's Adam: a config's bad value reads the same for both classes
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        for name, flag in (("bias_correction", bias_correction), ("adam_w_mode", adam_w_mode)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                # a tensor without a gradient is skipped: optimizer offload steps one sub-group at a time this way
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("DeepSpeedAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    # torch's Adam layout: checkpoints and offload tell the scalar "step" from element-wise keys
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(float(state["step"]))
            if params:
                self._update(group, params, grads, exp_avgs, exp_avg_sqs, steps)
        return loss

    @staticmethod
    def _update(
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[float],
    ) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        if weight_decay != 0 and not group["adam_w_mode"]:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        if group["bias_correction"]:
            # steps may differ between tensors (one added to a group later): one correction per tensor
            torch._foreach_div_(denom, [math.sqrt(1 - beta2**t) for t in steps])
            step_sizes = [-lr / (1 - beta1**t) for t in steps]
        else:
            step_sizes = [-lr] * len(params)
        torch._foreach_add_(denom, eps)
        if weight_decay != 0 and group["adam_w_mode"]:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)

    @classmethod
    def update_views(
        cls,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[float],
    ) -> None:
        """The update of :meth:`step` on views of its tensors (blocks of them), with their step counts already
        advanced: what the offloaded host step runs in one pass over memory ([Note: one pass over a sub-group] in
        :mod:`shardtrain.offload.one_pass`)."""
        cls._update(group, params, grads, exp_avgs, exp_avg_sqs, steps)
