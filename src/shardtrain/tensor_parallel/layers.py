"""Megatron's column- and row-parallel linear layers, built from an existing module in place.

``ColumnParallelLinear.from_module(linear, comm)`` cuts ``linear``'s parameters to this rank's blocks (the same
``nn.Parameter`` objects: an optimizer built before keeps working, and the names ``weight``/``bias`` are kept,
so state dicts and Hugging Face checkpoint names do not change) and returns a module to put in its place.

Both ``nn.Linear`` (weight stored ``[out, in]``) and Hugging Face's ``Conv1D`` (GPT-2; weight stored transposed,
``[in, out]``) are accepted: "column" and "row" always mean the linear map's output and input features, whatever
the storage order.

The two layers compose as in Megatron-LM's MLP (section 3 of the paper)::

    x [*, h] replicated --f--> ColumnParallel A --> [*, 4h/N] --GeLU--> RowParallel B --> [*, h] partial --g--> sum

so one all-reduce in forward (``g``) and one in backward (``f``) per pair.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.distributed.placement import ParameterSharder, ShapeOf, TPPlacement, own_shape
from shardtrain.errors import LayoutError
from shardtrain.tensor_parallel.communication import (
    copy_to_tp_region,
    gather_from_tp_region,
    group_major_to_rank_major,
    rank_major_to_group_major,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from shardtrain.tensor_parallel.float8 import Float8Matmul, float8_linear
from shardtrain.tensor_parallel.rng import RegionRNG


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is ``transformers.pytorch_utils.Conv1D`` (without importing transformers)."""
    hf = sys.modules.get("transformers.pytorch_utils")
    return hf is not None and isinstance(module, hf.Conv1D)


def linear_dims(module: nn.Module, name: str = "") -> tuple[int, int]:
    """``(output dim, input dim)`` of the module's weight: ``(0, 1)`` for ``nn.Linear``, ``(1, 0)`` for Conv1D."""
    if isinstance(module, nn.Linear):
        return 0, 1
    if is_hf_conv1d(module):
        return 1, 0
    raise LayoutError(
        f"{name or 'the module'} ({type(module).__name__}) cannot take a column- or row-parallel style: those apply "
        "to nn.Linear and transformers' Conv1D only. Give it another style (e.g. replicate) or none."
    )


class _ParallelLinear(nn.Module):
    """The parts the column- and row-parallel layers share: parameters, sizes, the local matmul."""

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        global_weight_shape: tuple[int, ...],
        stride: int,
        communicate: bool,
        rng: RegionRNG | None,
        name: str,
    ) -> None:
        super().__init__()
        self.out_dim, in_dim = linear_dims(module, name)
        self.weight = module.weight  # the same Parameter, already cut to this rank's block
        self.bias = module.bias
        self.in_features, self.out_features = global_weight_shape[in_dim], global_weight_shape[self.out_dim]
        self.comm, self.stride, self.communicate, self.rng, self.name = comm, stride, communicate, rng, name
        self.float8: Float8Matmul | None = None  # fp8: the local matmul in float8 (use_float8)

    def use_float8(self, config: object) -> None:
        """Compute the local matmul in float8 with torchao's ``Float8LinearConfig`` ``config`` (tensorwise), each
        split tensor scaled as the whole one ([Note: float8 under tensor parallelism] in ``float8.py``)."""
        if self.out_dim != 0:
            raise LayoutError(f"{self.name or 'the layer'}: float8 takes nn.Linear layers, not transformers' Conv1D")
        self.float8 = Float8Matmul.of(config)

    def _local_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.float8 is not None:
            row = isinstance(self, RowParallelLinear)
            y = float8_linear(
                x, self.weight, self.float8, self.comm, input_split=row, output_split=not row, what=repr(self.name)
            )
            return y if bias is None else y + bias.to(y.dtype)
        if self.out_dim == 0:  # nn.Linear: weight [out, in] (one of them split)
            return F.linear(x, self.weight, bias)
        # Conv1D: weight [in, out], computed as transformers' Conv1D.forward does
        x2 = x.reshape(-1, x.shape[-1])  # [tokens, in]
        y = torch.addmm(bias, x2, self.weight) if bias is not None else x2 @ self.weight
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.comm.size}"
            + (f", stride={self.stride}" if self.stride > 1 else "")
            + (", float8" if self.float8 is not None else "")
        )


