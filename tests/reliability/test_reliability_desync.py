"""Desync: one rank runs an extra micro-step, skips ``step()`` or calls ``full_state_dict()`` alone, at ZeRO stages
0-3 and with tensor parallelism. Every rank fails at once with a RankMismatchError that names each rank and where
it was ([Note: phase agreement] in src/shardtrain/desync.py), instead of hanging until the collective timeout,
pairing two unrelated collectives of equal size (a silently wrong sum) or aborting inside gloo.

The three kinds run one after the other in the same processes, each on a fresh engine (a desync error leaves the
process group usable: the check's all-gather completed), so that one spawn covers a layout.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.errors import CollectiveTimeoutError, RankMismatchError
from shardtrain.testing import run_ranks

from helpers.tp_cases import Case, config_for, forward_engine, global_batches, make_model, make_optimizer, plan_for

CASE = Case(gas=2, micro=2)
TIMEOUT_S = 15  # collective timeout: a case the check misses fails in 15 s instead of 30 minutes
LIMIT_S = 5.0  # each case's error must come this fast (measured: well under a second)
KINDS = ["extra_micro_step", "skipped_step", "skipped_step_mid_accumulation", "lone_full_state_dict"]


def _engine(stage: int, tp: int, check: bool = True, timeout: float = TIMEOUT_S):
    model = make_model(CASE)
    config = {**config_for(CASE, stage, tp), "collective_timeout_s": timeout, "desync_check": check}
    return shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, CASE.lr), tp_plan=plan_for(CASE))


def _micro(engine, i: int) -> None:
    """Micro-step ``i`` of the run: this data-parallel rank's rows of global micro-batch ``i``."""
    dp, dp_rank = engine.topology.dp, engine.topology.dp_rank
    x, y = global_batches(CASE, dp, steps=8)[i]
    lo, hi = dp_rank * CASE.micro, (dp_rank + 1) * CASE.micro
    loss = forward_engine(engine, x[lo:hi], y[lo:hi])
    engine.backward(loss)
    engine.step()


def _desync(engine, kind: str, victim: int, root: str) -> None:
    """Two micro-steps (one optimizer step) on every rank, then ``kind`` on ``victim``, then the rest of the run."""
    me = dist.get_rank() == victim
    _micro(engine, 0)
    _micro(engine, 1)
    if kind == "extra_micro_step":  # visible only when the others stop training: here, at the save
        if me:
            _micro(engine, 2)
        _micro(engine, 3)
        _micro(engine, 4)
        engine.save_checkpoint(root)
    elif kind == "skipped_step":  # the step of an accumulation boundary
        _micro(engine, 2)
        x, y = global_batches(CASE, engine.topology.dp, steps=8)[3]
        engine.backward(forward_engine(engine, *_rows(engine, x, y)))
        if not me:
            engine.step()
        _micro(engine, 4)
    elif kind == "skipped_step_mid_accumulation":  # accumulates three micro-batches into one step
        x, y = global_batches(CASE, engine.topology.dp, steps=8)[2]
        engine.backward(forward_engine(engine, *_rows(engine, x, y)))
        if not me:
            engine.step()
        _micro(engine, 3)
    elif kind == "lone_full_state_dict":
        if me:
            engine.full_state_dict()
        _micro(engine, 2)
    else:
        raise ValueError(kind)


