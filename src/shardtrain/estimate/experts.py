"""Mixture-of-experts models on fake tensors: expert parallelism's split and token exchange, and grouped matmuls.

[Note: experts on fake tensors]
The planner splits the fake model with the engine's own :func:`~shardtrain.expert_parallel.install_expert_parallel`,
over a communicator that knows only its size and rank 0, so a rank's parameters, and the names its expert buckets
are built from, are the engine's (docs/expert-parallel.md). The token exchange cannot run on fake tensors (its sizes
are the routing's row counts, read on the host), so the fake forward replaces it by :func:`balanced_dispatch`: the
same operations, assuming balanced routing (each rank receives the ``T * k`` rows it sends, the expectation when
every expert is equally likely), with new buffers of the sent shape, as ``Communicator.all_to_all_v`` makes them.
Uneven routing in a real run gives some ranks more rows: the experts' activations (a few ``T * k`` by hidden or
intermediate size per layer) move with it.

``aten._grouped_mm`` (transformers' default ``grouped_mm`` experts on CPU) runs in fp32 on CPU, but its meta kernel
accepts bfloat16 only, as the CUDA kernel does: :class:`GroupedMatmulShapes` gives fake tensors of the other dtypes
the output the CPU kernel makes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardtrain.estimate import wire
from shardtrain.expert_parallel import find_experts, install_expert_parallel


class _ShapeOnlyExchange(torch.autograd.Function):
    """An all-to-all of rows under balanced routing on fake tensors: a new tensor of the sent shape each way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ep: int) -> torch.Tensor:
        ctx.ep = ep
        wire.note("all_to_all", "ep", ep, x.numel() * x.element_size())
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        wire.note("all_to_all", "ep", ctx.ep, grad.numel() * grad.element_size())
        return torch.empty_like(grad, memory_format=torch.contiguous_format), None


def balanced_dispatch(
    x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, local_experts: Any, num_experts: int, ep: int
) -> torch.Tensor:
    """:func:`shardtrain.expert_parallel.dispatch.dispatch`'s operations with each exchange replaced by a buffer of
    the rows sent (see [Note: experts on fake tensors]); the exchange of the ``E`` row counts, 8 bytes each, is
    left out."""
    k = idx.shape[1]
    per_rank = num_experts // ep
    flat = idx.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    rows = x[order // k]  # [T * k, H]
    received = _ShapeOnlyExchange.apply(rows, ep)
    local_ids = _ShapeOnlyExchange.apply((experts_sorted % per_rank)[:, None], ep)
    out = local_experts(received, local_ids, torch.ones_like(local_ids, dtype=x.dtype))
    back = _ShapeOnlyExchange.apply(out, ep)
    back = back * weights.reshape(-1)[order, None].to(back.dtype)
    return torch.zeros_like(x).index_add(0, order // k, back.to(x.dtype))


class _SizeOnly:
    """What :func:`install_expert_parallel` asks of a communicator: the expert group's size and this rank."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank


class _ShapeOnlyShares(torch.autograd.Function):
    """Tensor parallelism's share of the tokens on fake tensors ([Note: experts beside tensor parallelism] in
    :mod:`shardtrain.expert_parallel.dispatch`): forward, tp rank 0's share, the largest (a copy); backward, the
    all-gathered gradient of every row (a new tensor)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: int) -> torch.Tensor:
        ctx.shape = x.shape
        return x[: -(-x.shape[0] // tp)].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad.new_empty(ctx.shape), None


class _ShapeOnlyGather(torch.autograd.Function):
    """The all-gather of every tp rank's share of the outputs on fake tensors: a new tensor of ``n`` rows; backward,
    this rank's share of the gradient (a copy)."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, n: int) -> torch.Tensor:
        ctx.rows = part.shape[0]
        return part.new_empty((n, *part.shape[1:]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad[: ctx.rows].clone(), None


def split_experts(model: nn.Module, ep: int, tp: int = 1) -> frozenset[int]:
    """Keep rank 0's ``num_experts / ep`` experts of every experts module of ``model`` (fake tensors) as the engine
    does, their forward through :func:`balanced_dispatch`; returns the ids of the expert parameters. Refuses, as
    ``initialize`` does, a model without experts and a number of experts ``ep`` does not divide. ``tp``: the
    tensor-parallel size, whose ranks each send their share of the tokens (tp rank 0's, the largest, here)."""
    inner = {name: (m.forward, m.num_experts) for name, m in find_experts(model).items()}
    ids = install_expert_parallel(model, _SizeOnly(ep))  # type: ignore[arg-type]
    modules = dict(model.named_modules())
    for name, (forward, n) in inner.items():

        def exchange(x, top_k_index, top_k_weights, forward=forward, n=n):
            if tp == 1:
                return balanced_dispatch(x, top_k_index, top_k_weights, forward, n, ep)
            share = _ShapeOnlyShares.apply(x, tp)
            w = _ShapeOnlyShares.apply(top_k_weights, tp)
            out = balanced_dispatch(share, top_k_index[: share.shape[0]], w, forward, n, ep)
            return _ShapeOnlyGather.apply(out, x.shape[0])

        modules[name].forward = exchange
    return ids


def expert_counts(model: nn.Module) -> list[int]:
    """``num_experts`` of every experts module of ``model`` (empty for a dense model)."""
    return [m.num_experts for m in find_experts(model).values()]


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` has a mixture-of-experts layer (a module with an integer ``num_experts``: transformers'
    experts modules and routers), split or not."""
    return any(isinstance(getattr(m, "num_experts", None), int) for m in model.modules())


class GroupedMatmulShapes(TorchDispatchMode):
    """``aten._grouped_mm`` on fake tensors of dtypes its meta kernel refuses: the output the CPU kernel makes (see
    [Note: experts on fake tensors]); everything else passes through."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            a, b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 else None) or a.dtype
            if a.dim() == 2 and b.dim() == 2:
                shape = (offs.shape[0], a.shape[0], b.shape[1])  # 2-D x 2-D: one product per group
            elif a.dim() == 2:
                shape = (a.shape[0], b.shape[-1])
            elif b.dim() == 2:
                shape = (a.shape[1], b.shape[1])
            else:
                shape = (a.shape[0], a.shape[1], b.shape[-1])
            return torch.empty(shape, dtype=dtype, device=a.device)
        return func(*args, **kwargs)
