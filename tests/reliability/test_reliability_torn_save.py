"""A job killed at any point of a save (sync or async, worlds 2 and 3) restarts, resumes from the newest complete
checkpoint and finishes with the uninterrupted run's losses and final checkpoint, bitwise.

Before [Note: the publish journal] (checkpoint/latest.py), a kill after ``global_step4`` was renamed into place and
before ``latest`` named it left a job that could never finish: the restart loaded ``global_step2``, trained to step 4
and its save failed with "checkpoint .../global_step4 already exists; choose another tag", on every restart.

The job is ``examples/elastic_train.py``'s ``train`` (a GPT, ZeRO-2, AdamW, warm-up, clipping): 8 steps, a save
every 2; the first run's victim dies inside the save of step 4 (``--kill-at-save``). The default run holds a
representative subset and one real ``torchrun --max-restarts=1``; ``-m soak`` runs every crash point x sync/async x
worlds 2 and 3, and torchrun with an asynchronous save.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtrain.checkpoint import open_checkpoint
from shardtrain.checkpoint.durable import CRASH_POINTS
from shardtrain.checkpoint.owner import OWNER_NAME
from shardtrain.testing import run_distributed, run_ranks

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import elastic_train  # noqa: E402

STEPS, SAVE_EVERY, KILL_AT = 8, 2, 4  # saves at 2, 4, 6, 8; the save of step 4 is killed
STAGE = 2
RANK0_ONLY = {"tmp_created", "manifest_torn", "manifest_written", "tmp_synced", "latest_torn", "latest_tmp_written"}
RANK0_ONLY |= {"renamed", "latest_renamed", "done"}
COMMITTED = {"latest_tmp_written", "renamed", "latest_renamed", "done"}  # the journal is durable: step 4 is kept
LEGACY = "legacy"  # the state the old protocol left: global_step4 in place, `latest` on global_step2, no journal


def _resumes_at(point: str) -> int:
    return KILL_AT if point in COMMITTED else KILL_AT - SAVE_EVERY


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, tuple[dict[int, float], Path]]:
    """The uninterrupted run at each world: {world: ({step: loss}, its final checkpoint)}, made once."""
    out = {}
    for world in (2, 3):
        root = tmp_path_factory.mktemp(f"straight{world}")
        losses = run_distributed(elastic_train.train, world, str(root), STEPS, SAVE_EVERY, STAGE, timeout=180)[0]
        out[world] = (dict(losses), root / f"global_step{STEPS}")
    return out


def _same_checkpoint(a: Path, b: Path) -> list[str]:
    """Every tensor (weights, masters, optimizer state) and every global object of two checkpoints, bitwise."""
    ra, rb = open_checkpoint(a), open_checkpoint(b)
    problems = [] if sorted(ra.manifest.tensors) == sorted(rb.manifest.tensors) else ["different tensors"]
    for name in ra.manifest.tensors:
        if name in rb.manifest.tensors and not torch.equal(ra.read(name), rb.read(name)):
            problems.append(f"{name} differs")
    if ra.objects["engine/counters"] != rb.objects["engine/counters"]:
        problems.append(f"counters {ra.objects['engine/counters']} != {rb.objects['engine/counters']}")
    return problems


def _check_finished_like_straight(root: Path, losses: list[tuple[int, float]], resumed_at: int, reference) -> None:
    want_losses, want_final = reference
    assert [s for s, _ in losses] == list(range(resumed_at + 1, STEPS + 1)), losses
    assert dict(losses) == {s: want_losses[s] for s in range(resumed_at + 1, STEPS + 1)}  # bitwise
    assert _same_checkpoint(root / f"global_step{STEPS}", want_final) == []
    assert (root / "latest").read_text() == f"global_step{STEPS}\n"
    names = sorted(n for n in os.listdir(root) if n != OWNER_NAME)  # the job's record: it ran
    assert names == ["global_step2", "global_step4", "global_step6", "global_step8", "latest"], names


def _kill_and_restart(tmp_path: Path, world: int, point: str, async_save: bool, reference) -> None:
    root = tmp_path / "ck"
    victim = 0 if point in RANK0_ONLY else world - 1
    if point == LEGACY:  # a whole run to step 4, then `latest` set back: what the old protocol's kill left
        run_distributed(elastic_train.train, world, str(root), KILL_AT, SAVE_EVERY, STAGE, timeout=120)
        (root / "latest").write_text(f"global_step{KILL_AT - SAVE_EVERY}\n")
    else:
        kill = {"kill_rank": victim, "kill_at_step": KILL_AT, "kill_at_save": point, "async_save": async_save}
        outcomes = run_ranks(elastic_train.train, world, str(root), STEPS, SAVE_EVERY, STAGE, timeout=120, **kill)
        assert outcomes[victim].exitcode == -9, f"rank {victim} was to die at {point!r}: {outcomes[victim]}"
        assert not [o.rank for o in outcomes if o.killed_by_harness], "a survivor hung"
        assert all(o.error or o.exitcode == -9 for o in outcomes), "a rank finished the job it was killed in"
    resumed_at = KILL_AT - SAVE_EVERY if point == LEGACY else _resumes_at(point)  # legacy: from `latest`, then past
    losses = run_distributed(
        elastic_train.train, world, str(root), STEPS, SAVE_EVERY, STAGE, async_save=async_save, timeout=180
    )[0]
    _check_finished_like_straight(root, losses, resumed_at, reference[world])


DEFAULT_CASES = [  # (world, point, async): the case, the commit point, a rank's own file, the old state
    (2, "renamed", False),
    (3, "latest_tmp_written", True),
    (2, "tensor_file_torn", True),
    (3, LEGACY, False),
]
ALL_CASES = [(w, p, a) for w in (2, 3) for p in CRASH_POINTS for a in (False, True)]


@pytest.mark.parametrize(("world", "point", "async_save"), DEFAULT_CASES)
def test_a_job_killed_in_a_save_restarts_and_finishes_exactly(tmp_path, straight, world, point, async_save):
    _kill_and_restart(tmp_path, world, point, async_save, straight)


@pytest.mark.soak
@pytest.mark.parametrize(("world", "point", "async_save"), [c for c in ALL_CASES if c not in DEFAULT_CASES])
def test_every_kill_point_sync_and_async(tmp_path, straight, world, point, async_save):
    _kill_and_restart(tmp_path, world, point, async_save, straight)


def _torchrun(tmp_path: Path, point: str, victim: int, async_save: bool) -> tuple[Path, list[tuple[int, float]]]:
    log, root = tmp_path / "losses.jsonl", tmp_path / "ck"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    cmd += ["--monitor-interval=0.1", str(ROOT / "examples" / "elastic_train.py"), "--ckpt-dir", str(root)]
    cmd += ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--stage", str(STAGE), "--loss-log", str(log)]
    cmd += ["--kill-rank", str(victim), "--kill-at-step", str(KILL_AT), "--kill-at-save", point]
    cmd += ["--async-save"] if async_save else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-6000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["attempt"] for r in lines} == {0, 1}, proc.stdout[-3000:]  # it did die, and was restarted once
    second = [(r["step"], r["loss"]) for r in lines if r["attempt"] == 1]
    assert f"attempt 1: resumed from {root} at step {_resumes_at(point)}" in proc.stdout, proc.stdout[-3000:]
    return root, second


def test_under_torchrun_max_restarts(tmp_path, straight):
    """The issue's case as a user meets it: rank 0 dies after ``global_step4`` is in place and before ``latest``
    names it; torchrun restarts the job, which resumes at step 4 and finishes like the uninterrupted run."""
    root, second = _torchrun(tmp_path, "renamed", 0, async_save=False)
    _check_finished_like_straight(root, second, KILL_AT, straight[2])


@pytest.mark.soak
@pytest.mark.parametrize(("point", "victim"), [("latest_torn", 0), ("files_synced", 1), ("latest_renamed", 0)])
def test_under_torchrun_max_restarts_async(tmp_path, straight, point, victim):
    root, second = _torchrun(tmp_path, point, victim, async_save=True)
    _check_finished_like_straight(root, second, _resumes_at(point), straight[2])
