"""A rank killed with SIGKILL (as the OOM killer does) in forward, backward or the optimizer step, at every ZeRO
stage and with tensor parallelism (tp=2: forward and backward then hold the tensor-parallel all-reduces and
all-gathers too; world 2, and world 4 = dp 2 x tp 2): every survivor stops within seconds with a PeerLostError that
names the killed rank and what the survivor was doing, without calling it a timeout, and no process is left behind.
A rank killed in save_checkpoint is tests/reliability/test_reliability_save_crash.py (every point of the save, every
stage, worlds 2 and 3; with tensor parallelism: one point here).

The full matrices (every stage, point, world and killed rank, save included) are marked ``soak``: ``pytest -m
soak tests/reliability/test_reliability_rank_death.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from shardtrain.distributed import failure
from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import PeerLostError
from shardtrain.testing import run_ranks

from helpers.reliability import arm, check_rank_death, die
from helpers.resume import make_engine, train
from helpers.tp_cases import Case, build_engine, forward_engine, global_batches

POINTS = ["forward", "backward", "step", "save"]


def _train_until_killed(stage: int, victim: int, point: str, root: str) -> None:
    engine = make_engine(0, stage, "adamw")
    train(engine, range(1))
    if dist.get_rank() == victim:
        arm(engine, "tensor_file_written" if point == "save" else point)
    train(engine, range(1, 3))
    engine.save_checkpoint(root)


# every stage and point once; worlds 2 and 3 alternate, so that each stage and each point meets both; the killed
# rank rotates over every rank (rank 0 hosts the rendezvous store here: the others must still name it)
CASES = [
    (stage, point, world, (stage + i // 2) % world)
    for stage in range(4)
    for i, point in enumerate(POINTS[:3])
    for world in [3 if (stage + i) % 2 == 0 else 2]
]
FULL = [(s, p, world, victim) for s in range(4) for p in POINTS for world in (2, 3) for victim in range(world)]


@pytest.mark.parametrize(("stage", "point", "world", "victim"), CASES)
def test_survivors_name_the_killed_rank(tmp_path, stage, point, world, victim):
    outcomes = run_ranks(_train_until_killed, world, stage, victim, point, str(tmp_path), timeout=60)
    check_rank_death(outcomes, victim)


def _train_tp_until_killed(stage: int, victim: int, point: str, root: str) -> None:
    case = Case(gas=1, micro=2)
    engine = build_engine(case, stage, tp=2)
    batches = global_batches(case, engine.topology.dp, steps=3)
    lo, hi = engine.topology.dp_rank * case.micro, (engine.topology.dp_rank + 1) * case.micro
    for step, (x, y) in enumerate(batches):  # no collective of the test's own: every one is the engine's
        if step == 1 and dist.get_rank() == victim:
            arm(engine, "tensor_file_written" if point == "save" else point)
        engine.backward(forward_engine(engine, x[lo:hi], y[lo:hi]))
        engine.step()
    engine.save_checkpoint(root)


# tp=2: each point once at world 2 (dp 1), the victim and stage rotating; world 4 (dp 2 x tp 2) once, in backward
# where a survivor may be in a tensor-parallel all-reduce (its tp peer died) or a ZeRO reduction (its dp peer died)
TP_CASES = [(1 + i % 3, point, 2, i % 2) for i, point in enumerate(POINTS)] + [(3, "backward", 4, 3)]
TP_FULL = [(s, p, world, v) for s in range(4) for p in POINTS for world in (2, 4) for v in range(world)]


@pytest.mark.parametrize(("stage", "point", "world", "victim"), TP_CASES)
def test_survivors_name_the_killed_rank_tensor_parallel(tmp_path, stage, point, world, victim):
    outcomes = run_ranks(_train_tp_until_killed, world, stage, victim, point, str(tmp_path), timeout=90)
    check_rank_death(outcomes, victim, tp=2)


@pytest.mark.soak
@pytest.mark.parametrize(("stage", "point", "world", "victim"), TP_FULL)
def test_survivors_name_the_killed_rank_tensor_parallel_full_matrix(tmp_path, stage, point, world, victim):
    outcomes = run_ranks(_train_tp_until_killed, world, stage, victim, point, str(tmp_path), timeout=120)
    check_rank_death(outcomes, victim, tp=2)


@pytest.mark.soak
@pytest.mark.parametrize(("stage", "point", "world", "victim"), FULL)
def test_survivors_name_the_killed_rank_full_matrix(tmp_path, stage, point, world, victim):
    outcomes = run_ranks(_train_until_killed, world, stage, victim, point, str(tmp_path), timeout=60)
    check_rank_death(outcomes, victim)


def _train_until_killed_logging(stage: int, victim: int, point: str, root: str) -> None:
    """:func:`_train_until_killed`, writing to ``root/rank<r>.json`` each reduction this rank launched, each send it
    posted and each failure it met, in order."""
    events: list[list] = []
    isend, reduce_scatter, describe = dist.isend, Communicator.reduce_scatter, Communicator.describe_failure

    def logged_isend(tensor, dst, group=None, tag=0):
        events.append(["send", tag, tensor.numel()])
        return isend(tensor, dst, group=group, tag=tag)

    def logged_reduce_scatter(self, out, inp, op="sum", *, what, async_op=False):
        events.append(["launch", what])
        return reduce_scatter(self, out, inp, op, what=what, async_op=async_op)

    def logged_describe(self, kind, what, err, **kwargs):
        events.append(["failed", what])
        return describe(self, kind, what, err, **kwargs)

    dist.isend, Communicator.reduce_scatter, Communicator.describe_failure = (
        logged_isend,
        logged_reduce_scatter,
        logged_describe,
    )
    try:
        _train_until_killed(stage, victim, point, root)
    finally:
        with open(os.path.join(root, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(events, f)


def test_no_collective_after_a_failed_one(tmp_path):
    """ZeRO-2, world 3, rank 1 killed in backward (the case of [Note: no collective after a failure] in
    shardtrain.distributed.communicator): once a reduction failed, a survivor issued one more from the end of backward
    (the bucket whose launch raised, again, under the next tag), which the other survivor, failed one bucket apart,
    could take for another bucket's: gloo then aborted it (SIGABRT, "op.preamble.length <= op.nbytes") about one run in
    two. Now nothing is launched or sent after a rank's first failure."""
    outcomes = run_ranks(_train_until_killed_logging, 3, 2, 1, "backward", str(tmp_path), timeout=60)
    check_rank_death(outcomes, 1)
    for rank in (0, 2):
        events = json.loads((tmp_path / f"rank{rank}.json").read_text())
        first = next(i for i, e in enumerate(events) if e[0] == "failed")
        after = [e for e in events[first:] if e[0] != "failed"]
        assert not after, (rank, events[first - 4 :])


