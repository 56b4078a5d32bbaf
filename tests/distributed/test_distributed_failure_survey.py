"""The failure survey of [Note: naming the rank that vanished] on hand-filled stores: who failed first by the
store's record when rank 0 (the store's host) is among the dead, what is said when the store is gone, and who hosts
it. The end-to-end kills are tests/reliability/test_reliability_rank_death.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist

from shardtrain.distributed import failure


@pytest.fixture
def store(monkeypatch) -> dist.HashStore:
    store = dist.HashStore()
    monkeypatch.setattr(failure, "_default_store", lambda: store)
    monkeypatch.setattr(failure, "_surveys", {})
    monkeypatch.setattr(failure, "_known", {})
    monkeypatch.setattr(failure, "REPORT_WAIT_S", 0.3)
    return store


def _exited_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", ""])
    done.wait()
    return done.pid


def _proc(pid: int) -> dict:
    return {"host": "h", "machine": failure._machine_id(), "pid": pid}


def test_a_failure_key_holds_the_time_and_a_rank_found_gone_is_recorded_for_the_others(store):
    dead = _exited_pid()
    store.set("shardtrain/proc/2", json.dumps(_proc(dead)))
    survey = failure.survey(0, [2])
    assert survey.gone == [(2, f"pid {dead} on h")]
    pid, when = store.get("shardtrain/failed/0").decode().split()
    assert pid == str(os.getpid()) and float(when) > 0
    record = json.loads(store.get("shardtrain/gone/2"))
    assert record["by"] == 0 and record["pid"] == dead


def test_rank_0_among_the_dead_the_store_record_names_who_failed_first(store, monkeypatch):
    """World 3: rank 2 killed; rank 0 found it gone, reported its own failure and exited (taking its store with it
    later). Rank 1 reads the record while the store is up: rank 2 failed first, rank 0 after."""
    dead2, dead0 = _exited_pid(), _exited_pid()
    store.set("shardtrain/proc/0", json.dumps(_proc(dead0)))
    store.set("shardtrain/proc/2", json.dumps(_proc(dead2)))
    store.set("shardtrain/failed/0", f"{dead0} 1000.5")
    store.set("shardtrain/gone/2", json.dumps({"by": 0, "time": 1000.6, "pid": dead2}))
    survey = failure.survey(1, [0, 2])
    assert survey.reported == [0] and survey.gone == [(2, f"pid {dead2} on h")]
    assert survey.first() == (2, "rank 0 found it gone")  # found after rank 0 failed, yet it went first
    lost, text = failure.explain(survey)
    assert lost and "by the store's record rank 2 failed first (rank 0 found it gone)" in text, text
    assert "rank(s) [0] failed in the same way" in text


def test_a_gone_record_of_another_process_is_left_from_an_earlier_attempt(store):
    store.set("shardtrain/proc/2", json.dumps(_proc(os.getppid())))  # alive
    store.set("shardtrain/gone/2", json.dumps({"by": 0, "time": 1.0, "pid": 4194304}))
    survey = failure.survey(1, [2])
    assert survey.alive == [(2, f"pid {os.getppid()} on h")] and not survey.gone


class _GoneStore:
    """A store whose host (rank 0) has exited."""

    port = 29500

    def set(self, key, value):
        raise dist.DistNetworkError("Connection reset by peer")

    check = get = compare_set = set


def test_without_the_store_a_running_rank_is_not_said_to_have_not_failed(monkeypatch):
    """World 3, rank 0 killed: rank 1 cannot reach the store; rank 2 still runs (it fails a few ms later). Rank 1
    names rank 0 gone as the store's host and says what it cannot know of rank 2."""
    monkeypatch.setattr(failure, "_default_store", lambda: _GoneStore())
    monkeypatch.setattr(failure, "_surveys", {})
    dead = _exited_pid()
    monkeypatch.setattr(failure, "_known", {0: _proc(dead), 2: _proc(os.getppid())})
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # under torchrun
    monkeypatch.setenv("MASTER_PORT", "29400")  # the agent's port: not the store's (rank 0's own, attempt_store)
    survey = failure.survey(1, [0, 2])
    assert survey.gone == [(0, f"pid {dead} on h")] and survey.unknown == [(2, f"pid {os.getppid()} on h")]
    assert not survey.alive
    lost, text = failure.explain(survey)
    assert lost and "so the process hosting it is gone: rank 0, which hosts it" in text, text
    assert "torchrun agent" not in text and "did not fail" not in text and "had not reported" not in text
    assert f"rank 2 (pid {os.getppid()} on h) still ran when the store went away" in text
    assert f"rank 0 (pid {dead} on h) is gone: killed" in text


def test_the_store_host_is_the_agent_only_when_the_group_uses_the_agents_store(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert failure.store_host(_GoneStore()).startswith("rank 0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert failure.store_host(_GoneStore()).startswith("the torchrun agent")
    prefixed = dist.PrefixStore("pg", dist.HashStore())  # no port anywhere: shardtrain's own
    assert failure.store_host(prefixed).startswith("rank 0")
    monkeypatch.setenv("MASTER_PORT", "29401")
    assert failure.store_host(_GoneStore()).startswith("rank 0")


def test_an_alive_rank_is_described_by_what_was_known_when_the_survey_ended(store):
    store.set("shardtrain/proc/1", json.dumps(_proc(os.getppid())))
    survey = failure.survey(0, [1])
    lost, text = failure.explain(survey)
    assert not lost and survey.waited_s >= 0.3  # REPORT_WAIT_S here
    assert f"rank 1 (pid {os.getppid()} on h) is alive and had not reported a failure 0." in text, text


def test_a_stopped_rank_of_this_machine_is_named_as_stopped(store):
    """A peer stopped with SIGSTOP (not the store's host: the store answers) is named as stopped, not as alive and
    busy."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        store.set("shardtrain/proc/1", json.dumps(_proc(sleeper.pid)))
        survey = failure.survey(0, [1])
        lost, text = failure.explain(survey)
        assert survey.stopped == [(1, f"pid {sleeper.pid} on h")] and not survey.alive
        assert lost and f"rank 1 (pid {sleeper.pid} on h) is stopped (SIGSTOP or a debugger)" in text, text
    finally:
        sleeper.kill()
        sleeper.wait()
