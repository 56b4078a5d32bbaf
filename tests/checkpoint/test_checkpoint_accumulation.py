"""A resume that changes world size, micro-batch and ``gradient_accumulation_steps`` while keeping the global batch
continues as one process would ([Note: the accumulation boundary at resume] in ``engine/checkpointing.py``): the
parameters after every optimizer step equal those of plain PyTorch on the whole global batch. A checkpoint saved in
the middle of an accumulation resumes at its own accumulation only, and is refused by name at another."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardtrain
from shardtrain.checkpoint.durable import CRASH_POINTS, KILL_ENV
from shardtrain.engine.checkpointing import _resumed_counters
from shardtrain.errors import CheckpointError
from shardtrain.testing import DistributedFailure, run_distributed, run_ranks

from helpers.resume import ROWS, SEQ, VOCAB, ResumeNet, make_optimizer

STEPS = 6


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``ROWS`` rows of optimizer step ``step`` (inputs, next-token targets)."""
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1000 + step))
    return x, torch.roll(x, -1, 1)


def train_step(engine) -> None:
    """One optimizer step on global batch ``engine.global_step``: micro-batch ``k`` of rank ``r`` is rows
    ``(k * world + r) * micro ...``."""
    rank, world, gas = dist.get_rank(), dist.get_world_size(), engine.gradient_accumulation_steps
    micro = ROWS // (world * gas)
    step = engine.global_step
    x, y = global_batch(step)
    for k in range(gas):
        rows = slice((k * world + rank) * micro, (k * world + rank + 1) * micro)
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
    assert engine.global_step == step + 1, (engine.global_step, step)  # one optimizer step per global batch


def make_engine(seed: int, stage: int, gas: int):
    model = ResumeNet(seed)
    micro = ROWS // (dist.get_world_size() * gas)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50},
        "gradient_clipping": 0,  # the one-process reference does not clip
    }
    return shardtrain.initialize(model, config=config, optimizer=make_optimizer(model, "sgd"))


def train(engine, steps: range) -> list[dict[str, torch.Tensor] | None]:
    """Optimizer steps ``steps``; returns the full state after each (rank 0; None elsewhere)."""
    after = []
    for s in steps:
        assert engine.global_step == s
        train_step(engine)
        after.append(engine.full_state_dict())
    return after


def _first_part(root: str, stage: int, gas: int, save_at: int) -> list:
    engine = make_engine(0, stage, gas)
    after = train(engine, range(save_at))
    engine.save_checkpoint(root)
    engine.close()
    return after


def _second_part(root: str, stage: int, gas: int, save_at: int) -> list:
    engine = make_engine(1, stage, gas)  # another seed: every value must come from the checkpoint
    engine.load_checkpoint(root)
    assert engine.global_step == save_at
    after = train(engine, range(save_at, STEPS))
    engine.close()
    return after


