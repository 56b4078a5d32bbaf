"""A rank killed with SIGKILL (as the OOM killer does) in forward, backward or the optimizer step, at every ZeRO
stage: every survivor stops within seconds with a PeerLostError that names the killed rank and what the survivor was
doing, without calling it a timeout, and no process is left behind. A rank killed in save_checkpoint is
tests/test_reliability_save_crash.py (every point of the save, every stage, worlds 2 and 3).

The full matrix (every stage, point, world 2 and 3 and killed rank, save included) is marked ``soak``: ``pytest -m
soak tests/test_reliability_rank_death.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from reliability_helpers import arm, check_rank_death
from resume_helpers import make_engine, train
from shardtrain import comm_failure
from shardtrain.testing import run_ranks

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


@pytest.mark.soak
@pytest.mark.parametrize(("stage", "point", "world", "victim"), FULL)
def test_survivors_name_the_killed_rank_full_matrix(tmp_path, stage, point, world, victim):
    outcomes = run_ranks(_train_until_killed, world, stage, victim, point, str(tmp_path), timeout=60)
    check_rank_death(outcomes, victim)


def test_survey_classifies_every_rank_and_ignores_an_earlier_attempts_keys(monkeypatch):
    """The classification of [Note: naming the rank that vanished], on a store filled by hand."""
    store = dist.HashStore()
    monkeypatch.setattr(comm_failure, "_default_store", lambda: store)
    monkeypatch.setattr(comm_failure, "_surveys", {})
    monkeypatch.setattr(comm_failure, "REPORT_WAIT_S", 0.3)
    exited = subprocess.Popen([sys.executable, "-c", ""])
    exited.wait()
    here, alive = comm_failure._machine_id(), os.getppid()

    def register(rank: int, pid: int, machine: str = here, host: str = "this-host") -> None:
        store.set(f"shardtrain/proc/{rank}", json.dumps({"host": host, "machine": machine, "pid": pid}))

    register(1, exited.pid)  # gone
    register(2, alive)
    store.set("shardtrain/failed/2", str(alive))  # failed in the same way
    register(3, alive)
    store.set("shardtrain/failed/3", "4194304")  # a failure key left by the previous attempt's process: ignored
    register(4, 1, machine="elsewhere", host="node-b")  # another machine, no report
    survey = comm_failure.survey(0, [1, 2, 3, 4, 5])  # rank 5 never registered
    assert survey.gone == [(1, f"pid {exited.pid} on this-host")]
    assert survey.reported == [2]
    assert survey.alive == [(3, f"pid {alive} on this-host")]
    assert survey.silent == [(4, "node-b"), (5, "unknown host")]
    lost, text = comm_failure.explain(survey)
    assert lost and text.startswith(f"rank 1 (pid {exited.pid} on this-host) is gone: killed")
    assert store.get("shardtrain/failed/0").decode() == str(os.getpid())  # rank 0 reported its own failure


class _GoneStore:
    """A store whose host has exited."""

    def set(self, key, value):
        raise dist.DistNetworkError("Broken pipe")

    check = get = set


def test_without_the_store_the_peers_read_earlier_still_tell_who_is_gone(monkeypatch):
    monkeypatch.setattr(comm_failure, "_default_store", lambda: _GoneStore())
    monkeypatch.setattr(comm_failure, "_surveys", {})
    exited = subprocess.Popen([sys.executable, "-c", ""])
    exited.wait()
    here = comm_failure._machine_id()
    known = {r: {"host": "h", "machine": here, "pid": pid} for r, pid in ((1, exited.pid), (2, os.getppid()))}
    monkeypatch.setattr(comm_failure, "_known", known)
    survey = comm_failure.survey(0, [1, 2])
    assert survey.store_error == "DistNetworkError: Broken pipe"
    assert survey.gone == [(1, f"pid {exited.pid} on h")] and survey.alive == [(2, f"pid {os.getppid()} on h")]
    lost, text = comm_failure.explain(survey)
    assert lost and "the rendezvous store no longer answers (DistNetworkError: Broken pipe)" in text
    assert f"rank 1 (pid {exited.pid} on h) is gone: killed" in text
