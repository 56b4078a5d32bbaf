"""The token exchange of expert parallelism ([Note: tokens to their experts]) on transformers' own experts modules:
each rank's output and gradients against the module in one process on every rank's tokens, at expert-parallel
groups of 2 and 3, with the eager and grouped_mm implementations, and a routing where an expert gets no token; in
bf16, each rank's output bit for bit the module's on its tokens."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import ConfigError
from shardtrain.expert_parallel.dispatch import shard_experts
from shardtrain.testing import run_distributed

TOKENS, HIDDEN, TOP_K = 5, 8, 2


def _experts(n: int, implementation: str):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=16, num_local_experts=n, num_experts_per_tok=TOP_K,
        experts_implementation=implementation,
    )  # fmt: skip
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2)
    return experts


def _inputs(rank: int, n: int, starve: bool):
    """This rank's tokens, experts and weights (rank-dependent); ``starve``: no token of any rank picks expert 1."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS + rank, HIDDEN, generator=g)  # ranks hold different numbers of tokens
    scores = torch.randn(TOKENS + rank, n, generator=g)
    if starve:
        scores[:, 1] = -1e9
    w, idx = torch.softmax(scores, -1).topk(TOP_K, dim=-1)
    return x, idx, w / w.sum(-1, keepdim=True)


def _layer(n: int, implementation: str, starve: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Communicator(dist.group.WORLD, timeout_s=60.0)
    experts = _experts(n, implementation)
    shard_experts(experts, comm)
    x, idx, w = _inputs(rank, n, starve)
    x.requires_grad_()
    out = experts(x, idx, w)
    g = torch.Generator().manual_seed(7 + rank)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {k: p.grad for k, p in experts.named_parameters()}
    half = _experts(n, implementation).bfloat16()  # fp32 routing weights, bf16 rows: the products in fp32
    shard_experts(half, comm)
    out16 = half(x.detach().bfloat16(), idx, w)
    return {
        "out": out.detach(), "x_grad": x.grad, "grads": grads, "range": experts.expert_range, "world": world,
        "out16": out16.detach(),
    }  # fmt: skip


def _one_process(n: int, world: int, implementation: str, starve: bool) -> dict:
    experts = _experts(n, implementation)
    outs, x_grads = [], []
    for rank in range(world):
        x, idx, w = _inputs(rank, n, starve)
        x.requires_grad_()
        out = experts(x, idx, w)
        g = torch.Generator().manual_seed(7 + rank)
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        outs.append(out.detach())
        x_grads.append(x.grad)
    half = _experts(n, implementation).bfloat16()
    outs16 = [half(x.bfloat16(), idx, w).detach() for x, idx, w in (_inputs(r, n, starve) for r in range(world))]
    return {
        "outs": outs,
        "x_grads": x_grads,
        "grads": {k: p.grad for k, p in experts.named_parameters()},
        "outs16": outs16,
    }


@pytest.mark.parametrize(
    ("world", "n", "implementation", "starve"),
    [(2, 4, "eager", False), (3, 6, "eager", True), (2, 4, "grouped_mm", True), (3, 3, "batched_mm", False)],
)
def test_each_rank_computes_what_one_process_does(world, n, implementation, starve):
    results = run_distributed(_layer, world, n, implementation, starve)
    ref = _one_process(n, world, implementation, starve)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["out"], ref["outs"][rank], rtol=1e-5, atol=1e-6)
        # bf16: the weighted rows added up as the implementation adds them, rounded where it rounds
        assert torch.equal(r["out16"], ref["outs16"][rank]), (rank, (r["out16"] - ref["outs16"][rank]).abs().max())
        torch.testing.assert_close(r["x_grad"], ref["x_grads"][rank], rtol=1e-5, atol=1e-6)
        lo, hi = r["range"]
        assert hi - lo == n // world
        for name, grad in r["grads"].items():  # every rank's tokens reach the experts held here
            torch.testing.assert_close(grad, ref["grads"][name][lo:hi], rtol=1e-5, atol=1e-6)
    if starve:  # expert 1 got no token: its weights got a zero gradient, not none and not garbage
        holder = next(r for r in results if r["range"][0] <= 1 < r["range"][1])
        assert all(g[1 - holder["range"][0]].abs().max() == 0 for g in holder["grads"].values())


def test_experts_that_do_not_split_over_the_group_are_refused():
    class Comm:
        size, rank = 3, 0

    with pytest.raises(ConfigError, match="4 experts, which do not split over an expert-parallel group of 3"):
        shard_experts(_experts(4, "eager"), Comm(), "model.layers.0.mlp.experts")


def _idle_rank(implementation: str) -> dict:
    """Rank 1 holds no token and every token of rank 0 picks rank 0's experts: rank 1 receives no row."""
    comm = Communicator(dist.group.WORLD, timeout_s=60.0)
    experts = _experts(4, implementation)
    shard_experts(experts, comm)
    rows = TOKENS if dist.get_rank() == 0 else 0
    x = torch.randn(rows, HIDDEN, requires_grad=True)
    idx = torch.tensor([[0, 1]] * rows, dtype=torch.long).reshape(rows, TOP_K)
    w = torch.full((rows, TOP_K), 0.5)
    experts(x, idx, w).sum().backward()
    return {k: p.grad for k, p in experts.named_parameters()}


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_a_rank_that_receives_no_row_gets_zero_expert_gradients(implementation):
    # every rank's expert weights get a gradient in every backward (zero where no row arrived), whatever the
    # implementation does with no row: tensor parallelism's check compares them in the same backward on each rank
    grads = run_distributed(_idle_rank, 2, implementation)
    assert all(g is not None and g.abs().max() > 0 for g in grads[0].values())
    assert grads[1] and all(g is not None and g.abs().max() == 0 for g in grads[1].values())