def one_process(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """Plain PyTorch on the whole global batch: the state after each step."""
    model = ResumeNet(0)
    opt = make_optimizer(model, "sgd")
    after = []
    for step in range(steps):
        x, y = global_batch(step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        after.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return after


@pytest.mark.parametrize(
    ("first", "second", "save_at"),
    [
        ((2, 1), (1, 2), 3),  # (world, gas): world 2 to world 1, the accumulation doubled (micro-batch 3 throughout)
        ((3, 1), (2, 3), 4),  # micro-batch 2 to 1, world 3 to 2, accumulation 1 to 3
    ],
)
def test_a_resume_at_another_accumulation_continues_as_one_process(tmp_path, first, second, save_at):
    """Saved where the restored micro-step count is no multiple of the new accumulation: it made the first step
    after the load take fewer micro-batches and every later one straddle two accumulations (parameters 0.02 away
    after two steps)."""
    stage = 2
    (w1, g1), (w2, g2) = first, second
    before = run_distributed(_first_part, w1, str(tmp_path), stage, g1, save_at, timeout=120)[0]
    resumed = run_distributed(_second_part, w2, str(tmp_path), stage, g2, save_at, timeout=120)[0]
    want = one_process()
    assert len(before + resumed) == len(want) == STEPS
    for step, (got, ref) in enumerate(zip(before + resumed, want), 1):
        for name, value in ref.items():
            where = f"step {step} {name}"
            torch.testing.assert_close(
                got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, where=where: f"{where}: {m}"
            )


def _mid_accumulation(root: str, load_gas: int) -> tuple[int, int]:
    engine = make_engine(0, 1, 2)
    train(engine, range(1))
    x, y = global_batch(1)
    engine.backward(engine(x[:3], y[:3]))  # one micro-batch of the second step's two
    engine.step()
    engine.save_checkpoint(root)
    engine.close()
    fresh = make_engine(1, 1, load_gas)
    fresh.load_checkpoint(root)
    return fresh.micro_steps, fresh.is_gradient_accumulation_boundary()


def test_a_checkpoint_saved_mid_accumulation_resumes_at_its_own_accumulation_only(tmp_path):
    # at its own: one micro-batch in, the next micro-batch ends the accumulation (as before)
    assert run_distributed(_mid_accumulation, 1, str(tmp_path / "same"), 2, timeout=120) == [(3, True)]
    with pytest.raises(DistributedFailure) as failure:
        run_distributed(_mid_accumulation, 1, str(tmp_path / "other"), 4, timeout=120)
    message = str(failure.value)
    assert "CheckpointError" in message and "saved in the middle of an accumulation" in message, message
    assert "gradient_accumulation_steps=2" in message and "gradient_accumulation_steps=4" in message, message


def test_a_checkpoint_saved_at_a_boundary_resumes_at_the_boundary():
    """The counters a load derives: ``micro_steps`` is ``global_step x gas`` for the new ``gas`` at a boundary."""

    class Reader:
        path = "ck/global_step3"

    def objects(micro: int, gas: int | None) -> dict:
        topology = {} if gas is None else {"gradient_accumulation_steps": gas}
        return {"engine/counters": {"global_step": 3, "micro_steps": micro}, "engine/topology": topology}

    assert _resumed_counters(objects(3, 1), 2, Reader)["micro_steps"] == 6
    assert _resumed_counters(objects(6, 2), 3, Reader)["micro_steps"] == 9
    assert _resumed_counters(objects(7, 2), 2, Reader)["micro_steps"] == 7  # mid-accumulation, the same gas
    assert _resumed_counters(objects(12, None), 2, Reader)["micro_steps"] == 6  # DeepSpeed's steps x its gas
    assert _resumed_counters(objects(7, None), 2, Reader)["micro_steps"] == 7  # cannot tell: as saved
    with pytest.raises(CheckpointError, match=r"gradient_accumulation_steps=2 micro-batches .* accumulates "):
        _resumed_counters(objects(7, 2), 1, Reader)


# -- soak: kills during saves, another accumulation at every restart -------------------------------------------------

SOAK_STEPS = 40
LAYOUTS = [(1, 1), (2, 1), (3, 2), (1, 3), (2, 3), (3, 1), (1, 2), (2, 1)]  # (world, gas) of each attempt, in turn


def _attempt(root: str, attempt: int, gas: int, kill_at: str | None, async_save: bool) -> dict | None:
    """One launch: resume from ``root/latest`` if there is one, train to SOAK_STEPS saving after every step; rank 0
    is killed at ``kill_at`` (a save crash point, ``point:n``). Returns the final full state (rank 0)."""
    resuming = (Path(root) / "latest").exists()
    engine = make_engine(100 + attempt if resuming else 0, 2, gas)  # resumed: every value from the checkpoint
    if resuming:
        engine.load_checkpoint(root)
    if kill_at is not None and dist.get_rank() == 0:
        os.environ[KILL_ENV] = kill_at
    while engine.global_step < SOAK_STEPS:
        train_step(engine)
        engine.save_checkpoint(root, async_save=async_save)
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_kills_during_saves_with_another_accumulation_at_each_restart_end_as_one_process(tmp_path):
    rng = random.Random(55)
    root = str(tmp_path / "ck")
    kills = 0
    for attempt, (world, gas) in enumerate(LAYOUTS):
        last = attempt == len(LAYOUTS) - 1
        kill_at = None if last else f"{rng.choice(CRASH_POINTS)}:{rng.randint(1, 4)}"
        outcomes = run_ranks(_attempt, world, root, attempt, gas, kill_at, rng.random() < 0.5, timeout=300)
        killed = outcomes[0].exitcode == -signal.SIGKILL
        kills += killed
        assert not [o.rank for o in outcomes if o.killed_by_harness], f"attempt {attempt}: processes left behind"
        if last or not killed:  # it trained to the end
            assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
            final = outcomes[0].value
            break
    assert kills >= len(LAYOUTS) // 2, kills  # most attempts were killed during a save
    want = one_process(SOAK_STEPS)[-1]
    for name, value in want.items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