def _rows(engine, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = engine.topology.dp_rank * CASE.micro, (engine.topology.dp_rank + 1) * CASE.micro
    return x[lo:hi], y[lo:hi]


def _every_kind(stage: int, tp: int, victim: int, root: str, kinds: list[str], check: bool = True) -> dict:
    """Each kind on a fresh engine: {kind: (error type, message, seconds from the desync to the error)}."""
    out = {}
    for kind in kinds:
        engine = _engine(stage, tp, check)
        started = time.monotonic()
        try:
            _desync(engine, kind, victim, f"{root}/{kind}")
            out[kind] = (None, "no error", time.monotonic() - started)
        except Exception as err:  # every kind must end here, on every rank
            out[kind] = (type(err).__name__, str(err), time.monotonic() - started)
        engine.close()
    return out


def _name(rank: int, tp: int) -> str:
    return f"rank {rank}" if tp == 1 else f"rank {rank} (dp {rank // tp}, tp {rank % tp})"


def _expected(kind: str, stage: int, tp: int, victim: int, other: int) -> list[str]:
    """What the message must say about the victim and another rank."""
    v, o = _name(victim, tp), _name(other, tp)
    first = "forward" if stage == 3 or tp > 1 else "backward"  # the first checked call of a micro-step
    if kind == "extra_micro_step":  # the victim is one micro-step into the next accumulation
        return [f"{o} in save_checkpoint() at global step 2, micro step 4", f"{v} in {first}() at global step 2, "
                "micro step 4", f"{v} is still training"]  # fmt: skip
    if kind == "skipped_step" and stage == 0 and tp == 1:  # stage 0 steps without a collective, so unchecked
        return [f"{o} in backward() at global step 2, micro step 4", f"{v} in backward() at global step 1, micro "
                "step 3", f"{o} took 1 micro-step more than {v}"]  # fmt: skip
    if kind == "skipped_step":
        return [f"{o} in step() at global step 1, micro step 3", f"{v} in {first}() at global step 1, micro step 3",
                f"{v} called {first}() where the others step(): a skipped step()"]  # fmt: skip
    if kind == "skipped_step_mid_accumulation":
        return [f"{o} in {first}() at global step 1, micro step 3", f"{v} in {first}() at global step 1, micro step 2",
                f"{o} took 1 micro-step more than {v}"]  # fmt: skip
    return [f"{v} in full_state_dict() at global step 1, micro step 2", f"{o} in {first}() at global step 1, micro "
            "step 2", f"full_state_dict() is collective: {v} called it and "]  # fmt: skip


def _check(outcomes, kinds: list[str], stage: int, tp: int, victim: int) -> None:
    assert not [o.rank for o in outcomes if o.killed_by_harness], "a rank hung"
    results = [o.value for o in outcomes]
    assert all(r is not None for r in results), [o.error for o in outcomes]
    other = max(r for r in range(len(outcomes)) if r != victim)  # "rank 0, rank 1 in step()" names rank 1 last
    for kind in kinds:
        messages = {r[kind][1] for r in results}
        assert len(messages) == 1, f"{kind}: ranks raised different errors: {messages}"  # the same text everywhere
        for r, result in enumerate(results):
            kind_name, message, seconds = result[kind]
            assert kind_name == RankMismatchError.__name__, f"{kind}: rank {r}: {kind_name}: {message}"
            assert message.startswith("ranks are at different points of training (desync): "), message
            for part in _expected(kind, stage, tp, victim, other):
                assert part in message, f"{kind}: {part!r} not in {message!r}"
            assert seconds < LIMIT_S, (kind, r, seconds)


@pytest.mark.parametrize(("stage", "tp"), [(0, 1), (1, 1), (2, 1), (3, 1), (1, 2)])
def test_every_rank_names_the_desync_world2(tmp_path, stage, tp):
    victim = 1 if stage % 2 == 0 else 0  # rank 0 is a victim too (it hosts the store: nothing changes)
    outcomes = run_ranks(_every_kind, 2, stage, tp, victim, str(tmp_path), KINDS, init_process_group=False, timeout=90)
    _check(outcomes, KINDS, stage, tp, victim)


def test_every_rank_names_the_desync_world3(tmp_path):
    kinds = ["skipped_step", "lone_full_state_dict"]
    outcomes = run_ranks(_every_kind, 3, 3, 1, 2, str(tmp_path), kinds, init_process_group=False, timeout=90)
    _check(outcomes, kinds, 3, 1, 2)


def _alone_at_the_end(timeout: float) -> str:
    """Rank 1 calls full_state_dict() as its last call; rank 0 is done and busy elsewhere (alive, no collective)."""
    engine = _engine(2, 1, timeout=timeout)
    _micro(engine, 0)
    _micro(engine, 1)
    if dist.get_rank() == 0:
        time.sleep(timeout + 3)
        return "done"
    try:
        engine.full_state_dict()
    except CollectiveTimeoutError as err:
        return str(err)
    return "no error"


def test_a_lone_call_no_peer_answers_ends_at_the_collective_timeout():
    """The backstop: nobody else calls anything, so only ``collective_timeout_s`` can end the lone rank's wait; its
    error says where it was and that the other rank is alive elsewhere."""
    started = time.monotonic()
    message = run_ranks(_alone_at_the_end, 2, 2.0, init_process_group=False, timeout=60)[1].value
    assert message.startswith(
        "rank 1: desync_check of this rank's position (full_state_dict() at global step 1, micro step 2) timed out "
        "after "
    ), message
    assert "(collective timeout 2s), in Engine.full_state_dict" in message
    assert "rank 0 (pid " in message and "is alive and had not reported a failure" in message
    assert time.monotonic() - started < 30