class ColumnParallelLinear(_ParallelLinear):
    """Megatron's ``ColumnParallelLinear``: ``Y = X A + b`` with ``A`` split by columns (the output features).

    Input replicated ``[*, in]``; this rank computes its block of the outputs, ``[*, out/N]`` (with ``stride``
    > 1, its block of each fused group, [Note: strided blocks]). ``gather_output`` all-gathers the blocks back to
    the replicated ``[*, out]`` (Hugging Face's ``colwise_gather_output``). ``communicate=False`` (``local_colwise``)
    leaves the input's ``f`` to an enclosing module. A split output opens a tensor-parallel RNG region
    ([Note: tensor-parallel RNG]).
    """

    def __init__(self, module: nn.Module, comm: Communicator, *, gather_output: bool = False, **common) -> None:
        super().__init__(module, comm, **common)
        self.gather_output = gather_output

    @staticmethod
    def placements(
        module: nn.Module, *, stride: int = 1, name: str = "", shape_of: ShapeOf = own_shape
    ) -> dict[str, TPPlacement]:
        """How ``module``'s parameters are split: weight on the output dim, bias likewise."""
        out_dim, _ = linear_dims(module, name)
        result = {"weight": TPPlacement(out_dim, stride, shape_of(module.weight))}
        if module.bias is not None:
            result["bias"] = TPPlacement(0, stride, shape_of(module.bias))
        return result

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        comm: Communicator,
        *,
        stride: int = 1,
        gather_output: bool = False,
        communicate: bool = True,
        rng: RegionRNG | None = None,
        sharder: ParameterSharder | None = None,
        name: str = "",
    ) -> ColumnParallelLinear:
        """Shard ``module`` (``nn.Linear`` or Conv1D) in place and return the layer to put in its place."""
        sharder = sharder or ParameterSharder(comm.rank, comm.size)
        placements = cls.placements(module, stride=stride, name=name, shape_of=sharder.global_shape)
        _shard(module, placements, sharder, name)
        return cls(
            module,
            comm,
            gather_output=gather_output,
            global_weight_shape=placements["weight"].global_shape,
            stride=stride,
            communicate=communicate,
            rng=rng,
            name=name,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [*, in] replicated
        if self.communicate:
            x = copy_to_tp_region(x, self.comm, self.name)
        y = self._local_linear(x, self.bias)  # [*, out/N], this rank's block of each of the `stride` groups
        if self.gather_output:
            y = gather_from_tp_region(y, self.comm, self.name)  # [*, out], rank-major
            y = rank_major_to_group_major(y, self.comm.size, self.stride)  # [*, out], the model's order
            if self.rng is not None:
                self.rng.exit()
        elif self.rng is not None:
            self.rng.enter()
        return y


class RowParallelLinear(_ParallelLinear):
    """Megatron's ``RowParallelLinear``: ``Y = X A + b`` with ``A`` split by rows (the input features).

    Input split ``[*, in/N]`` (the output of a column-parallel layer), or replicated ``[*, in]`` and split here
    with ``split_input`` (Hugging Face's ``rowwise_split_input``). The partial products ``[*, out]`` are summed
    over the group (``g``) and the replicated bias added once, after the sum. ``communicate=False``
    (``local_rowwise``) leaves the sum to an enclosing module; the bias is then added by tensor-parallel rank 0
    only, so it is counted once in that sum, and its gradient is partial (summed over the group like any
    ``partial_grad`` parameter).
    """

    def __init__(self, module: nn.Module, comm: Communicator, *, split_input: bool = False, **common) -> None:
        super().__init__(module, comm, **common)
        self.split_input = split_input

    @staticmethod
    def placements(
        module: nn.Module, *, stride: int = 1, communicate: bool = True, name: str = "", shape_of: ShapeOf = own_shape
    ) -> dict[str, TPPlacement]:
        """How ``module``'s parameters are split: weight on the input dim, bias replicated."""
        _, in_dim = linear_dims(module, name)
        result = {"weight": TPPlacement(in_dim, stride, shape_of(module.weight))}
        if module.bias is not None:
            result["bias"] = TPPlacement(None, 1, shape_of(module.bias), partial_grad=not communicate)
        return result

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        comm: Communicator,
        *,
        stride: int = 1,
        split_input: bool = False,
        communicate: bool = True,
        rng: RegionRNG | None = None,
        sharder: ParameterSharder | None = None,
        name: str = "",
    ) -> RowParallelLinear:
        """Shard ``module`` (``nn.Linear`` or Conv1D) in place and return the layer to put in its place."""
        sharder = sharder or ParameterSharder(comm.rank, comm.size)
        placements = cls.placements(
            module, stride=stride, communicate=communicate, name=name, shape_of=sharder.global_shape
        )
        _shard(module, placements, sharder, name)
        return cls(
            module,
            comm,
            split_input=split_input,
            global_weight_shape=placements["weight"].global_shape,
            stride=stride,
            communicate=communicate,
            rng=rng,
            name=name,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [*, in/N] split, or [*, in] with split_input
        if self.rng is not None:
            self.rng.exit()  # the split activation ends here: back to the shared random stream
        if self.split_input:
            x = group_major_to_rank_major(x, self.comm.size, self.stride)
            x = scatter_to_tp_region(x, self.comm, self.name)  # [*, in/N]
        y = self._local_linear(x, None)  # [*, out], this rank's partial sum
        if self.bias is None:
            return reduce_from_tp_region(y, self.comm, self.name) if self.communicate else y
        if self.communicate:
            return reduce_from_tp_region(y, self.comm, self.name) + self.bias  # bias once, after g
        return y + self.bias * (1.0 if self.comm.rank == 0 else 0.0)  # summed by the enclosing module


def _shard(module: nn.Module, placements: dict[str, TPPlacement], sharder: ParameterSharder, name: str) -> None:
    for pname, placement in placements.items():
        sharder.shard(getattr(module, pname), placement, f"{name}.{pname}" if name else pname)
