"""The collectives graph-mode ZeRO-3 traces into its graphs (see [Note: collectives in graphs] in
``shardtrain.distributed.communicator``): the reduce-scatter averages on the wire where the backend can, as eager mode
does, so that fp16 gradients whose sum overflows but whose average does not are reduced to the same finite values."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from shardtrain.distributed.communicator import Communicator, graph_reduce_op
from shardtrain.testing import run_distributed


def test_the_graph_reduce_scatter_averages_on_the_wire_where_the_backend_can():
    assert graph_reduce_op("nccl") == "avg"  # ReduceOp.AVG, what eager passes
    assert graph_reduce_op("gloo") == "sum"  # gloo's reduce-scatter has no AVG (and gloo uses the pairwise path)
    assert graph_reduce_op("mpi") == "sum"


def _traced(backend: str, impl: str) -> list[tuple[str, tuple]]:
    """The ops of ``graph_reduce_scatter_avg`` traced on fake tensors (nothing is sent), for a group whose backend
    reports ``backend``: the decision is read from the communicator, so it is checked here without NCCL."""
    comm = Communicator(dist.group.WORLD, 30.0, impl)
    comm.backend = backend
    gm = make_fx(lambda full: comm.graph_reduce_scatter_avg(full), tracing_mode="fake")(
        torch.ones(8, dtype=torch.float16)
    )
    return [(str(n.target), tuple(a for a in n.args if isinstance(a, str))) for n in gm.graph.nodes
            if n.op == "call_function"]  # fmt: skip


def _traced_cases() -> list[list[tuple[str, tuple]]]:
    return [_traced("nccl", "backend"), _traced("gloo", "backend"), _traced("gloo", "auto")]


def test_the_traced_reduce_scatter_uses_avg_on_nccl_and_keeps_the_pairwise_sum_on_gloo():
    nccl, gloo_backend, gloo = run_distributed(_traced_cases, 2)[0]
    rs = "_c10d_functional.reduce_scatter_tensor.default"
    assert [args[0] for op, args in nccl if op == rs] == ["avg"], nccl
    assert not any("div" in op for op, _ in nccl), nccl  # averaged by NCCL, not divided afterwards
    assert [args[0] for op, args in gloo_backend if op == rs] == ["sum"], gloo_backend
    assert any("div" in op for op, _ in gloo_backend), gloo_backend
    # gloo's default: the pairwise exchange (all-to-all, rank-order sum, divide), bitwise eager ZeRO-3
    assert any("all_to_all_single" in op for op, _ in gloo) and not any(op == rs for op, _ in gloo), gloo


def _fp16_reduce() -> tuple[torch.Tensor, torch.Tensor]:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    comm = Communicator(dist.group.WORLD, 60.0)
    full = torch.full((8,), 40000.0 + rank, dtype=torch.float16, device="cuda")  # the sum overflows fp16
    eager = torch.empty(4, dtype=torch.float16, device="cuda")
    comm.reduce_scatter(eager, full, "avg", what="fp16 overflow test")
    graph = torch.compile(comm.graph_reduce_scatter_avg, backend="aot_eager")(full)
    return eager.cpu(), graph.cpu()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL at world 2 needs two GPUs")
def test_fp16_gradients_whose_sum_overflows_reduce_like_eager_on_nccl():
    for eager, graph in run_distributed(_fp16_reduce, 2, init_process_group=False, timeout=300):
        assert torch.isfinite(graph).all() and torch.equal(graph, eager), (graph, eager)
