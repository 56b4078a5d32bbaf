"""The reduce-scatter ``Communicator`` uses on gloo: exact results and the bytes it really puts on the wire.

See [Note: bytes on the wire] in ``shardtrain.distributed.communicator``. The results are compared with a sum computed
here from every rank's input (each rank rebuilds all inputs from their seeds) in rank order, which is the order the
pairwise exchange promises, so they must match bit for bit. The bytes are read from the loopback interface's transmit
counter in ``/proc/net/dev`` around each collective: whatever else runs on the machine can only add bytes, so the
smallest of a few trials is the collective's own traffic.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from shardtrain.distributed.communicator import Communicator
from shardtrain.testing import run_distributed

WIRE_NUMEL = 6 * 2**20  # 24 MiB of fp32: TCP/IP headers (~3%) and stray traffic stay small beside it


def _loopback_tx() -> int | None:
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == "lo":
                    return int(counters.split()[8])  # transmit bytes
    except OSError:
        pass
    return None


def _inputs(world: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)).to(dtype) for r in range(world)]


def _exactness_body(numel: int) -> dict:
    n, me = dist.get_world_size(), dist.get_rank()
    comm = Communicator(dist.group.WORLD, 60.0)
    out: dict = {"impl": comm.reduce_scatter_impl, "cases": []}
    for dtype in (torch.float32, torch.bfloat16):
        inputs = _inputs(n, numel, dtype)
        expected_sum = inputs[0].clone()
        for x in inputs[1:]:
            expected_sum += x  # rank order, in the input dtype
        mine = expected_sum.view(n, -1)[me]
        for op, async_op in (("sum", False), ("avg", True)):
            inp = inputs[me].clone()
            got = torch.full((numel // n,), float("nan"), dtype=dtype)
            handle = comm.reduce_scatter(got, inp, op, what="test", async_op=async_op)
            if handle is not None:
                handle.wait()
            want = mine if op == "sum" else mine / n
            out["cases"].append((str(dtype), op, torch.equal(got, want), torch.equal(inp, inputs[me])))
    # several in flight at once complete independently (each call has its own tag)
    inputs = [_inputs(n, numel, torch.float32) for _ in range(3)]
    outs = [torch.empty(numel // n) for _ in range(3)]
    handles = [comm.reduce_scatter(o, xs[me].clone(), "sum", what="test", async_op=True) for o, xs in zip(outs, inputs)]
    for h in reversed(handles):
        h.wait()
    out["in_flight"] = [torch.equal(o, sum(xs[1:], xs[0].clone()).view(n, -1)[me]) for o, xs in zip(outs, inputs)]
    out["stats"] = comm.stats()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_pairwise_reduce_scatter_is_exact_in_rank_order(world):
    numel = 6 * 1000
    for rank, r in enumerate(run_distributed(_exactness_body, world, numel)):
        assert r["impl"] == "pairwise"  # "auto" on gloo
        assert len(r["cases"]) == 4
        for dtype, op, equal, input_kept in r["cases"]:
            assert equal, f"rank {rank}: {op} in {dtype} differs from the rank-order sum"
            assert input_kept, f"rank {rank}: the input was modified"
        assert r["in_flight"] == [True, True, True]
        rs = r["stats"]["reduce_scatter"]
        # 4 single calls + 3 in flight; sent = the convention's bytes (mixed dtypes: count them per call)
        assert rs["calls"] == 7
        ring = lambda nbytes: nbytes * (world - 1) // world  # noqa: E731
        assert rs["bytes"] == rs["sent"] == 2 * ring(numel * 4) + 2 * ring(numel * 2) + 3 * ring(numel * 4)


def _wire_body(trials: int) -> dict:
    n = dist.get_world_size()
    comm = Communicator(dist.group.WORLD, 120.0)
    full = torch.ones(WIRE_NUMEL)
    chunk = torch.empty(WIRE_NUMEL // n)
    measured: dict[str, list[float]] = {"pairwise": [], "backend": [], "all_gather": []}
    stats: dict[str, dict] = {}

    def run(kind: str) -> None:
        if kind == "all_gather":
            comm.all_gather(full, chunk, what="test")
        else:
            comm.reduce_scatter_impl = kind
            comm.reduce_scatter(chunk, full, "sum", what="test")

    for kind in measured:
        run(kind)  # warm-up: connections for send/recv are set up on first use
    for _ in range(trials):
        for kind in measured:
            comm.reset_stats()
            dist.barrier()
            before = torch.tensor([_loopback_tx()], dtype=torch.float64)
            dist.barrier()
            run(kind)
            dist.barrier()
            after = torch.tensor([_loopback_tx()], dtype=torch.float64)
            dist.barrier()
            # every rank reads the same machine-wide counter: take rank 0's reading, per rank of the group
            dist.broadcast(before, 0)
            dist.broadcast(after, 0)
            measured[kind].append(float(after - before) / n)
            stats[kind] = comm.stats()
    return {"measured": measured, "stats": stats}


@pytest.mark.skipif(_loopback_tx() is None, reason="no loopback counters in /proc/net/dev on this system")
@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_bytes_on_the_wire(world):
    """Loopback bytes per rank of one reduce-scatter of 24 MiB: gloo's own moves an all-reduce's (2x the
    theoretical ``S (N-1)/N``), the pairwise one the theoretical bytes, like an all-gather measured in the same
    run; ``stats()["reduce_scatter"]["sent"]`` says which."""
    r = run_distributed(_wire_body, world, 3)[0]
    theory = WIRE_NUMEL * 4 * (world - 1) / world
    ratio = {kind: min(xs) / theory for kind, xs in r["measured"].items()}  # stray traffic only adds bytes
    assert 0.98 < ratio["all_gather"] < 1.10, ratio
    assert 0.98 < ratio["pairwise"] < 1.10, ratio
    assert abs(ratio["pairwise"] - ratio["all_gather"]) < 0.05, ratio
    assert 1.95 < ratio["backend"] < 2.20, ratio
    # what stats() reports as sent matches the wire (headers aside), and the convention stays the theory
    for kind in ("pairwise", "backend"):
        rs = r["stats"][kind]["reduce_scatter"]
        assert rs["bytes"] == theory
        assert 0.95 < min(r["measured"][kind]) / rs["sent"] < 1.10, (kind, rs)
    assert r["stats"]["all_gather"]["all_gather"]["sent"] == theory


def _mismatch_body() -> str:
    comm = Communicator(dist.group.WORLD, 30.0)
    try:
        comm.reduce_scatter(torch.empty(2), torch.ones(4), "max", what="test")
    except ValueError as err:
        return str(err)
    return "no error"


def test_pairwise_reduce_scatter_refuses_other_ops():
    assert all("'sum' or 'avg'" in m for m in run_distributed(_mismatch_body, 2))


@functools.cache
def _one_rank_stats() -> dict:
    return run_distributed(_exactness_body, 1, 12)[0]


def test_world_1_copies_and_counts_nothing_sent():
    r = _one_rank_stats()
    assert all(equal for _, _, equal, _ in r["cases"])
    assert r["stats"]["reduce_scatter"]["sent"] == 0


def _bad_name_body() -> str:
    try:
        Communicator(dist.group.WORLD, 30.0, reduce_scatter_impl="ring")
    except ValueError as err:
        return str(err)
    return "no error"


def test_bad_implementation_name_is_refused():
    assert "reduce_scatter_impl must be" in run_distributed(_bad_name_body, 1)[0]
