"""How a parameter is laid out over the tensor-parallel group, and the tensor arithmetic of that layout.

A :class:`TPPlacement` is plain data (DTensor's ``Shard``/``_StridedShard``/``Replicate``, Megatron-Core's
``ShardedTensor`` split axis), the record the engine, the reducer and the checkpoint code read. The functions
here are the only code that cuts a tensor into its blocks or glues blocks back together, so the layers, the
tests and the checkpoint code agree on what "block r with stride s" means.

[Note: strided blocks]
A fused weight stacks ``stride`` logical tensors along one dimension (Q, K and V: 3; gate and up: 2). Rank ``r`` of
``N`` must hold block ``r`` of *each*, in group order, so the local output is again "Q then K then V" and the model's
own ``chunk(3, dim=-1)`` still works: with stride 2 and N = 2, ``[g0 g1 | u0 u1]`` gives rank 0 ``[g0 u0]`` and rank 1
``[g1 u1]``. Stride 1 is the plain contiguous split. Dropping a fused weight's stride gives rank 0 ``[g0 g1]`` (all of
gate, none of up): wrong numbers, not just permuted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardtrain.errors import LayoutError

ShapeOf = Callable[[nn.Parameter], tuple[int, ...]]  # a parameter's whole (unsplit) shape


def own_shape(p: nn.Parameter) -> tuple[int, ...]:
    """A parameter's shape as it is now (not yet split)."""
    return tuple(p.shape)


@dataclass(frozen=True)
class TPPlacement:
    """One parameter's layout over the tensor-parallel group.

    ``dim``: the dimension split across the group (``None``: every rank holds the whole tensor).
    ``stride``: the split dimension is first cut into ``stride`` equal groups and each rank holds its block of
    every group, in group order ([Note: strided blocks]); 1 when ``dim`` is ``None``.
    ``global_shape``: the shape of the whole tensor.
    ``partial_grad``: a replicated parameter whose gradient differs per tensor-parallel rank (each rank sees only
    its share of the computation) and must be summed over the group (Hugging Face's
    ``replicated_with_grad_allreduce``).
    """

    dim: int | None
    stride: int
    global_shape: tuple[int, ...]
    partial_grad: bool = False

    def __post_init__(self) -> None:
        if self.stride < 1:
            raise ValueError(f"TPPlacement: stride must be >= 1, got {self.stride}")
        if self.dim is None:
            if self.stride != 1:
                raise ValueError("TPPlacement: a replicated parameter (dim=None) has stride 1")
        else:
            if not 0 <= self.dim < len(self.global_shape):
                raise ValueError(f"TPPlacement: dim {self.dim} is not a dimension of shape {self.global_shape}")
            if self.partial_grad:
                raise ValueError("TPPlacement: partial_grad describes replicated parameters (dim=None) only")

    @property
    def is_split(self) -> bool:
        return self.dim is not None

    def describe(self) -> str:
        """``split on dim 0 with stride 3`` / ``replicated``, for messages."""
        if self.dim is None:
            return "replicated" + (" (partial gradient)" if self.partial_grad else "")
        return f"split on dim {self.dim}" + (f" with stride {self.stride}" if self.stride > 1 else "")

    def local_shape(self, size: int) -> tuple[int, ...]:
        """The shape of one rank's block in a group of ``size``."""
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] //= size
        return tuple(shape)

    def check_divisible(self, size: int, name: str) -> None:
        """Raise :class:`LayoutError` naming ``name`` unless the split dimension cuts into equal blocks."""
        if self.dim is None:
            return
        n = self.global_shape[self.dim]
        if n % (self.stride * size):
            what = f"{self.stride} fused groups of {n // self.stride}" if self.stride > 1 else f"size {n}"
            raise LayoutError(
                f"{name}: dimension {self.dim} ({what}) cannot be split into {size} equal tensor-parallel blocks"
                f"{' per group' if self.stride > 1 else ''}. Pick a tensor-parallel size that divides "
                f"{n // self.stride}, or change the model's sizes."
            )


