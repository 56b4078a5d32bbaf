"""Asynchronous checkpoint saves ([Note: asynchronous checkpoints] in ``checkpoint/async_save.py``).

``save_checkpoint(..., async_save=True)`` writes what a synchronous save writes; it returns before the files are
written, training goes on meanwhile and cannot change what is written; ``close()`` and the next save wait for it; a
full disk in the background fails the next call on every rank with the synchronous save's message; a rank killed
during the background write leaves the previous checkpoint as ``latest``, loadable."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardtrain.checkpoint import open_checkpoint, writer
from shardtrain.checkpoint.durable import KILL_ENV
from shardtrain.checkpoint.owner import OWNER_NAME
from shardtrain.errors import CheckpointError
from shardtrain.testing import run_distributed, run_ranks

from helpers.reliability import NOSPACE, FullDisk
from helpers.resume import differences, make_engine, snapshot, train


def _same_checkpoints(a: Path, b: Path) -> list[str]:
    """What differs between two checkpoints' contents: every tensor bitwise, every object, per-rank objects."""
    ra, rb = open_checkpoint(a.parent, a.name), open_checkpoint(b.parent, b.name)
    out = []
    if sorted(ra.manifest.tensors) != sorted(rb.manifest.tensors):
        return [f"tensor names {sorted(ra.manifest.tensors)} vs {sorted(rb.manifest.tensors)}"]
    for name in ra.manifest.tensors:
        x, y = ra.read(name), rb.read(name)
        if x.dtype != y.dtype or not torch.equal(x, y):
            out.append(f"tensor {name}")
    if ra.objects.keys() != rb.objects.keys():
        out.append(f"objects {sorted(ra.objects)} vs {sorted(rb.objects)}")
    for key in ra.objects:
        if repr(ra.objects[key]) != repr(rb.objects[key]):
            out.append(f"object {key}")
    for r in range(ra.manifest.world_size):
        if repr(ra.rank_objects(r)) != repr(rb.rank_objects(r)):
            out.append(f"objects of rank {r}")
    return out + [f"{p}: {e}" for p in (a, b) for e in open_checkpoint(p.parent, p.name).verify()]


def _sync_and_async(root: str, stage: int) -> list[str]:
    engine = make_engine(0, stage, "adamw")
    train(engine, range(2))
    engine.save_checkpoint(root, tag="sync")
    path = engine.save_checkpoint(root, tag="async", async_save=True)
    engine.close()  # waits
    dist.barrier()
    if dist.get_rank() != 0:
        return []
    latest = (Path(root) / "latest").read_text().strip()
    return _same_checkpoints(Path(root) / "sync", path) + ([] if latest == "async" else [f"latest names {latest}"])


@pytest.mark.parametrize(("world", "stage"), [(2, 3), (3, 1)])
def test_an_async_save_writes_what_a_sync_save_writes(tmp_path, world, stage):
    assert run_distributed(_sync_and_async, world, str(tmp_path), stage, timeout=120) == [[]] * world


def _train_during_the_write(root: str) -> dict:
    """The background write is held at its start until this rank has trained one more step."""
    engine = make_engine(0, 2, "adamw")
    train(engine, range(2))
    saved = snapshot(engine)
    gate, held = threading.Event(), []
    write = writer._write_rank_files

    def held_write(*args, **kwargs):
        held.append(gate.wait(timeout=60))
        return write(*args, **kwargs)

    writer._write_rank_files = held_write
    try:
        engine.save_checkpoint(root, async_save=True)
        returned_in_flight = engine._async_saver.in_flight
        train(engine, range(2, 3))  # collectives on the training group while the checkpoint thread waits
        after_step = snapshot(engine)
        dist.barrier()
        published_early = (Path(root) / "latest").exists()
        gate.set()
        engine.close()
    finally:
        writer._write_rank_files = write
    latest = (Path(root) / "latest").read_text().strip()  # close() returned: the save is complete
    fresh = make_engine(1, 2, "adamw")
    fresh.load_checkpoint(root)
    return {
        "in flight": returned_in_flight,
        "published early": published_early,
        "held": held,
        "latest": latest,
        "step changed the state": bool(differences(saved, after_step)),
        "loaded vs saved": differences(saved, snapshot(fresh)),
    }


def test_training_goes_on_during_the_write_and_cannot_change_what_is_written(tmp_path):
    for out in run_distributed(_train_during_the_write, 2, str(tmp_path), timeout=120):
        assert out["in flight"] and not out["published early"], out
        assert out["held"] == [True], out  # the write started only after the next step: it was not synchronous
        assert out["latest"] == "global_step2"
        assert out["step changed the state"]
        assert out["loaded vs saved"] == [], out["loaded vs saved"]


