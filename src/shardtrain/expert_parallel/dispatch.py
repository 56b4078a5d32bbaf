"""Expert parallelism's token exchange: a mixture-of-experts layer whose experts are split over the ranks of a group.

[Note: tokens to their experts]
Each rank of an expert group of ``E`` ranks holds ``n / E`` whole experts of every MoE layer (rank ``r``: experts
``[r * n/E, (r + 1) * n/E)``) and its own tokens; the rest of the model is as in one process. A layer's forward:

1. sorts the ``T * k`` (token, expert) pairs by expert, stably (each rank's rows contiguous, in expert order);
2. exchanges the row counts (an all-to-all of ``E`` ints): its one host synchronization, for the next sizes;
3. sends the rows and their local expert indices to their experts' ranks (an all-to-all with variable sizes);
4. runs the experts module's own forward on them (one process's code path), with a weight of 1 per row;
5. sends the outputs back, scales each by its routing weight in the weights' dtype and sums them as the module's
   implementation does (``eager``: rounded per product, added in expert order; ``grouped_mm``, ``batched_mm``:
   rounded once): one process's result bit for bit, in bf16 too.

Backward runs the exchanges reversed (:class:`_AllToAllV`), and every rank must take part in each. A rank that
received no row gets an output outside the autograd graph, so, whenever gradients are recorded, that output is tied
with a zero weight to the received rows and the experts' trainable weights: every rank's weights get a gradient in
every backward, as the tensor-parallel check of replicated gradients expects ([Note: experts beside tensor
parallelism]). No token is dropped (no capacity factor). An expert's gradient sums every rank's loss over its tokens,
so the engine divides it by ``E`` and averages it over the ranks holding that expert; dense gradients are averaged
over the whole data-parallel axis.

[Note: experts beside tensor parallelism]
With tensor parallelism on the dense layers the experts are kept whole on every tp rank of an expert group
(DeepSpeed-MoE's default, Megatron's ``expert_tensor_parallel_size: 1``). Splitting them as well would add an
all-reduce of partial outputs for every routed token and checkpoints split along two dimensions; whole experts keep
the token exchange the experts' only communication. So the plan's expert entries are dropped under expert
parallelism (``replicate_experts`` in :mod:`shardtrain.tensor_parallel.plans`).

The hidden states and the routing reaching a MoE layer are the same on the ``T`` ranks of a tensor-parallel group
(under sequence parallelism too: [Note: experts under tensor and sequence parallelism] in
:mod:`shardtrain.distributed.mesh`); exchanging every token on each would compute each row ``T`` times. So, as
DeepSpeed's ``drop_tokens`` does, tp rank ``t`` exchanges only its share (``ceil(N / T)`` rows from
``t * ceil(N / T)``, maybe none) over its own expert group ([Note: the expert axis]), and the outputs are
all-gathered over the tensor-parallel group; in backward every tp rank gets the whole gradient of the hidden states
and routing weights, as for a replicated activation. An expert's weight gradient on tp rank ``t`` covers share ``t``
only, so the plan marks the expert weights ``replicated_with_grad_allreduce``: summed over the tensor-parallel group
before the expert-data-parallel reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError


class _AllToAllV(torch.autograd.Function):
    """Rows to ranks with variable sizes; backward sends the gradients back with the sizes swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, out_splits: list[int], in_splits: list[int],
                what: str) -> torch.Tensor:  # fmt: skip
        ctx.comm, ctx.out_splits, ctx.in_splits, ctx.what = comm, out_splits, in_splits, what
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all_v(out, x.contiguous(), out_splits, in_splits, what=what)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all_v(
            back, grad.contiguous(), ctx.in_splits, ctx.out_splits, what=f"the gradient of {ctx.what}"
        )
        return back, None, None, None, None


def all_to_all_v(x: torch.Tensor, comm: Communicator, out_splits: list[int], in_splits: list[int], what: str):
    """Differentiable :meth:`Communicator.all_to_all_v` returning the received rows."""
    return _AllToAllV.apply(x, comm, out_splits, in_splits, what)