def _lose_the_peer_then_call_again() -> tuple[str, list[str]]:
    comm = Communicator(dist.group.WORLD, 60.0)
    t = torch.ones(6)
    comm.all_reduce(t, what="a first all-reduce")  # both ranks registered and known
    if dist.get_rank() == 1:
        die()
    with pytest.raises(PeerLostError) as first:
        comm.all_reduce(t, what="the all-reduce that fails")
    dist.isend = dist.irecv = dist.all_reduce = dist.all_gather_object = None  # nothing below may reach gloo
    refused = []
    for call in (
        lambda: comm.reduce_scatter(torch.empty(3), t, what="a reduce-scatter", async_op=True),
        lambda: comm.all_reduce(t, what="an all-reduce"),
        lambda: comm.all_gather_object(1, what="an object"),
    ):
        with pytest.raises(PeerLostError) as err:
            call()
        refused.append(str(err.value))
    return str(first.value), refused


def test_a_group_whose_collective_failed_issues_no_other():
    """[Note: no collective after a failure]: every later collective of the group raises at once, with the first
    failure's class and text (naming the lost rank), and reaches no backend call."""
    outcome = run_ranks(_lose_the_peer_then_call_again, 2, timeout=60)[0]
    assert outcome.error is None, outcome.error
    first, refused = outcome.value
    assert "rank 1 (pid " in first and "is gone: killed" in first, first
    for text, what in zip(refused, ["reduce_scatter of a reduce-scatter", "all_reduce of an all-reduce",
                                    "all_gather_object of an object"]):  # fmt: skip
        assert text.startswith(f"rank 0: {what} not issued, since an earlier collective of this group failed"), text
        assert text.endswith(first.removeprefix("rank 0: ")), text


