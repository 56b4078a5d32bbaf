"""Calls on a store whose host is stopped end within their limit ([Note: every wait on the store is bounded] in
shardtrain.distributed.store_calls): the calls themselves, and what waits on them: the failure survey, the NCCL
watchdog's probe and a ZeRO-3 departure's wait for answers. A real TCPStore served by a process stopped with SIGSTOP
(on torch 2.13 a plain ``check`` on it does not return: measured in the Note). The end-to-end runs (rank 0 stopped in
training, worlds 2 and 3) are tests/reliability/test_reliability_store_host.py."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from shardtrain.distributed import failure, store_calls, watchdog
from shardtrain.distributed.store_calls import BoundedStore, StoreSilentError
from shardtrain.errors import CollectiveTimeoutError
from shardtrain.zero import departure

LIMIT_S = 1.0
"""The collective timeout of these tests, and so the store calls' limit."""
SLACK_S = 0.8
"""What a loaded machine may add to a limit."""

_SERVE = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
store.set("shardtrain/proc/0", "{}")
print(store.port, flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def server():
    """A process serving a TCPStore (started once: it takes seconds to import torch); killed after the tests."""
    process = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True)
    try:
        process.port = int(process.stdout.readline())
        yield process
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait()


@pytest.fixture
def stopped(server, monkeypatch):
    """A new client of the server's store, and the server, stopped; resumed after the test, once the calls the test
    left silent have returned."""
    client = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=datetime.timedelta(seconds=LIMIT_S))
    monkeypatch.setattr(store_calls, "_timeout_s", LIMIT_S)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield client, server
    finally:
        os.kill(server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5  # the silent calls are answered now: their threads end
        while any(t.is_alive() for t, _ in store_calls._silent.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        store_calls._silent.clear()


def _host(client) -> str:
    return f"rank 0 (the store's host, 127.0.0.1:{client.port}) did not answer within {LIMIT_S:g} s"


def _timed(fn):
    start = time.monotonic()
    try:
        return fn(), time.monotonic() - start
    except Exception as err:
        return err, time.monotonic() - start


def test_a_call_on_a_stopped_store_ends_at_its_limit_and_later_calls_at_once_until_the_host_resumes(stopped):
    client, server = stopped
    store = BoundedStore(client)
    err, took = _timed(lambda: store.check(["shardtrain/proc/0"]))
    assert isinstance(err, StoreSilentError) and LIMIT_S <= took < LIMIT_S + SLACK_S, (err, took)
    assert str(err) == f"{_host(client)}: stopped, hung or unreachable"
    # the silent call still holds the client: every other call fails at once, with the same words
    for call in (lambda: store.get("k"), lambda: store.set("k", "v"), lambda: store.compare_set("k", "", "v"),
                 lambda: store.add("n", 1), lambda: BoundedStore(client).check(["k"])):  # fmt: skip
        err, took = _timed(call)
        assert isinstance(err, StoreSilentError) and took < 0.2 and str(err).startswith(_host(client)), (err, took)
    os.kill(server.pid, signal.SIGCONT)  # the host resumes: the silent call returns, and calls run again
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        value, took = _timed(lambda: store.check(["shardtrain/proc/0"]))
        if value is True:
            break
        time.sleep(0.05)
    assert value is True, value
    store.set("k", "v")
    assert store.get("k") == b"v" and store.add("n", 2) == 2


def test_the_failure_survey_and_the_watchdog_probe_name_a_stopped_store_host(stopped, monkeypatch):
    client, server = stopped
    monkeypatch.setattr(failure, "_default_store", lambda: client)
    monkeypatch.setattr(failure, "_surveys", {})
    me = failure.process_record()
    monkeypatch.setattr(failure, "_known", {0: {**me, "pid": server.pid, "started": None}})
    down, took = _timed(lambda: failure.peer_down(1, [0]))
    assert down is None and took < LIMIT_S + SLACK_S, (down, took)  # silence alone fails nothing: the timeout decides
    survey, took = _timed(lambda: failure.survey(1, [0]))
    assert took < LIMIT_S + SLACK_S and survey.store_silent, (survey, took)
    lost, text = failure.explain(survey)
    assert lost and f"the rendezvous store does not answer: {_host(client)}: stopped, hung or unreachable" in text
    assert f"rank 0 (pid {server.pid} on {me['host']}) is stopped (SIGSTOP or a debugger)" in text, text


class _Issuer:
    """A Communicator as the watchdog sees it: global rank 1 of a group with rank 0 (the store's host)."""

    timeout_s = watch_timeout_s = 1.5
    global_rank = 1

    def peers(self) -> list[int]:
        return [0]

    def describe_failure(self, kind, what, err, *, started=None, frame=None):
        return CollectiveTimeoutError(f"rank 1: {kind} of {what} timed out: {err}")


def test_the_watchdog_reports_at_the_timeout_when_the_store_host_is_stopped(stopped, monkeypatch):
    client, _ = stopped
    monkeypatch.setattr(failure, "_default_store", lambda: client)
    reports: list[str] = []
    dog = watchdog.Watchdog(failure.peer_down, reports.append, poll_s=0.05, probe_s=0.1)
    dog.track(_Never(), _Issuer(), "all_reduce", "a test tensor", time.monotonic())
    start = time.monotonic()
    while not reports and time.monotonic() - start < 10:
        dog.check()  # the thread's loop body; it is no longer held in the store
        time.sleep(0.05)
    took = time.monotonic() - start
    assert reports and "not completed after" in reports[0] and took < _Issuer.timeout_s + LIMIT_S + SLACK_S, took


class _Never:
    def is_completed(self) -> bool:
        return False


class _Comm:
    """A Communicator as a departure sees it: global rank 1 of a group with rank 0."""

    global_rank = 1

    def __init__(self) -> None:
        self.broken: list[Exception] = []

    def peers(self) -> list[int]:
        return [0]

    def break_group(self, err) -> None:
        self.broken.append(err)


def test_a_departure_waits_for_answers_until_the_collective_timeout_and_names_the_stopped_store_host(
    stopped, monkeypatch
):
    client, _ = stopped
    monkeypatch.setattr(failure, "_default_store", lambda: client)
    comm = _Comm()
    agreement = departure.OrderAgreement([comm], ["blocks.0", "blocks.1"], timeout_s=2.0)
    agreement.begin("forward", [0, 1])
    err, took = _timed(lambda: agreement.declare(0, 1))
    assert isinstance(err, CollectiveTimeoutError) and 2.0 <= took < 2.0 + LIMIT_S + SLACK_S, (err, took)
    assert f"the rendezvous store does not answer: {_host(client)}" in str(err), err
    assert comm.broken == [err]
