"""The Ulysses all-to-all as an autograd Function: trade a split of one dimension for a split of another.

Jacobs et al., "DeepSpeed Ulysses" (2023): before attention each rank of a sequence-parallel group holds all heads
of 1/P of the sequence; one all-to-all gives it 1/P of the heads over the whole sequence, the attention of a head
needs nothing else, and a second all-to-all brings the output back to the sequence split. The exchange is a
permutation of the pieces of one tensor, so its backward is the reverse exchange of the gradient (the same
all-to-all with the two dimensions swapped). Every collective goes through the
:class:`~shardtrain.distributed.communicator.Communicator` passed in, which counts its bytes (``all_to_all`` in
``comm_stats()``).
"""

from __future__ import annotations

import torch

from shardtrain.distributed.communicator import Communicator


def _exchange(x: torch.Tensor, comm: Communicator, scatter_dim: int, gather_dim: int, what: str) -> torch.Tensor:
    p = comm.size
    if x.shape[scatter_dim] % p:
        raise ValueError(f"dimension {scatter_dim} of {list(x.shape)} does not split into {p} sequence-parallel parts")
    send = torch.stack(x.chunk(p, dim=scatter_dim))  # [P, ...]: part j goes to rank j
    received = torch.empty_like(send)  # [P, ...]: part i came from rank i
    comm.all_to_all(received, send, what=what)
    return torch.cat(received.unbind(0), dim=gather_dim)  # rank order = the order of the split it undoes


class _AllToAll(torch.autograd.Function):
    """Scatter ``scatter_dim`` over the group, gather ``gather_dim`` from it; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, scatter_dim: int, gather_dim: int, what: str):
        ctx.comm, ctx.dims, ctx.what = comm, (scatter_dim, gather_dim), what
        return _exchange(x, comm, scatter_dim, gather_dim, f"{what} (Ulysses all-to-all, forward)")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        what = f"the gradient of {ctx.what} (Ulysses all-to-all, backward)"
        return _exchange(grad.contiguous(), ctx.comm, gather_dim, scatter_dim, what), None, None, None, None


def all_to_all(x: torch.Tensor, comm: Communicator, scatter_dim: int, gather_dim: int, what: str) -> torch.Tensor:
    """``x`` split in ``comm.size`` parts along ``scatter_dim``, part ``j`` sent to rank ``j``; the parts received
    concatenated along ``gather_dim`` in rank order. E.g. ``[b, h, s/P, d] -> [b, h/P, s, d]`` with
    ``scatter_dim=1, gather_dim=2``."""
    if comm.size == 1:
        return x
    return _AllToAll.apply(x, comm, scatter_dim, gather_dim, what)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) in forward; in backward the all-reduce of the gradients, the derivative of a sum that every
    rank computed and backpropagates (see ``shardtrain.sequence_parallel.loss``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:
        ctx.comm, ctx.what = comm, what
        out = x.detach().clone()
        comm.all_reduce(out, what=f"{what} (forward)")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, what=f"the gradient of {ctx.what} (backward)")
        return grad, None, None


def sum_over_group(x: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:
    return _SumOverGroup.apply(x, comm, what) if comm.size > 1 else x


class _GatherOverGroup(torch.autograd.Function):
    """All-gather along ``dim`` in forward (every rank's slice, in rank order); in backward the sum over the group
    of the gradients of the whole tensor, narrowed to this rank's slice: every rank computes a loss of the gathered
    tensor and backpropagates it, so a slice's gradient is the sum of what every rank's loss sends it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, dim: int, what: str) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.what, ctx.size = comm, dim, what, x.shape[dim]
        return comm.all_gather_dim(x, dim, what=f"{what} (forward)")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, what=f"the gradient of {ctx.what} (backward)")
        return grad.narrow(ctx.dim, ctx.comm.rank * ctx.size, ctx.size), None, None, None


def gather_over_group(x: torch.Tensor, comm: Communicator, dim: int, what: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, differentiable (see ``_GatherOverGroup``)."""
    return _GatherOverGroup.apply(x, comm, dim % x.dim(), what) if comm.size > 1 else x