def shard_block(full: torch.Tensor, placement: TPPlacement, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s block of ``full`` (a view when the placement is contiguous, a new tensor when strided)."""
    if placement.dim is None:
        return full
    dim, stride = placement.dim, placement.stride
    per = full.shape[dim] // (stride * size)  # elements of one group held by one rank
    groups = full.chunk(stride, dim)  # stride x [..., n/stride, ...]
    blocks = [g.narrow(dim, rank * per, per) for g in groups]
    return blocks[0] if stride == 1 else torch.cat(blocks, dim)  # [..., n/size, ...]


def assemble_blocks(blocks: Sequence[torch.Tensor], placement: TPPlacement) -> torch.Tensor:
    """The whole tensor from every rank's block, in rank order (the inverse of :func:`shard_block`)."""
    if placement.dim is None:
        return blocks[0]
    dim, stride = placement.dim, placement.stride
    pieces = [b.chunk(stride, dim) for b in blocks]  # rank -> stride x [..., per, ...]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(blocks))], dim)


class ParameterSharder:
    """Shards each parameter once, in place, and remembers how.

    The parameter object is kept (``p.data`` is replaced by this rank's block), so optimizers and names built
    before keep working and nothing is attached to the parameter. A parameter reached a second time (tied
    weights: one parameter in two modules) is not cut again; it must be asked for with the same placement.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self._done: dict[int, tuple[nn.Parameter, TPPlacement, str]] = {}

    def placement_of(self, param: nn.Parameter) -> TPPlacement | None:
        entry = self._done.get(id(param))
        return entry[1] if entry is not None else None

    def global_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The whole tensor's shape: ``param``'s own, or the one it had before this sharder cut it."""
        entry = self._done.get(id(param))
        return entry[1].global_shape if entry is not None else tuple(param.shape)

    def shard(self, param: nn.Parameter, placement: TPPlacement, owner: str) -> None:
        """Cut ``param`` to this rank's block (``owner`` names it in errors)."""
        entry = self._done.get(id(param))
        if entry is not None:
            if entry[1] != placement:
                raise LayoutError(
                    f"{owner} is the same parameter as {entry[2]} (tied weights), but the plan splits it as "
                    f"{placement.describe()} here and as {entry[1].describe()} there. Give both modules styles "
                    "that split it the same way (e.g. embedding_rowwise with colwise), or untie them."
                )
            return
        if tuple(param.shape) != placement.global_shape:
            raise LayoutError(f"{owner}: shape {tuple(param.shape)} is not {placement.global_shape}")
        placement.check_divisible(self.size, owner)
        self._done[id(param)] = (param, placement, owner)
        if placement.dim is None or self.size == 1:
            return  # nothing to cut (a group of one holds the whole tensor)
        with torch.no_grad():
            param.data = shard_block(param.data, placement, self.rank, self.size).clone()
            if param.grad is not None:
                param.grad = shard_block(param.grad, placement, self.rank, self.size).clone()


def global_flat_index(placement: TPPlacement | None, rank: int, size: int, local: torch.Tensor) -> torch.Tensor:
    """Where elements of rank ``rank``'s block sit in the whole tensor: ``local`` holds flat (row-major) indices
    into the block, the result the flat indices of the same elements in the whole tensor (int64, same shape).

    The inverse of :func:`shard_block` element by element, computed without the whole tensor: construction uses
    it to give each element of a block the value its position in the whole tensor defines
    ([Note: deferred construction] in :mod:`shardtrain.construction.sharded_init`)."""
    if placement is None or placement.dim is None or size == 1:
        return local
    dim, stride, whole = placement.dim, placement.stride, placement.global_shape
    inner = math.prod(whole[dim + 1 :])
    n_local = whole[dim] // size  # the block's length along the split dimension
    per = whole[dim] // (stride * size)  # elements of one fused group held by one rank
    along = (local // inner) % n_local  # position along the split dimension, in the block
    outer = local // (inner * n_local)
    group, within = along // per, along % per
    along_whole = group * (whole[dim] // stride) + rank * per + within
    return (outer * whole[dim] + along_whole) * inner + local % inner
