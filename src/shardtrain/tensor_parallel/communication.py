"""The four communication primitives of Megatron tensor parallelism, as small autograd Functions.

Shoeybi et al., "Megatron-LM" (2019), section 3, name two conjugate operators: ``f`` (identity in forward,
all-reduce in backward) in front of a column-parallel layer and ``g`` (all-reduce in forward, identity in
backward) after a row-parallel layer. Gathering a split activation along its last dimension and its mirror,
scattering a replicated one, complete the set (Megatron-Core ``tensor_parallel/mappings.py``).

Every collective goes through the :class:`~shardtrain.distributed.communicator.Communicator` passed in (no process-group
globals), which counts its bytes. ``what`` is the layer's module name; the error of a failed collective says which
primitive of which layer it was, in forward or backward (e.g. ``all_reduce of the input gradient of
'blocks.1.mlp.0' (Megatron's f, backward) failed ...``).

[Note: replicated and split activations]
Between tensor-parallel layers an activation is *replicated* (the residual stream) or *split* (rank r holds block r of
the last dimension: a column-parallel output, an attention's heads). A replicated activation's gradient must come out
replicated: a rank that used only its block produces a partial gradient, which ``f`` sums; a gathered activation's
gradient is replicated, so its backward keeps this rank's block. In graph mode at stages 0-2 the four primitives run
eagerly between the graph's pieces (:mod:`shardtrain.between_graphs`): a graph cannot hold c10d work handles. At stage 3
(one graph, [Note: one graph, no splits]) they are traced with functional collectives ([Note: collectives in graphs] in
:mod:`shardtrain.distributed.communicator`), chosen by ``torch.compiler.is_compiling()``: eager's results, bitwise.
"""

from __future__ import annotations

import torch

from shardtrain.between_graphs import between_graphs
from shardtrain.distributed.communicator import Communicator


class _CopyToRegion(torch.autograd.Function):
    """Megatron's ``f``: enter the tensor-parallel region. Forward identity, backward all-reduce (sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:  # [*, h] -> [*, h]
        ctx.comm, ctx.what = comm, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # [*, h] partial per rank -> [*, h] summed
        if torch.compiler.is_compiling():
            return ctx.comm.graph_all_reduce(grad), None, None
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, what=f"the input gradient of {_layer(ctx.what)} (Megatron's f, backward)")
        return grad, None, None


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's ``g``: leave the region by summing partial results. Forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:  # [*, h] partial -> summed
        if torch.compiler.is_compiling():
            return comm.graph_all_reduce(x)
        out = x.contiguous().clone()  # x may be saved by another op: never reduce it in place
        comm.all_reduce(out, what=f"the output of {_layer(what)} (Megatron's g, forward)")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # [*, h] replicated
        return grad, None, None


class _GatherFromRegion(torch.autograd.Function):
    """Gather a split activation along the last dimension. Forward all-gather, backward keep this rank's block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:  # [*, h/N] -> [*, h]
        ctx.comm = comm
        if torch.compiler.is_compiling():
            return comm.graph_all_gather_dim(x, -1)
        return comm.all_gather_dim(x, -1, what=f"the output blocks of {_layer(what)} (tensor-parallel gather, forward)")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # [*, h] replicated -> [*, h/N]
        return _block_of_last_dim(grad, ctx.comm), None, None


class _ScatterToRegion(torch.autograd.Function):
    """Split a replicated activation along the last dimension. Forward keep this rank's block, backward all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:  # [*, h] -> [*, h/N]
        ctx.comm, ctx.what = comm, what
        return _block_of_last_dim(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # [*, h/N] -> [*, h]
        if torch.compiler.is_compiling():
            return ctx.comm.graph_all_gather_dim(grad, -1), None, None
        what = f"the input-gradient blocks of {_layer(ctx.what)} (tensor-parallel scatter, backward)"
        return ctx.comm.all_gather_dim(grad, -1, what=what), None, None


def _layer(name: str) -> str:
    return repr(name) if name else "a tensor-parallel layer"


def _block_of_last_dim(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    n = x.shape[-1]
    if n % comm.size:
        raise ValueError(f"the last dimension ({n}) does not split into {comm.size} tensor-parallel blocks")
    per = n // comm.size
    return x.narrow(-1, comm.rank * per, per).contiguous()


@between_graphs("tensor-parallel collective", traced_in_one_graph=True)
def copy_to_tp_region(x: torch.Tensor, comm: Communicator, what: str = "") -> torch.Tensor:
    """``f``: identity; in backward the partial input gradients of the ranks are summed."""
    return _CopyToRegion.apply(x, comm, what)


@between_graphs("tensor-parallel collective", traced_in_one_graph=True)
def reduce_from_tp_region(x: torch.Tensor, comm: Communicator, what: str = "") -> torch.Tensor:
    """``g``: the sum over ranks of the partial results ``x``; the gradient passes through unchanged."""
    return _ReduceFromRegion.apply(x, comm, what)


@between_graphs("tensor-parallel collective", traced_in_one_graph=True)
def gather_from_tp_region(x: torch.Tensor, comm: Communicator, what: str = "") -> torch.Tensor:
    """Every rank's block of the last dimension, concatenated in rank order."""
    return _GatherFromRegion.apply(x, comm, what)


@between_graphs("tensor-parallel collective", traced_in_one_graph=True)
def scatter_to_tp_region(x: torch.Tensor, comm: Communicator, what: str = "") -> torch.Tensor:
    """This rank's block of the last dimension of the replicated ``x``."""
    return _ScatterToRegion.apply(x, comm, what)


def group_major_to_rank_major(x: torch.Tensor, size: int, stride: int) -> torch.Tensor:
    """Reorder the last dimension from ``stride`` fused groups to rank-major blocks ([Note: strided blocks]).

    ``[..., stride * size * per]`` laid out as (group, rank, per) becomes (rank, group, per), so that a plain
    split hands each rank its block of every group. :func:`rank_major_to_group_major` is the inverse."""
    if stride == 1 or size == 1:
        return x
    head, n = x.shape[:-1], x.shape[-1]
    return x.reshape(*head, stride, size, n // (stride * size)).transpose(-3, -2).reshape(*head, n)


def rank_major_to_group_major(x: torch.Tensor, size: int, stride: int) -> torch.Tensor:
    """The inverse of :func:`group_major_to_rank_major`: the order of a gathered strided output."""
    if stride == 1 or size == 1:
        return x
    head, n = x.shape[:-1], x.shape[-1]
    return x.reshape(*head, size, stride, n // (stride * size)).transpose(-3, -2).reshape(*head, n)
