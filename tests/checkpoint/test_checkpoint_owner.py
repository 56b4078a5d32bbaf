"""One job owns a save directory ([Note: one job per save directory] in checkpoint/owner.py): a second job saving
there is refused on every rank, naming the owner, and nothing of the first job's is touched (its checkpoints byte
for byte, its save in progress); a dead owner's directory is taken over, and the torn-save recovery still runs; the
"same save done again" rule replaces only the same job's checkpoints."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardtrain.checkpoint import FlatSlice, SavePiece, open_checkpoint, save, writer
from shardtrain.checkpoint.durable import KILL_ENV
from shardtrain.checkpoint.latest import read_latest
from shardtrain.checkpoint.owner import OWNER_NAME, RUN_ID_ENV, SaveDirInUseError, SaveDirOwner, owned_elsewhere
from shardtrain.errors import CheckpointError
from shardtrain.testing import run_distributed

from helpers.resume import make_engine, train

PIECE = [SavePiece("model/w", (2, 3), FlatSlice(0, 6), torch.arange(6.0))]
WAIT_S = 60.0


def _wait_for(*paths: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"waited {WAIT_S}s for {paths}"
        time.sleep(0.02)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _first_job(root: str, async_save: bool) -> None:
    """Job A: saves global_step2, then holds its save of global_step4 in the middle of its writes (``.tmp-`` full
    of its files) until job B is done; rank 0 keeps the bytes of global_step2 as they were then."""
    os.environ[RUN_ID_ENV] = "job-a"
    root_path, ck = Path(root), Path(root) / "ck"
    engine = make_engine(0, 2, "adamw")
    train(engine, range(2))
    engine.save_checkpoint(ck, async_save=async_save)
    train(engine, range(2, 4))
    write = writer._write_rank_files

    def held(*args, **kwargs):
        if dist.get_rank() == 0:
            (root_path / "a-step2.json").write_text(
                json.dumps({k: v.hex() for k, v in _files(ck / "global_step2").items()})
            )
        (root_path / f"a-writing-{dist.get_rank()}").touch()
        _wait_for(root_path / "b-done")
        return write(*args, **kwargs)

    writer._write_rank_files = held
    engine.save_checkpoint(ck, async_save=async_save)
    engine.close()  # waits for an asynchronous save


def _second_job(root: str, async_save: bool) -> list[str]:
    """Job B: the same training from another seed (so the same counters, other bytes), saving into A's directory
    while A's save of global_step4 is in progress."""
    os.environ[RUN_ID_ENV] = "job-b"
    root_path, ck = Path(root), Path(root) / "ck"
    refused = []
    try:
        _wait_for(root_path / "a-writing-0", root_path / "a-writing-1")
        engine = make_engine(1, 2, "adamw")
        train(engine, range(2))
        for tag in ("global_step2", "mine"):  # the same tag as A's (the same-save rule) and a new one
            try:
                engine.save_checkpoint(ck, tag=tag, async_save=async_save)  # refused before its snapshot, if at all
                refused.append("saved")
            except SaveDirInUseError as err:
                refused.append(str(err))
        engine.close()
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            (root_path / "b-done").touch()
    return refused


@pytest.mark.parametrize("async_save", [False, True])
def test_a_second_job_saving_into_the_directory_is_refused_and_touches_nothing(tmp_path, async_save):
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(run_distributed, _first_job, 2, str(tmp_path), async_save, timeout=120)
        b = pool.submit(run_distributed, _second_job, 2, str(tmp_path), async_save, timeout=120)
        refused, _ = b.result(), a.result()
    for rank, messages in enumerate(refused):
        assert len(messages) == 2, (rank, messages)
        for message in messages:
            assert "belongs to another job (pid " in message and "torchrun run id job-a" in message, (rank, message)
    ck = tmp_path / "ck"
    step2 = {k: bytes.fromhex(v) for k, v in json.loads((tmp_path / "a-step2.json").read_text()).items()}
    assert _files(ck / "global_step2") == step2  # byte for byte
    assert read_latest(ck) == "global_step4" and not (ck / "mine").exists()
    assert sorted(p.name for p in ck.iterdir()) == ["global_step2", "global_step4", "latest"]  # A closed: no record
    assert open_checkpoint(ck).verify() == []


