"""Expert parallelism's token exchange: a mixture-of-experts layer whose experts are split over the ranks of a group.

[Note: tokens to their experts]
Each rank of an expert-parallel group of ``E`` ranks holds ``n / E`` whole experts of every MoE layer (rank ``r``:
experts ``[r * n/E, (r + 1) * n/E)``) and its own tokens. The router, the shared experts and every dense parameter
are as in one process. A layer's forward, given this rank's tokens ``x [T, H]``, their experts ``idx [T, k]`` and
their routing weights ``w [T, k]`` (what transformers hands its experts module):

1. The ``T * k`` (token, expert) pairs are sorted by expert, stably, so each destination rank's rows are contiguous
   and in expert order.
2. The count of rows for each rank is exchanged (an all-to-all of ``E`` integers). This is the one host
   synchronization of the layer: the sizes of the next exchange must be known on the host.
3. The rows, and their experts' local indices, go to the ranks holding those experts (an all-to-all with variable
   sizes).
4. Each rank runs its experts on what it received, through the experts module's own forward: the same code path
   as one process, eager, ``grouped_mm`` or ``batched_mm``, over the local experts' weights. It passes a weight of
   1 per row.
5. The outputs go back by the reverse exchange. Each row is multiplied by its routing weight in the weights' dtype
   (fp32 router weights: the product in fp32), as transformers does, and the rows are added up as the module's
   implementation adds them: ``eager`` rounds each product to the activations' dtype and adds it into its token's
   output in expert order, as its loop does; ``grouped_mm`` and ``batched_mm`` sum each token's ``k`` products in the
   product's dtype and round once. In bf16 the two differ; each is the same, bit for bit, as one process's.

Backward is the same exchanges reversed: :class:`_AllToAllV`'s gradient is the all-to-all with the sizes swapped.
Every rank of the group must take part in each backward exchange, also a rank that received no row: its experts
module then returns a tensor outside the autograd graph (transformers' eager loop makes zeros, and an
``autograd.Function`` whose inputs need no gradient has no backward), so the exchange would have no backward there
while the other ranks wait for it in theirs. Its output is therefore tied, with a zero weight, to the received rows
and to the experts' trainable weights, whenever gradients are recorded: the weights then get a zero gradient, as
on a rank whose implementation runs its kernels on no row, so that every rank's weights get a gradient in every
backward (the tensor-parallel check of replicated gradients, [Note: experts beside tensor parallelism], compares
them in the same backward on every tp rank).
No token is dropped (no capacity factor): a rank receives what the router sends it, and an expert that receives no
token contributes nothing.

The gradient of an expert's weights is the sum over every rank's tokens routed to it, of each rank's own loss.
Data parallelism averages the ranks' losses. So the expert gradients must be divided by the group size ``E`` and
averaged over the ranks holding the same experts, while dense gradients are averaged over the whole data-parallel
axis. That is the engine's part when it shards experts; this module computes what one layer computes.

[Note: experts beside tensor parallelism]
With tensor parallelism on the dense layers (``tensor_parallel.size: T``) the experts are kept whole on every tp
rank of an expert group, as DeepSpeed-MoE does by default (``enable_expert_tensor_parallelism: false``) and
Megatron-Core with ``expert_tensor_parallel_size: 1``. The other choice, splitting each expert by tensor
parallelism as well (transformers' ``moe_tp_experts``, Megatron's ETP = TP), would make every rank compute every
routed token on a slice of each expert and all-reduce partial outputs, and a checkpoint would have to record
tensors split along two dimensions at once; whole experts keep the token exchange the only communication of the
experts and their checkpoint record a block along the expert dimension only. The plan's expert entries are
therefore dropped under expert parallelism (``replicate_experts`` in :mod:`shardtrain.tensor_parallel.plans`).

The hidden states reaching a MoE layer are the same on the ``T`` ranks of a tensor-parallel group (the dense
layers before it end in a row-parallel all-reduce; under sequence parallelism too, each holding the same slice of the
sequence: [Note: experts under tensor and sequence parallelism] in :mod:`shardtrain.distributed.mesh`), and so is
the routing (the router is replicated). Running
every token through the exchange on each of them would compute each expert's rows ``T`` times. So, as DeepSpeed's
``drop_tokens`` does, tp rank ``t`` keeps only its share of the tokens (``ceil(N / T)`` rows from ``t *
ceil(N / T)``, the last ranks fewer, maybe none) and exchanges those over its own expert group (each tp rank has
its own, [Note: the expert axis]); the outputs are all-gathered over the tensor-parallel group afterwards.
Backward is the mirror: the all-gather's gradient is this rank's share of the (replicated) output gradient, and
the share's gradient is all-gathered, so every tp rank holds the whole gradient of the hidden states and the
routing weights, as tensor parallelism expects of a replicated activation. An expert's weight gradient on tp rank
``t`` then covers the tokens of share ``t`` only: the ``T`` gradients are summed over the tensor-parallel group
before they are reduced over the expert-data-parallel group (the plan marks the expert weights
``replicated_with_grad_allreduce``, so the engine sums them and checks once that they differ between tp ranks).
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
