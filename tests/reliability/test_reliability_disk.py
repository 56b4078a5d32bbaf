"""Disk faults at worlds 2 and 3: a full disk (ENOSPC on write or on fsync, on one rank, on every rank, while writing
the manifest or ``latest``), an unwritable directory, a file removed between save and load, a truncated manifest.

A failing save raises one CheckpointError on every rank, within seconds, naming the path; ``latest`` and the previous
checkpoint are untouched and load exactly; no temporary file or directory is left behind. A failing load raises on
every rank naming the damaged file, and the previous checkpoint still loads by its tag.

The full disk is injected where the checkpoint code writes (its modules' ``open`` and ``os.fsync``), with the errno
and message the kernel gives (no file name: the code must add it). A real small filesystem is tried too when this
process may mount a tmpfs (root with CAP_SYS_ADMIN); elsewhere that case is skipped."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from shardtrain.checkpoint.owner import OWNER_NAME
from shardtrain.errors import CheckpointError
from shardtrain.testing import run_distributed

from helpers.reliability import NOSPACE, FullDisk
from helpers.resume import differences, make_engine, snapshot, train

FAST = 30.0


def _as_nobody(fn):
    """Run ``fn`` unable to write into directories it does not own: root ignores permission bits, so root takes the
    identity of ``nobody`` for the call."""
    if os.geteuid() != 0:
        return fn()
    os.seteuid(65534)
    try:
        return fn()
    finally:
        os.seteuid(0)


def _timed(call) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        call()
    except CheckpointError as err:
        return str(err), time.monotonic() - t0
    return "no error", time.monotonic() - t0


# name: (failing ranks, the fault); world-relative ranks: -1 is the last rank
SAVE_FAULTS = {
    "one rank's tensor file": ([-1], lambda: FullDisk(100, lambda n: n.endswith(".safetensors"))),
    "every rank's files": ([0, 1, 2], lambda: FullDisk(0)),
    "fsync on one rank": ([1], lambda: FullDisk(0, at_fsync=True)),
    "the manifest": ([0], lambda: FullDisk(10, lambda n: n == "manifest.json")),
    "the latest file": ([0], lambda: FullDisk(0, lambda n: n == "latest.tmp")),
}


def _disk_faults(root: str, stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = make_engine(0, stage, "adamw")
    train(engine, range(2))
    engine.save_checkpoint(root)  # global_step2: the previous checkpoint
    saved = snapshot(engine)
    train(engine, range(2, 3))
    out: dict = {}
    for name, (ranks, fault) in SAVE_FAULTS.items():
        tag = name.replace(" ", "-").replace("'", "")
        if rank in [r % world for r in ranks]:
            with fault():
                out[name] = _timed(lambda: engine.save_checkpoint(root, tag=tag))  # noqa: B023
        else:
            out[name] = _timed(lambda: engine.save_checkpoint(root, tag=tag))  # noqa: B023
        dist.barrier()
        out[name] += (sorted(n for n in os.listdir(root) if n != OWNER_NAME),)
        dist.barrier()  # every rank has looked before the next save starts

    # an unwritable directory
    if rank == 0:
        os.chmod(root, 0o555)
    dist.barrier()
    out["unwritable"] = _timed(lambda: _as_nobody(lambda: engine.save_checkpoint(root, tag="unwritable")))
    dist.barrier()
    if rank == 0:
        os.chmod(root, 0o755)
    dist.barrier()
    out["unwritable"] += (sorted(n for n in os.listdir(root) if n != OWNER_NAME),)

    # the previous checkpoint is still what `latest` names, and loads exactly
    fresh = make_engine(1, stage, "adamw")
    fresh.load_checkpoint(root)
    out["previous"] = differences(saved, snapshot(fresh))

    # load faults: a file removed between save and load, a truncated manifest
    engine.save_checkpoint(root, tag="good")
    dist.barrier()
    good = Path(root) / "good"
    if rank == 0:
        (good / f"rank{world - 1:05d}.safetensors").unlink()
    dist.barrier()
    out["removed"] = _timed(lambda: make_engine(2, stage, "adamw").load_checkpoint(root))
    dist.barrier()
    if rank == 0:
        text = (good / "manifest.json").read_text()
        (good / "manifest.json").write_text(text[: len(text) // 2])
    dist.barrier()
    out["truncated"] = _timed(lambda: make_engine(2, stage, "adamw").load_checkpoint(root))
    again = make_engine(1, stage, "adamw")
    again.load_checkpoint(root, tag="global_step2")
    out["previous by tag"] = differences(saved, snapshot(again))
    return out


def _check_save_failure(message: str, seconds: float, failing: list[int], path: str) -> None:
    assert seconds < FAST, seconds
    assert message.count("failed to save checkpoint") == len(failing), message
    for r in failing:
        assert f"rank {r} failed to save checkpoint {path} (" in message, message


@pytest.mark.parametrize(("world", "stage"), [(2, 3), (3, 2)])
def test_disk_faults(world, stage):
    # a directory others may traverse (the unwritable case runs as nobody when the tests run as root)
    root = Path(tempfile.mkdtemp(prefix="shardtrain-disk-"))
    root.chmod(0o755)
    try:
        results = run_distributed(_disk_faults, world, str(root), stage, timeout=120)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    last = world - 1
    for out in results:
        for name, (ranks, _) in SAVE_FAULTS.items():
            message, seconds, listing = out[name]
            tag = name.replace(" ", "-").replace("'", "")
            failing = sorted({r % world for r in ranks})
            _check_save_failure(message, seconds, failing, str(root / tag))
            if name == "the latest file":  # the journal: the save was not committed, its directory is removed
                assert "(publishing): OSError: " + NOSPACE + f": '{root / 'latest.tmp'}'" in message, message
                assert "'latest' still names 'global_step2'" in message, message
                assert listing == ["global_step2", "latest"], listing
                continue
            assert "nothing was published ('latest' is unchanged)" in message or "still names 'global_step2'" in (
                message
            ), message
            assert NOSPACE in message, message
            # every failing rank names the file it was writing
            files = {
                "one rank's tensor file": [f"rank{last:05d}.safetensors"],
                "the manifest": ["manifest.json"],
            }.get(name)
            for file in files or []:
                assert f"'{root / ('.tmp-' + tag) / file}'" in message, message
            assert listing == ["global_step2", "latest"], listing
        message, seconds, listing = out["unwritable"]
        _check_save_failure(message, seconds, [0], str(root / "unwritable"))
        assert f"PermissionError: [Errno 13] Permission denied: '{root / '.tmp-unwritable'}'" in message, message
        assert listing == ["global_step2", "latest"], listing
        assert out["previous"] == [] and out["previous by tag"] == [], (out["previous"], out["previous by tag"])
        message, seconds = out["removed"]
        assert seconds < FAST and message.count("failed to load checkpoint") >= 1, message
        assert f"{root / 'good' / f'rank{last:05d}.safetensors'}: file is missing" in message, message
        message, seconds = out["truncated"]
        assert seconds < FAST and message.count("failed to load checkpoint") == world, message
        assert f"{root / 'good' / 'manifest.json'}: not valid JSON" in message, message


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0


def _fill_real_disk(root: str) -> tuple[str, float]:
    engine = make_engine(0, 2, "adamw", threshold=20)
    train(engine, range(1))
    engine.save_checkpoint(root)  # fits
    if dist.get_rank() == 0:  # leave two pages: the next checkpoint (six files) does not fit
        with open(Path(root) / "filler", "wb") as f:
            f.write(b"\0" * (_free_bytes(root) - 8192))
    dist.barrier()
    result = _timed(lambda: engine.save_checkpoint(root, tag="toobig"))
    dist.barrier()
    return result + (sorted(n for n in os.listdir(root) if n != OWNER_NAME),)


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_real_full_filesystem(tmp_path):
    if not _mount_tmpfs(tmp_path, "160k"):
        pytest.skip("cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        for message, seconds, listing in run_distributed(_fill_real_disk, 2, str(tmp_path), timeout=60):
            assert seconds < FAST and "No space left on device" in message, message
            assert f"{tmp_path / '.tmp-toobig'}" in message, message
            assert listing == ["filler", "global_step1", "latest"], listing
    finally:
        subprocess.run(["umount", str(tmp_path)], check=False)
