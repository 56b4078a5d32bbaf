"""A frozen store host: rank 0, which hosts the rendezvous store, stopped with SIGSTOP (a hung host, a debugger, a page
storm) while the other ranks wait for it in a collective. Each of them names rank 0 as the store's host within
``collective_timeout_s`` plus the store's answer limit ([Note: every wait on the store is bounded] in
shardtrain.distributed.store_calls). Before, a rank waited in a store call until rank 0 came back: in the ZeRO-3
unit-order probe that runs while a collective waits, or in the failure survey after the collective's timeout.

Rank 0 stops itself after two steps: at ZeRO-3 in the third forward, so that the others wait in a gather, whose wait
runs the unit-order probe ([Note: probes while waiting]); at ZeRO-1 before it, so that they wait in a synchronous
collective, where no probe runs, and meet the store in the failure survey after the collective timeout. The test
kills rank 0 once every other rank has exited (a process finalizing as rank 0 dies could abort: the Note's limit)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import shardtrain
from shardtrain.distributed import failure
from shardtrain.errors import ShardtrainError
from shardtrain.testing import run_ranks

from helpers.resume import ROWS, ResumeNet, make_optimizer, train

TIMEOUT_S = 3.0
"""The collective timeout; the store's answer limit is the same here (it is at most 10 s)."""
BOUND_S = 2 * TIMEOUT_S + 0.5 + 2.0
"""collective timeout + answer limit + a probe's slice + 2 s for a loaded machine."""


def _freeze_rank_0(stage: int, root: str) -> dict:
    Path(root, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    model = ResumeNet(0)
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20},
        "collective_timeout_s": TIMEOUT_S,
    }
    engine = shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, "adamw"))
    train(engine, range(2))  # at ZeRO-3 the unit order is trusted from here on: its probe runs in every gather's wait

    def freeze(*args) -> None:
        Path(root, "frozen").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)  # never resumed: the test kills it

    if dist.get_rank() == 0 and stage == 3:  # the others wait in a gather, which runs the probe
        engine.module.blocks[0].register_forward_pre_hook(freeze, prepend=True)  # before its gathers
    elif dist.get_rank() == 0:  # the others wait in a synchronous collective: no probe runs
        freeze()
    try:
        train(engine, range(2, 4))
    except ShardtrainError as err:
        after_s = time.time() - float(Path(root, "frozen").read_text())
        return {"after_s": after_s, "error": f"{type(err).__name__}: {err}", "port": os.environ["MASTER_PORT"]}
    return {"after_s": None, "error": None}


def _kill_rank_0_when_the_others_exited(root: Path, world: int, limit_s: float, ended: threading.Event) -> None:
    """Wait until rank 0 froze and every other rank has exited (at most ``limit_s`` after the freeze), then kill
    rank 0; nothing to do when the run ``ended`` before rank 0 froze."""
    while not (root / "frozen").exists():
        if ended.wait(0.05):
            return
    frozen = time.monotonic()
    pids = {r: int((root / f"pid{r}").read_text()) for r in range(world) if (root / f"pid{r}").exists()}
    others = [pid for r, pid in pids.items() if r != 0]
    while time.monotonic() - frozen < limit_s:
        if all(failure._process_gone(pid) for pid in others):
            break
        time.sleep(0.05)
    if 0 in pids:
        with contextlib.suppress(ProcessLookupError):  # the harness killed it at its timeout
            os.kill(pids[0], signal.SIGKILL)


@pytest.mark.parametrize(("stage", "world"), [(3, 2), (3, 3), (1, 2), pytest.param(1, 3, marks=pytest.mark.soak)])
def test_a_stopped_store_host_is_named_within_the_collective_timeout(tmp_path, stage, world):
    ended = threading.Event()
    killer = threading.Thread(target=_kill_rank_0_when_the_others_exited, args=(tmp_path, world, BOUND_S + 20, ended))
    killer.start()
    try:
        outcomes = run_ranks(_freeze_rank_0, world, stage, str(tmp_path), timeout=90)
    finally:
        ended.set()
        killer.join()
    assert outcomes[0].exitcode == -signal.SIGKILL, outcomes[0]
    for o in outcomes[1:]:
        assert o.value is not None, f"rank {o.rank}: {o.error or o}"
        error, after_s = o.value["error"], o.value["after_s"]
        assert error is not None, f"rank {o.rank} trained on with rank 0 stopped"
        assert error.startswith(f"CollectiveTimeoutError: rank {o.rank}: "), error
        host = f"rank 0 (the store's host, 127.0.0.1:{o.value['port']}) did not answer within {TIMEOUT_S:g} s"
        assert f"{host}: stopped, hung or unreachable" in error, error
        assert "rank 0 (pid " in error and "is stopped (SIGSTOP or a debugger)" in error, error
        assert after_s < BOUND_S, (o.rank, after_s, error)
        assert o.exitcode == 0, o  # it exited on its own, with the error returned