def _full_disk_in_the_background(root: str) -> dict:
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    engine = make_engine(0, 1, "adamw")
    train(engine, range(2))
    engine.save_checkpoint(root, tag="a")
    saved = snapshot(engine)
    train(engine, range(2, 3))

    def full_disk():
        return FullDisk(100, lambda n: n.endswith(".safetensors")) if rank == last else FullDisk(1 << 40)

    out = {}
    with full_disk():
        try:
            engine.save_checkpoint(root, tag="b")
        except CheckpointError as err:
            out["sync"] = str(err)
    with full_disk():
        engine.save_checkpoint(root, tag="b", async_save=True)  # returns: the write fails in the background
        train(engine, range(3, 4))
        try:
            engine.save_checkpoint(root, tag="c")
        except CheckpointError as err:
            out["async"] = str(err)
    dist.barrier()
    out["listing"] = sorted(n for n in os.listdir(root) if n != OWNER_NAME)  # the engine is open
    fresh = make_engine(1, 1, "adamw")
    fresh.load_checkpoint(root)
    out["previous"] = differences(saved, snapshot(fresh))
    engine.save_checkpoint(root, tag="d", async_save=True)  # the engine saves again after the failure
    engine.close()
    out["latest after"] = (Path(root) / "latest").read_text().strip()
    return out


def test_a_full_disk_in_the_background_fails_the_next_call_on_every_rank(tmp_path):
    world = 3
    results = run_distributed(_full_disk_in_the_background, world, str(tmp_path), timeout=120)
    for out in results:
        assert "async" in out, "the next call after the failed background save raised nothing"
        assert out["async"] == out["sync"]  # the synchronous save's message, on every rank
        assert out["async"].startswith(f"rank {world - 1} failed to save checkpoint {tmp_path / 'b'} (writing files)")
        assert f"rank{world - 1:05d}.safetensors" in out["async"] and NOSPACE in out["async"], out["async"]
        assert out["listing"] == ["a", "latest"], out["listing"]  # nothing published, nothing left behind
        assert out["previous"] == []
        assert out["latest after"] == "d"


def _killed_during_the_write(root: str, victim: int) -> None:
    engine = make_engine(0, 2, "adamw")
    train(engine, range(2))
    engine.save_checkpoint(root)  # global_step2: complete
    train(engine, range(2, 3))
    if dist.get_rank() == victim:
        os.environ[KILL_ENV] = "tensor_file_written"  # reached only by the background thread
    engine.save_checkpoint(root, async_save=True)  # global_step3: the victim dies writing it
    train(engine, range(3, 6))
    engine.close()


def _load_latest(root: str) -> list[str]:
    straight = make_engine(0, 2, "adamw")
    train(straight, range(2))
    fresh = make_engine(1, 2, "adamw")
    fresh.load_checkpoint(root)
    return differences(snapshot(straight), snapshot(fresh))


def test_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint(tmp_path):
    world, victim = 3, 2
    outcomes = run_ranks(_killed_during_the_write, world, str(tmp_path), victim, timeout=90)
    assert outcomes[victim].exitcode == -signal.SIGKILL, outcomes[victim]
    assert not [o.rank for o in outcomes if o.killed_by_harness], "processes left behind"
    for o in outcomes:
        if o.rank != victim:
            assert o.error is not None and "PeerLostError" in o.error.strip().splitlines()[-1], o
            assert f"rank {victim} (pid " in o.error, o.error
    reader = open_checkpoint(tmp_path)
    assert reader.manifest.tag == "global_step2"
    assert reader.verify() == []
    assert run_distributed(_load_latest, world, str(tmp_path), timeout=120) == [[]] * world


_EXIT_SCRIPT = """
import sys, time
import torch
import shardtrain
from shardtrain.checkpoint import writer

write = writer._write_rank_files
def slow(*args, **kwargs):
    time.sleep(1.0)  # the interpreter reaches its end while this rank's file is still to be written
    return write(*args, **kwargs)
writer._write_rank_files = slow

model = torch.nn.Linear(4, 4)
engine = shardtrain.initialize(model, config={"train_micro_batch_size_per_gpu": 2}, optimizer=torch.optim.SGD(
    model.parameters(), lr=0.1))
engine.backward(engine(torch.randn(2, 4)).sum())
engine.step()
engine.save_checkpoint(sys.argv[1], async_save=True)
print("returned", (__import__("pathlib").Path(sys.argv[1]) / "latest").exists())
"""


def test_the_interpreter_exit_waits_for_the_save_in_flight(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["returned", "False"]  # the call returned before the checkpoint was published
    reader = open_checkpoint(tmp_path)  # and the process did not end before it was
    assert reader.manifest.tag == "global_step1" and reader.verify() == []
