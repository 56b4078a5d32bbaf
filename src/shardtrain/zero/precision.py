"""Mixed precision: which dtype computes, which reduces, which the optimizer sees; and the loss scaler.

[Note: mixed precision]
With ``bf16`` or ``fp16``, parameters (flat buffers, [Note: bucket layout]), frozen parameters and floating buffers
are cast to the compute dtype after the layout is built. Each rank keeps fp32 *master* copies of its fragments, made
from the fp32 values before the cast; the optimizer and its state see only the masters, and after each step the
compute-dtype fragments are refreshed from them, then gathered as usual. Gradients come in the compute dtype and are
accumulated in fp32 (added into the bucket's fp32 buffer at stages 0-1, or staged and reduce-scattered into an fp32
shard at stages 2-3): exact accumulation over micro-steps and fp32 gradients ready for the masters, for 2 bytes per
parameter more than compute-dtype buffers (stage 1: 2 + 4 + 12/N bytes per parameter, stage 2: 2 + 16/N, stage 3:
18/N, against the ZeRO paper's 4 + 12/N, 2 + 14/N and 16/N). Reductions run in ``communication_data_type`` (default
fp32, twice a bf16 reduction's bytes; ``"bf16"``/``"fp16"`` halves them and sums in low precision).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardtrain.config.schema import Config
from shardtrain.errors import ConfigError, ShardtrainError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.master_dtype

    def casts(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a parameter or buffer) is cast to the compute dtype: fp32 floating tensors only."""
        return self.mixed and t.dtype == torch.float32


def policy_from_config(cfg: Config) -> PrecisionPolicy:
    if cfg.bf16.enabled:
        compute = torch.bfloat16
    elif cfg.fp16.enabled:
        compute = torch.float16
    else:
        compute = torch.float32
    reduce = _DTYPES[cfg.communication_data_type] if cfg.communication_data_type else torch.float32
    return PrecisionPolicy(compute_dtype=compute, reduce_dtype=reduce)


def check_parameter_dtypes(model: nn.Module, policy: PrecisionPolicy) -> None:
    """Refuse trainable parameters in a dtype the policy does not train correctly, before the model is touched.

    The flat buffers, gradient reductions and optimizer are built for fp32 parameters, or, under mixed
    precision, for parameters that are fp32 (cast by shardtrain after its fp32 masters are taken) or
    already in the compute dtype (the masters are then made from those values), and fp64 without mixed
    precision. Any other dtype would
    train silently wrong (a bf16 model without a ``bf16`` section would take steps too small to change its
    bf16 values). Frozen
    parameters may have any dtype (a bf16 base model under LoRA adapters): they are never stepped."""
    allowed = {torch.float32, policy.compute_dtype}
    if not policy.mixed:  # fp64 trains as it is: its gradients accumulate in fp64 and alias the flat buffers
        allowed.add(torch.float64)
    wrong: dict[torch.dtype, list[str]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype not in allowed:
            wrong.setdefault(p.dtype, []).append(name)
    if not wrong:
        return
    dtype, names = next(iter(wrong.items()))
    shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if policy.mixed:
        fix = f"cast the model to torch.float32 (or {policy.compute_dtype}, the compute dtype of this config)"
    elif short is not None:
        fix = f'keep the model in torch.float32 and set "{short}": {{"enabled": true}} in the config'
    else:
        fix = "keep the model in torch.float32"
    raise ConfigError(
        f"trainable parameter(s) {shown} have dtype {dtype}, but this config computes in "
        f"{policy.compute_dtype}; {fix}. shardtrain keeps the fp32 master weights itself and casts the "
        "model to the compute dtype after taking them, so the model should stay fp32"
    )


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
    :mod:`shardtrain.zero.host_read`). ``scale`` reads it on the host; ``scale_tensor`` is what a step uses.
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
    def from_config(cls, cfg: Config, device: torch.device | str = "cpu") -> LossScaler | None:
        if not cfg.fp16.enabled:
            return None
        f = cfg.fp16
        return cls(f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale, device)

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
