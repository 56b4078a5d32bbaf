"""Mixed precision at run time: which parameter dtypes a precision policy trains (the policy itself is plain data in
:mod:`shardtrain.plan.policies`; fp16's loss scaler is :mod:`.loss_scaler`).

[Note: mixed precision]
With ``bf16`` or ``fp16``, parameters (flat buffers, [Note: bucket layout]), frozen parameters and floating buffers are
cast to the compute dtype after the layout is built. Each rank keeps fp32 *masters* of its fragments, made before the
cast; the optimizer sees only them, and after each step the compute-dtype fragments are refreshed from them and
gathered. Gradients accumulate over micro-steps in ``data_types.grad_accum_dtype`` (the bucket's flat buffer at
stages 0-1, which ``param.grad`` views when it is the compute dtype; a reduce-scattered shard at 2-3) and are reduced
in ``communication_data_type``; both default to the compute dtype, as in DeepSpeed ([Note: DeepSpeed's defaults]).
``"fp32"`` for either is exact (fp32 accumulation costs 2 bytes per parameter more: stages 1/2/3 hold 2 + 4 + 12/N,
2 + 16/N, 18/N; the ZeRO paper's 4 + 12/N, 2 + 14/N, 16/N are the compute-dtype figures), and fp32 reductions move
twice the bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtrain.errors import ConfigError
from shardtrain.plan.policies import PrecisionPolicy


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
