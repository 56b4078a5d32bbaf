"""One rank killed with SIGKILL at each point of a multi-rank ``save_checkpoint`` (worlds 2 and 3): the survivors stop
within seconds naming it (not after the 1800 s collective timeout); ``latest`` names a complete checkpoint that
verifies; the next run loads it, resumes exactly, and its first save removes what the killed one left.

The single-process test (tests/checkpoint/test_checkpoint_crash.py) checks what is on disk at every point; this one
checks that the other ranks are not left waiting, whichever rank dies where. Points reached only by rank 0 (inside the
prepare and publish steps) kill rank 0, the host of the rendezvous store here; the others kill another rank each
time."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from shardtrain.checkpoint import open_checkpoint
from shardtrain.checkpoint.durable import CRASH_POINTS
from shardtrain.checkpoint.owner import OWNER_NAME
from shardtrain.testing import run_distributed, run_ranks

from helpers.reliability import arm, check_rank_death
from helpers.resume import differences, make_engine, snapshot, train

# The save protocol's phases (see writer.py) and their kill points.
PHASES = {
    "prepare": ["start", "tmp_created"],
    "write files": ["tensor_file_torn", "tensor_file_written", "objects_written", "files_synced"],
    "write manifest": ["manifest_torn", "manifest_written", "tmp_synced"],
    "commit and rename": ["latest_torn", "latest_tmp_written", "renamed"],
    "published": ["latest_renamed", "done"],
}
RANK0_ONLY = {"tmp_created", "manifest_torn", "manifest_written", "tmp_synced", "renamed", "latest_torn"}
RANK0_ONLY |= {"latest_tmp_written", "latest_renamed", "done"}
PUBLISHED = {"latest_renamed", "done"}  # ``latest`` names the new checkpoint
COMMITTED = {"latest_tmp_written", "renamed", *PUBLISHED}  # the next load publishes it ([Note: the publish journal])

# Every phase at both world sizes, every point once: (world, point, killed rank, ZeRO stage)
CASES: dict[int, list[tuple[str, int, int]]] = {2: [], 3: []}
for points in PHASES.values():
    for j, point in enumerate(points):
        world = 2 if j % 2 == 0 else 3
        victim = 0 if point in RANK0_ONLY else (len(CASES[world]) + 1) % world
        CASES[world].append((point, victim, len(CASES[world]) % 4))


def _save_killed(stage: int, victim: int, point: str, root: str) -> None:
    engine = make_engine(0, stage, "adamw")
    train(engine, range(2))
    engine.save_checkpoint(root)  # global_step2: complete
    train(engine, range(2, 3))
    if dist.get_rank() == victim:
        arm(engine, point)
    engine.save_checkpoint(root)  # global_step3: the victim dies in it


def _resume(cases: list[tuple[str, int, int, str]]) -> list[str]:
    """The next run, for each killed save: a fresh engine loads ``latest``, must equal one trained straight to that
    step, trains one more step equally, and saves (which removes the leftovers of the killed save)."""
    problems = []
    for point, _, stage, root in cases:
        step = 3 if point in COMMITTED else 2
        straight = make_engine(0, stage, "adamw")
        train(straight, range(step))
        fresh = make_engine(1, stage, "adamw")
        fresh.load_checkpoint(root)
        problems += [f"{point}: {d}" for d in differences(snapshot(straight), snapshot(fresh))]
        if train(fresh, range(step, step + 1)) != train(straight, range(step, step + 1)):
            problems.append(f"{point}: the step after loading differs")
        fresh.save_checkpoint(root, tag="next")
        dist.barrier()
        leftovers = sorted(n for n in os.listdir(root) if (n.startswith(".") and n != OWNER_NAME) or n.endswith(".tmp"))
        if leftovers:
            problems.append(f"{point}: left after the next save: {leftovers}")
    return problems


def test_cases_cover_every_point_and_phase_at_both_worlds():
    assert sorted(p for ps in PHASES.values() for p in ps) == sorted(CRASH_POINTS)
    assert sorted(p for cases in CASES.values() for p, _, _ in cases) == sorted(CRASH_POINTS)
    for points in PHASES.values():
        for world, cases in CASES.items():
            assert {p for p, _, _ in cases} & set(points), (world, points)


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.soak), 3])  # suite time: world 3 by default
def test_sigkill_at_each_save_phase(tmp_path, world):
    done = []
    for point, victim, stage in CASES[world]:
        root = tmp_path / point
        outcomes = run_ranks(_save_killed, world, stage, victim, point, str(root), timeout=60)
        try:
            check_rank_death(outcomes, victim)
        except AssertionError as err:
            raise AssertionError(f"killed rank {victim} at {point!r}: {err}") from None
        reader = open_checkpoint(root)  # what `latest` names: complete and verifying
        assert reader.manifest.tag == ("global_step3" if point in PUBLISHED else "global_step2"), point
        assert reader.verify() == [], point
        done.append((point, victim, stage, str(root)))
    problems = run_distributed(_resume, world, done, timeout=120)
    assert problems == [[]] * world