def test_survey_classifies_every_rank_and_ignores_an_earlier_attempts_keys(monkeypatch):
    """The classification of [Note: naming the rank that vanished], on a store filled by hand."""
    store = dist.HashStore()
    monkeypatch.setattr(failure, "_default_store", lambda: store)
    monkeypatch.setattr(failure, "_surveys", {})
    monkeypatch.setattr(failure, "REPORT_WAIT_S", 0.3)
    exited = subprocess.Popen([sys.executable, "-c", ""])
    exited.wait()
    here, alive = failure._machine_id(), os.getppid()

    def register(rank: int, pid: int, machine: str = here, host: str = "this-host") -> None:
        store.set(f"shardtrain/proc/{rank}", json.dumps({"host": host, "machine": machine, "pid": pid}))

    register(1, exited.pid)  # gone
    register(2, alive)
    store.set("shardtrain/failed/2", str(alive))  # failed in the same way
    register(3, alive)
    store.set("shardtrain/failed/3", "4194304")  # a failure key left by the previous attempt's process: ignored
    register(4, 1, machine="elsewhere", host="node-b")  # another machine, no report
    survey = failure.survey(0, [1, 2, 3, 4, 5])  # rank 5 never registered
    assert survey.gone == [(1, f"pid {exited.pid} on this-host")]
    assert survey.reported == [2]
    assert survey.alive == [(3, f"pid {alive} on this-host")]
    assert survey.silent == [(4, "node-b"), (5, "unknown host")]
    lost, text = failure.explain(survey)
    assert lost and text.startswith(f"rank 1 (pid {exited.pid} on this-host) is gone: killed")
    pid, when = store.get("shardtrain/failed/0").decode().split()  # rank 0 reported its own failure, and when
    assert pid == str(os.getpid()) and float(when) > 0


class _GoneStore:
    """A store whose host has exited."""

    def set(self, key, value):
        raise dist.DistNetworkError("Broken pipe")

    check = get = set


def test_without_the_store_the_peers_read_earlier_still_tell_who_is_gone(monkeypatch):
    monkeypatch.setattr(failure, "_default_store", lambda: _GoneStore())
    monkeypatch.setattr(failure, "_surveys", {})
    exited = subprocess.Popen([sys.executable, "-c", ""])
    exited.wait()
    here = failure._machine_id()
    known = {r: {"host": "h", "machine": here, "pid": pid} for r, pid in ((1, exited.pid), (2, os.getppid()))}
    monkeypatch.setattr(failure, "_known", known)
    survey = failure.survey(0, [1, 2])
    assert survey.store_error == "DistNetworkError: Broken pipe"
    # rank 2 still runs: without the store it may be failing too, so it is not said to be alive and well
    assert survey.gone == [(1, f"pid {exited.pid} on h")] and survey.unknown == [(2, f"pid {os.getppid()} on h")]
    lost, text = failure.explain(survey)
    assert lost and "the rendezvous store no longer answers (DistNetworkError: Broken pipe)" in text
    assert f"rank 1 (pid {exited.pid} on h) is gone: killed" in text
