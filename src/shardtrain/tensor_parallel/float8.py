"""The column- and row-parallel layers' local matmul in float8 (``fp8`` with tensor parallelism), through torchao.

[Note: float8 under tensor parallelism]
torchao's tensorwise recipe casts each of a linear's three gemm inputs (input, weight, output gradient) with one scale,
``max_float8 / amax``, of the whole tensor. Under tensor parallelism a rank holds a block of some of them, so its own
amax is not the whole tensor's and its casts would differ from one process's. Which tensors are split:
- the weight, always (column: output rows; row: input columns);
- the input of a row-parallel layer (the column-parallel output before it, or a scattered input);
- the output gradient of a column-parallel layer (its output is this rank's block).
For those, the rank's amax is all-reduced (MAX, over the tensor-parallel communicator) before torchao's
``amax_to_scale`` makes the scale, and torchao's ``hp_tensor_and_scale_to_float8`` casts the rank's block with it. The
max is exact and the cast element-wise, so each rank's float8 block is exactly its block of one process's cast; the
replicated tensors (a column-parallel input, a row-parallel output gradient) are cast by torchao itself. torchao's
``matmul_with_hp_or_float8_args`` takes the pre-cast tensors as they are (``tensor_already_casted_to_fp8``) and
reuses the pre-cast output gradient for both backward gemms, as its own tensorwise cast does. What differs from one
process is the order of sums (a row-parallel layer's partial products, summed by ``g``). Rowwise recipes scale along
the split dimensions and are refused with tensor parallelism (``config/plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardtrain.distributed.communicator import Communicator, Reduce


@dataclass(frozen=True)
class Float8Matmul:
    """torchao's float8 settings of one converted tensor-parallel layer: its recipe's config and the gemm configs
    ``Float8Linear`` would build from it."""

    config: Any
    """torchao's ``Float8LinearConfig`` (tensorwise)."""
    linear_mm_config: Any
    """torchao's ``LinearMMConfig`` of the three gemms."""

    @classmethod
    def of(cls, config: Any) -> Float8Matmul:
        """The settings a ``Float8Linear`` of ``config`` uses (its ``linear_mm_config`` built as torchao builds it)."""
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_linear import Float8Linear

        casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
        if any(c.scaling_granularity is not ScalingGranularity.TENSORWISE for c in casts):
            raise ValueError("float8 under tensor parallelism scales whole tensors: the tensorwise recipe only")
        with torch.device("meta"):
            probe = Float8Linear(16, 16, bias=False, config=config)
        return cls(config, probe.linear_mm_config)


def _scale(t: torch.Tensor, float8_dtype: torch.dtype, matmul: Float8Matmul, comm: Communicator, what: str):
    """torchao's tensorwise scale of the whole tensor whose block ``t`` is: this block's amax, all-reduced (MAX)."""
    from torchao.float8.float8_utils import amax_to_scale

    with torch.no_grad():
        amax = t.abs().max().float()  # fp32 holds a bf16 or fp32 amax exactly
        if torch.compiler.is_compiling():
            amax = comm.graph_all_reduce(amax, Reduce.MAX)
        else:
            comm.all_reduce(amax, Reduce.MAX, what=f"the float8 amax of {what}")
        return amax_to_scale(amax, float8_dtype, matmul.config.round_scales_to_power_of_2)


def _cast_block(t: torch.Tensor, role: Any, float8_dtype: torch.dtype, matmul: Float8Matmul, comm, what: str):
    """This rank's block ``t`` cast with the whole tensor's scale (autograd: the gradient passes through)."""
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    scale = _scale(t, float8_dtype, matmul, comm, what)
    return hp_tensor_and_scale_to_float8(t, scale, float8_dtype, matmul.linear_mm_config, role)


class _GradOutputInFloat8(torch.autograd.Function):
    """Identity in forward; in backward the output gradient (this rank's block) cast with the whole gradient's scale,
    handed to torchao's matmul backward as already cast ([Note: float8 under tensor parallelism])."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, matmul: Float8Matmul, comm: Communicator, what: str) -> torch.Tensor:
        ctx.matmul, ctx.comm, ctx.what = matmul, comm, what
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from torchao.float8.float8_training_tensor import GemmInputRole

        m = ctx.matmul
        dtype = m.config.cast_config_grad_output.target_dtype
        cast = _cast_block(grad, GemmInputRole.GRAD_OUTPUT, dtype, m, ctx.comm, f"the output gradient of {ctx.what}")
        return cast, None, None, None


def float8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    matmul: Float8Matmul,
    comm: Communicator,
    *,
    input_split: bool,
    output_split: bool,
    what: str,
) -> torch.Tensor:
    """``x @ weight.T`` (``weight`` ``[out, in]``, this rank's block) through torchao's float8 matmul, each split
    tensor cast with the whole tensor's scale ([Note: float8 under tensor parallelism]). ``input_split``: ``x`` is
    this rank's block of the layer's input (row-parallel); ``output_split``: the output is this rank's block
    (column-parallel). No bias: the layers add it."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import GemmInputRole

    c = matmul.config
    w = _cast_block(weight, GemmInputRole.WEIGHT, c.cast_config_weight.target_dtype, matmul, comm, f"{what}'s weight")
    if input_split:
        x = _cast_block(x, GemmInputRole.INPUT, c.cast_config_input.target_dtype, matmul, comm, f"{what}'s input")
    y = matmul_with_hp_or_float8_args.apply(x, w.t(), matmul.linear_mm_config, c)
    return _GradOutputInFloat8.apply(y, matmul, comm, what) if output_split else y


__all__ = ["Float8Matmul", "float8_linear"]
