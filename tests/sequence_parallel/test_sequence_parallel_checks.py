"""The agreement checks know the sequence axis: the batch check tells the sp group whose ranks got different batches
apart from the groups that got theirs right, and the desync check names each rank by its (dp, sp) coordinates."""

from __future__ import annotations

import torch

import shardtrain
from shardtrain.errors import RankMismatchError
from shardtrain.testing import run_distributed
from test_sequence_parallel_tp import ROWS, SEQ, batches, loss_of, model_of, optimizer_of

SP = 2  # world 4: (dp 2, sp 2); rank 3 is (dp 1, sp 1)


def _engine():
    model = model_of("gpt")
    config = {"train_micro_batch_size_per_gpu": ROWS, "sequence_parallel_size": SP, "zero_optimization": {"stage": 1}}
    return shardtrain.initialize(model, config=config, optimizer=optimizer_of(model))


def _outcome(fn) -> str:
    try:
        fn()
        return "no error"
    except RankMismatchError as err:
        return str(err)


def checks() -> dict[str, str]:
    out = {}
    engine = _engine()
    topo = engine.topology
    rank = topo.rank
    x, y = batches(topo.dp)[0]
    x, y = x[topo.dp_rank * ROWS : (topo.dp_rank + 1) * ROWS], y[topo.dp_rank * ROWS : (topo.dp_rank + 1) * ROWS]
    wrong = torch.roll(x, 1, dims=0) if rank == 3 else x  # rank 3 got its group's rows in another order
    out["batch"] = _outcome(lambda: loss_of("gpt", engine, wrong, y))  # ranks 0 and 1 run their forward

    engine = _engine()  # a desync: rank 3 saves a full state dict while the others go on training
    loss = loss_of("gpt", engine, x, y)
    engine.backward(loss)
    engine.step()
    if rank == 3:
        out["desync"] = _outcome(engine.full_state_dict)
    else:
        out["desync"] = _outcome(lambda: loss_of("gpt", engine, x, y))

    engine = _engine()  # a later batch of another length on one rank: refused before the all-to-alls pair it
    short = x[:, : SEQ - 2] if rank == 3 else x
    loss_of("gpt", engine, x, y).detach()
    out["shape"] = _outcome(lambda: engine(short, y[:, : short.shape[1]]))
    return out


def test_the_checks_name_the_sequence_parallel_group_and_ranks():
    results = run_distributed(checks, 2 * SP, init_process_group=False)
    assert [r["batch"] for r in results[:2]] == ["no error", "no error"]  # the group of dp rank 0 got the same rows
    for r in results[2:]:
        assert "but sp rank 1 (global rank 3) got inputs different from sp rank 0 (global rank 2)" in r["batch"]
        assert "its group: global ranks [2, 3]" in r["batch"]
        assert "input args[0] (torch.int64 [2, 12]) holds different values on sp rank 0 and sp rank 1" in r["batch"]
    for r in results:  # every rank raises the same error, naming rank 3 by its place in the mesh
        assert (
            "full_state_dict() is collective: rank 3 (dp 1, sp 1) called it and rank 0 (dp 0, sp 0), rank 1 "
            in (r["desync"])
        ), r["desync"]
    assert [r["shape"] for r in results[:2]] == ["no error", "no error"]
    for r in results[2:]:
        assert "sequence-parallel group were given batches of different shapes" in r["shape"], r["shape"]
        assert (
            "sp rank 0 (global rank 2): [rows, seq] [2, 12], sp rank 1 (global rank 3): [rows, seq] [2, 10]"
            in (r["shape"])
        )
