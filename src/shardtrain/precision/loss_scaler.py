"""fp16's loss scaler, with DeepSpeed's semantics, its state on the device."""

from __future__ import annotations

import torch

from shardtrain.errors import ShardtrainError
from shardtrain.plan.policies import LossScalePolicy


class LossScaler:
    """Static or dynamic loss scaling for fp16, with DeepSpeed's semantics, kept on the device.

    Dynamic: the scale starts at ``2**initial_scale_power``. An overflow (inf/nan in any rank's gradients)
    skips the step; the scale halves once ``hysteresis`` overflows have been seen since the last clean
    window (the first ``hysteresis - 1`` overflows only use up the allowance). A clean step that follows a
    positive multiple of ``loss_scale_window`` consecutive clean steps doubles the scale and restores the
    allowance: the first growth after the start or an overflow comes on clean step ``window + 1``, the next ones
    every ``window`` clean steps (DeepSpeed's ``DynamicLossScaler``, checked step by step against it). An overflow
    at ``min_loss_scale`` raises: training cannot make progress in fp16 from there.

    The state (the scale in float64, as Python computes it, the allowance and the clean-step count) lives in
    tensors on the engine's device, and :meth:`update` takes the overflow as a device tensor, so a step never
    waits for the device to learn whether it overflowed (see [Note: reading device values a step later] in
    :mod:`shardtrain.host_read`). ``scale`` reads it on the host; ``scale_tensor`` is what a step uses.
    """

    def __init__(
        self,
        static_scale: float = 0.0,
        initial_scale_power: int = 16,
        window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.dynamic = static_scale == 0
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        scale = float(2**initial_scale_power) if self.dynamic else float(static_scale)
        self._scale = torch.tensor(scale, dtype=torch.float64, device=device)
        self._allowance = torch.tensor(hysteresis, dtype=torch.int64, device=device)
        self._clean_steps = torch.tensor(0, dtype=torch.int64, device=device)

    @classmethod
    def from_policy(cls, policy: LossScalePolicy | None, device: torch.device | str = "cpu") -> LossScaler | None:
        """The scaler ``policy`` describes (fp16's); None for None (no loss scaling)."""
        if policy is None:
            return None
        p = policy
        return cls(p.static_scale, p.initial_scale_power, p.window, p.hysteresis, p.min_scale, device)

    @property
    def scale(self) -> float:
        """The current scale, read on the host (a device synchronization on CUDA)."""
        return float(self._scale)

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The current scale, a float64 scalar on the device: what a step multiplies the loss by."""
        return self._scale

    def update(self, overflow: bool | torch.Tensor) -> torch.Tensor | None:
        """Account one optimizer step (skipped when ``overflow``).

        ``overflow`` a host bool: the state changes as decided, and an overflow at the minimum scale raises now.
        A device tensor (non-zero: overflow): every change is made on the device without reading it, and the
        returned boolean tensor says whether the step overflowed at the minimum scale; the caller raises
        :meth:`min_scale_error` once it has read that on the host."""
        if not self.dynamic:
            return None
        found = torch.as_tensor(overflow, device=self._scale.device).reshape(()).bool()
        scale, allowance, clean_steps = self._scale, self._allowance, self._clean_steps
        # a clean step: the clean steps *before* this one decide, as in DeepSpeed (its "stable interval"); counting
        # this one too would grow one step early after every overflow and diverge from a resumed DeepSpeed run
        grow = ~found & (clean_steps > 0) & (clean_steps % self.window == 0)
        # an overflow: the allowance is used up first, then the scale halves, down to the minimum
        use_allowance = found & (allowance > 1)
        halve = found & ~use_allowance
        at_minimum = halve & (scale <= self.min_scale)
        halved = torch.clamp(scale / 2.0, min=self.min_scale)
        new_scale = torch.where(grow, scale * 2.0, torch.where(halve & ~at_minimum, halved, scale))
        new_allowance = torch.where(grow, self.hysteresis, torch.where(use_allowance, allowance - 1, allowance))
        new_clean = torch.where(found, 0, clean_steps + 1)
        self._scale.copy_(new_scale)
        self._allowance.copy_(new_allowance)
        self._clean_steps.copy_(new_clean)
        if isinstance(overflow, bool):
            if overflow and bool(at_minimum):
                raise self.min_scale_error()
            return None
        return at_minimum

    def min_scale_error(self) -> ShardtrainError:
        return ShardtrainError(
            f"fp16 gradients overflow even at the minimum loss scale ({self.min_scale:g}); the model "
            "diverged or needs bf16 / fp32 (or lower fp16.min_loss_scale)"
        )

    def state_dict(self) -> dict:
        return {"scale": self.scale, "allowance": int(self._allowance), "clean_steps": int(self._clean_steps)}

    def load_state_dict(self, state: dict) -> None:
        self._scale.fill_(float(state["scale"]))
        self._allowance.fill_(int(state["allowance"]))
        self._clean_steps.fill_(int(state["clean_steps"]))
