"""Probes while a wait blocks the host ([Note: probes while waiting] in shardtrain.distributed.communicator): a gloo
wait runs in slices while a probe is registered, completes with the same result, and ends with a probe's error."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shardtrain.distributed import wait_probes
from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import RankMismatchError
from shardtrain.testing import run_distributed


def _late_peer(raise_after: int | None) -> dict:
    """Rank 1 joins an all-gather 1.5 s late; rank 0 waits with a probe registered."""
    comm = Communicator(dist.group.WORLD, timeout_s=30)
    calls: list[float] = []

    def probe() -> None:
        calls.append(time.monotonic())
        if raise_after is not None and len(calls) >= raise_after:
            raise RankMismatchError("rank 1 will never join this gather")

    if dist.get_rank() == 1:
        time.sleep(1.5)
    out = torch.empty(2 * 3)
    mine = torch.full((3,), float(dist.get_rank() + 1))
    wait_probes.add_wait_probe(probe)
    try:
        handle = comm.all_gather(out, mine, what="a test tensor", async_op=True)
        try:
            handle.wait()
            error = None
        except RankMismatchError as err:
            error = str(err)
    finally:
        wait_probes.remove_wait_probe(probe)
    refused = None
    if error is not None:
        try:
            comm.all_reduce(torch.ones(1), what="after the probe's error")
        except RankMismatchError as err:
            refused = str(err)
        time.sleep(2.0)  # rank 1 joins the gather still in flight meanwhile
    return {"out": out.tolist(), "probes": len(calls), "error": error, "refused": refused}


def test_a_sliced_wait_gives_the_same_result_and_runs_the_probes():
    r0, r1 = run_distributed(_late_peer, 2, None)
    assert r0["out"] == r1["out"] == [1.0] * 3 + [2.0] * 3
    assert r0["error"] is None and r0["probes"] >= 2  # 1.5 s late: a probe every 0.5 s of waiting
    assert r1["probes"] == 0  # a wait that completes within its first slice runs none


def test_a_probe_error_ends_the_wait_and_no_collective_follows_on_the_group():
    r0, _ = run_distributed(_late_peer, 2, 1)
    assert r0["error"] == "rank 1 will never join this gather" and r0["probes"] == 1
    assert r0["refused"] is not None and "not issued, since an earlier collective of this group failed" in r0["refused"]
    assert "rank 1 will never join this gather" in r0["refused"]