def _hold_in_child(save_dir: Path, point: str | None = None) -> tuple[int, int]:
    """Fork a child that claims ``save_dir`` as job ``child`` and waits for a byte on a pipe (or, with ``point``,
    saves tag ``b`` and is killed at that point). Returns (pid, the pipe's write end)."""
    ready, go = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.environ[RUN_ID_ENV] = "child"
            if point is not None:
                os.environ[KILL_ENV] = point
                save(save_dir, "b", None, PIECE)
            SaveDirOwner().claim(save_dir)
            os.write(ready[1], b"1")
            os.read(go[0], 1)
            code = 0
        finally:
            os._exit(code)
    if point is None:
        assert os.read(ready[0], 1) == b"1"
    return pid, go[1]


def test_a_live_owner_is_named_and_its_save_in_progress_is_kept(tmp_path, monkeypatch):
    save(tmp_path, "a", None, PIECE)
    pid, go = _hold_in_child(tmp_path)
    try:
        (tmp_path / ".tmp-b").mkdir()  # the owner's save in progress
        before = {p.name for p in tmp_path.iterdir()}
        monkeypatch.setenv(RUN_ID_ENV, "other")
        with pytest.raises(SaveDirInUseError, match=rf"belongs to another job \(pid {pid} on .*torchrun run id child"):
            save(tmp_path, "c", None, PIECE)
        assert {p.name for p in tmp_path.iterdir()} == before
    finally:
        os.write(go, b"1")
        os.waitpid(pid, 0)
    save(tmp_path, "c", None, PIECE)  # the owner has exited: the directory is free (its leftovers are cleaned)
    assert read_latest(tmp_path) == "c" and not (tmp_path / ".tmp-b").exists()


def test_a_dead_owner_is_taken_over_and_its_committed_save_published(tmp_path, monkeypatch):
    save(tmp_path, "a", None, PIECE)
    pid, _ = _hold_in_child(tmp_path, point="latest_tmp_written")  # killed after its save was committed
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert json.loads((tmp_path / OWNER_NAME).read_text())["pid"] == pid
    monkeypatch.setenv(RUN_ID_ENV, "next")
    owner = SaveDirOwner()
    save(tmp_path, "c", None, PIECE, owner=owner)
    assert sorted(p.name for p in tmp_path.iterdir()) == [OWNER_NAME, "a", "b", "c", "latest"]  # b recovered
    record = json.loads((tmp_path / OWNER_NAME).read_text())
    assert (record["pid"], record["run_id"]) == (os.getpid(), "next")
    owner.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "latest"]  # released: no record left


@pytest.mark.parametrize(("saved_by", "saving", "replaced"), [("job-a", "job-a", True), ("job-a", "job-b", False)])
def test_the_same_save_is_done_again_only_by_the_same_job(tmp_path, saved_by, saving, replaced):
    counters = {"global_step": 2, "micro_steps": 2}
    save(tmp_path, "t", None, PIECE, global_objects={"engine/counters": counters, "engine/run_id": saved_by})
    same_save = {"engine/counters": counters, "engine/run_id": saving}
    again = [SavePiece("model/w", (2, 3), FlatSlice(0, 6), torch.ones(6))]
    if replaced:
        save(tmp_path, "t", None, again, same_save=same_save)
        assert torch.equal(open_checkpoint(tmp_path).read("model/w").reshape(-1), torch.ones(6))
        return
    with pytest.raises(CheckpointError, match="saved at the same point of training by another job, torchrun run id "):
        save(tmp_path, "t", None, again, same_save=same_save)
    assert torch.equal(open_checkpoint(tmp_path).read("model/w").reshape(-1), torch.arange(6.0))


def test_a_load_leaves_the_recovery_to_a_live_owner(tmp_path):
    """A load from a directory another process owns must not finish (or drop) the owner's publish in progress."""
    save(tmp_path, "a", None, PIECE)
    pid, go = _hold_in_child(tmp_path)
    try:
        owner = owned_elsewhere(tmp_path)
        assert owner is not None and f"pid {pid} on " in owner and "torchrun run id child" in owner, owner
    finally:
        os.write(go, b"1")
        os.waitpid(pid, 0)
    assert owned_elsewhere(tmp_path) is None  # its process has exited
    held = SaveDirOwner()
    held.claim(tmp_path)
    assert owned_elsewhere(tmp_path) is None  # this process's own directory
    held.release()