def _share(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``n`` that tp rank ``rank`` of ``size`` keeps ([Note: experts beside tensor
    parallelism]): ``ceil(n / size)`` each, the last ranks fewer."""
    per = -(-n // size)
    return min(rank * per, n), min((rank + 1) * per, n)


def _gather_shares(part: torch.Tensor, n: int, comm: Communicator, what: str) -> torch.Tensor:
    """Every tp rank's share of ``n`` rows (:func:`_share`) in rank order: padded to ``ceil(n / size)`` rows for one
    all-gather of equal shapes; the padding is the tail of the result, dropped."""
    per = -(-n // comm.size)
    padded = part if part.shape[0] == per else torch.cat([part, part.new_zeros((per - part.shape[0], *part.shape[1:]))])
    return comm.all_gather_dim(padded.contiguous(), 0, what=what)[:n]


class _KeepShare(torch.autograd.Function):
    """Forward: this tp rank's share of the rows of a replicated tensor. Backward: the shares' gradients
    all-gathered, the whole gradient on every tp rank (DeepSpeed's ``drop_tokens`` / ``gather_tokens`` pair)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:
        ctx.comm, ctx.n, ctx.what = comm, x.shape[0], what
        lo, hi = _share(x.shape[0], comm.size, comm.rank)
        return x[lo:hi].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _gather_shares(grad, ctx.n, ctx.comm, f"the gradient of {ctx.what}"), None, None


class _GatherShares(torch.autograd.Function):
    """Forward: every tp rank's share all-gathered into the whole, replicated tensor of ``n`` rows. Backward: this
    rank's share of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, n: int, comm: Communicator, what: str) -> torch.Tensor:
        ctx.lo, ctx.hi = _share(n, comm.size, comm.rank)
        return _gather_shares(part, n, comm, what)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad[ctx.lo : ctx.hi].contiguous(), None, None, None


_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj", "up_proj", "gate_up_proj_bias", "down_proj_bias", "up_proj_bias")


def keep_rows(name: str, p: nn.Parameter, first: int, count: int) -> None:
    """Keep rows ``[first, first + count)`` of ``p`` (dim 0), the same Parameter object (also on ``meta``)."""
    p.data = p.detach()[first : first + count].clone()


def shard_experts(
    experts: nn.Module,
    comm: Communicator,
    name: str = "experts",
    cut: Callable[[str, nn.Parameter, int, int], None] = keep_rows,
    tp_comm: Communicator | None = None,
) -> None:
    """Keep this rank's experts of a transformers experts module (3-D weights ``[n, ...]``, one row per expert) and
    route its forward through :func:`dispatch` (see [Note: tokens to their experts]). In place. ``cut(name, p,
    first, count)`` keeps rows ``[first, first + count)`` of the weight ``p`` named ``name``: :func:`keep_rows`, or
    the engine's for a model under sharded construction. ``tp_comm``: the tensor-parallel group, whose ranks hold the
    same experts and tokens; each sends its share of the tokens ([Note: experts beside tensor parallelism])."""
    n = getattr(experts, "num_experts", None)
    if not isinstance(n, int):
        raise ConfigError(f"{name} ({type(experts).__name__}) has no num_experts: not a transformers experts module")
    if n % comm.size:
        raise ConfigError(
            f"{name} has {n} experts, which do not split over an expert-parallel group of {comm.size}: each rank "
            f"holds whole experts, n / expert_parallel_size of them; choose a size that divides {n}"
        )
    local = n // comm.size
    first = comm.rank * local
    held = [w for w in _EXPERT_WEIGHTS if isinstance(getattr(experts, w, None), nn.Parameter)]
    if not held:
        raise ConfigError(f"{name} ({type(experts).__name__}) has none of the expert weights {_EXPERT_WEIGHTS}")
    for w in held:
        p = getattr(experts, w)
        if p.dim() < 2 or p.shape[0] != n:
            raise ConfigError(f"{name}.{w} of shape {tuple(p.shape)} is not one row per expert ({n} experts)")
        # the same Parameter object: an optimizer built over the model before the split keeps stepping it
        cut(f"{name}.{w}", p, first, local)
    experts.num_experts = local
    experts.expert_range = (first, first + local)  # global ids of the experts held here
    inner = experts.forward  # the module's own forward, over the local experts
    weights = [getattr(experts, w) for w in held]

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        eager = getattr(getattr(experts, "config", None), "_experts_implementation", "eager") in (None, "eager")
        if tp_comm is None or tp_comm.size == 1:
            return dispatch(
                hidden_states, top_k_index, top_k_weights, inner, comm, n, name, per_token_sum=not eager, params=weights
            )
        rows = hidden_states.shape[0]
        lo, hi = _share(rows, tp_comm.size, tp_comm.rank)
        x = _KeepShare.apply(hidden_states, tp_comm, f"the tokens of {name}")
        w = _KeepShare.apply(top_k_weights, tp_comm, f"the routing weights of {name}")
        out = dispatch(x, top_k_index[lo:hi], w, inner, comm, n, name, per_token_sum=not eager, params=weights)
        return _GatherShares.apply(out, rows, tp_comm, f"the outputs of {name}")

    experts.forward = forward


def dispatch(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    local_experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    comm: Communicator,
    num_experts: int,
    what: str = "experts",
    per_token_sum: bool = False,
    params: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """``x [T, H]`` through the experts ``idx [T, k]`` chose, weighted by ``weights [T, k]``, the experts split over
    ``comm``'s ranks (see [Note: tokens to their experts]). ``local_experts(rows, local_idx [R, 1], ones [R, 1])`` is
    the experts module's own forward over this rank's experts, whose weights are ``params``. ``per_token_sum``: each
    token's weighted rows summed and rounded once (transformers' ``grouped_mm`` and ``batched_mm``); else added in
    expert order (``eager``)."""
    k = idx.shape[1]
    per_rank = num_experts // comm.size
    flat = idx.reshape(-1)  # [T * k], pair p is token p // k's expert
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    counts = torch.bincount(experts_sorted // per_rank, minlength=comm.size)
    sizes = torch.empty_like(counts)
    comm.all_to_all(sizes, counts, what=f"the token counts of {what}")
    send, recv = counts.tolist(), sizes.tolist()  # the host must know the sizes of the exchange
    rows = x[order // k]  # [T * k, H], by expert
    received = all_to_all_v(rows, comm, recv, send, f"the tokens of {what}")
    local_ids = all_to_all_v((experts_sorted % per_rank)[:, None], comm, recv, send, f"the expert ids of {what}")
    out = local_experts(received, local_ids, torch.ones_like(local_ids, dtype=x.dtype))
    if torch.is_grad_enabled() and not out.requires_grad:  # no row received: see [Note: tokens to their experts]
        anchors = [t for t in (received, *params) if t.requires_grad]
        if anchors:
            out = out + sum(t.reshape(-1)[:1].sum().to(out.dtype) for t in anchors) * 0
    back = all_to_all_v(out, comm, send, recv, f"the outputs of {what}")  # [T * k, H], by expert
    back = back * weights.reshape(-1)[order, None]  # in the promoted dtype, as transformers multiplies
    if per_token_sum:
        pairs = torch.empty_like(back).index_copy(0, order, back)  # pair p = token p // k's p % k-th choice
        return pairs.view(-1, k, back.shape[-1]).sum(dim=1).to(x.dtype)
    return torch.zeros_like(x).index_add(0, order // k, back.to(x.dtype))
