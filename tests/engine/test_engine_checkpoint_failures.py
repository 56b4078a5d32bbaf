"""Any exception on one rank during save_checkpoint or load_checkpoint ends every rank within seconds with one
CheckpointError naming the failing rank and the cause, with the default collective timeout (1800 s); a failed save
leaves the previous checkpoint loadable and publishes nothing."""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import pytest
import torch.distributed as dist

import shardtrain.checkpoint.writer as writer
import shardtrain.engine.checkpointing as engine_checkpoint
from shardtrain.checkpoint.owner import OWNER_NAME
from shardtrain.errors import CheckpointError
from shardtrain.testing import run_distributed

from helpers.resume import differences, make_engine, snapshot, train

FAST = 30.0  # seconds; the collective timeout (default 1800 s) is what a hang would cost


def _fail(exc: Exception):
    def raiser(*args, **kwargs):
        raise exc

    return raiser


def _timed(call) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        call()
    except CheckpointError as err:
        return str(err), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def _corrupt_rank_objects(ckpt: Path, rank: int) -> None:
    """Replace rank ``rank``'s object file by bytes that are not safetensors, with a matching size and checksum in
    the manifest (as a file written by a broken or foreign writer would be): only that rank reads it."""
    bad = b"this is not a safetensors file"
    name = f"rank{rank:05d}.objects.safetensors"
    (ckpt / name).write_bytes(bad)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name].update(size=len(bad), checksum=f"crc32:{zlib.crc32(bad):08x}")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _failures(root: str) -> dict:
    """Every rank: three failing saves (rank 1's file write raises, rank 1's collection of pieces raises, rank 0's
    publish raises), then a load where only rank 1's object file fails to parse. Returns messages and seconds."""
    rank = dist.get_rank()
    engine = make_engine(0, 2, "adamw")
    train(engine, range(2))
    engine.save_checkpoint(root)  # global_step2: the previous checkpoint
    saved = snapshot(engine)
    train(engine, range(2, 3))
    out = {}
    scenarios = {  # name: (rank that fails, object patched, attribute, exception)
        "write": (1, writer, "write_streaming", RuntimeError("simulated device error while writing")),
        "collect": (1, engine_checkpoint, "collect_pieces", ValueError("simulated bug while collecting")),
        "publish": (0, writer, "_publish", PermissionError(13, "simulated permission denied")),
    }
    for name, (failing, module, attribute, exc) in scenarios.items():
        original = getattr(module, attribute)
        if rank == failing:
            setattr(module, attribute, _fail(exc))
        try:
            out[name] = _timed(lambda: engine.save_checkpoint(root))
        finally:
            setattr(module, attribute, original)
    dist.barrier()  # rank 0 removes the temporary directory after the others have raised
    out["leftovers"] = sorted(p.name for p in Path(root).iterdir() if p.name != OWNER_NAME)  # open engine

    # the previous checkpoint is still what `latest` names, and loads into a fresh engine
    fresh = make_engine(1, 2, "adamw")
    fresh.load_checkpoint(root)
    out["previous"] = differences(saved, snapshot(fresh))

    engine.save_checkpoint(root, tag="after")
    dist.barrier()
    if rank == 0:
        _corrupt_rank_objects(Path(root) / "after", 1)
    dist.barrier()
    out["load"] = _timed(lambda: make_engine(2, 2, "adamw").load_checkpoint(root))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_any_failure_on_one_rank_ends_every_rank_quickly(tmp_path, world):
    results = run_distributed(_failures, world, str(tmp_path), timeout=120)
    path = tmp_path / "global_step3"
    for rank, out in enumerate(results):
        for scenario, failing, cause in [
            ("write", 1, "RuntimeError: simulated device error while writing"),
            ("collect", 1, "ValueError: simulated bug while collecting"),
            ("publish", 0, "PermissionError: [Errno 13] simulated permission denied"),
        ]:
            message, seconds = out[scenario]
            assert seconds < FAST, (rank, scenario, seconds)
            assert message.startswith(f"rank {failing} failed to save checkpoint {path} ("), (rank, message)
            assert cause in message and message.count("failed to save") == 1, (rank, message)
        assert "nothing was published" in out["write"][0] and "nothing was published" in out["collect"][0]
        assert out["leftovers"] == ["global_step2", "latest"], out["leftovers"]  # no temporary directory left
        assert out["previous"] == [], out["previous"]
        message, seconds = out["load"]
        assert seconds < FAST, (rank, seconds)
        assert message.startswith(f"rank 1 failed to load checkpoint {tmp_path}: "), (rank, message)
        assert "not a readable safetensors file" in message and message.count("failed to load") == 1, (rank, message)
