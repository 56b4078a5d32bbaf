"""A save killed with SIGKILL at any point of the protocol leaves the previous checkpoint loadable and ``latest``
pointing at a complete checkpoint; once the save is committed (its journal ``latest.tmp`` durable) the next load or
save publishes it; the next save cleans up what the killed one left, and the killed save's tag can be saved again."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shardtrain.checkpoint import durable, latest, open_checkpoint, writer
from shardtrain.checkpoint.durable import CRASH_POINTS, KILL_ENV
from shardtrain.errors import CheckpointError

from helpers.checkpoint import save_engine_like, trained_model

# The points after which the new checkpoint is published (``latest`` renamed onto it).
PUBLISHED = {"latest_renamed", "done"}
# ... and those after which it is committed: ``latest.recover`` (the next load or save) publishes it.
COMMITTED = {"latest_tmp_written", "renamed", *PUBLISHED}


def _save_in_child(save_dir, tag: str, seed: int, point: str) -> int:
    """Fork; the child saves and SIGKILLs itself at ``point``. Returns the child's wait status."""
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 3
        try:
            os.environ[KILL_ENV] = point
            save_engine_like(str(save_dir), tag, 2, seed)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _assert_holds_model_of(reader, seed: int) -> None:
    model, _ = trained_model(seed)
    for name, p in model.named_parameters():
        torch.testing.assert_close(reader.read(f"model/{name}"), p.detach(), rtol=0, atol=0)


# The save protocol, phase by phase, as docs/checkpoint-format.md states it; the crash tests below rely on it.
PROTOCOL = [
    "start",
    "tmp_created",
    "tensor_file_torn",
    "tensor_file_written",
    "objects_written",
    "files_synced",
    "manifest_torn",
    "manifest_written",
    "tmp_synced",
    "latest_torn",
    "latest_tmp_written",
    "renamed",
    "latest_renamed",
    "done",
]


def _state(save_dir) -> dict:
    tmp = save_dir / ".tmp-b"
    return {
        "tmp": sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else None,
        "b": (save_dir / "b" / "manifest.json").is_file(),
        "latest": (save_dir / "latest").read_text().strip(),
        "latest.tmp": (save_dir / "latest.tmp").exists(),
    }


def test_a_save_passes_every_kill_point_once_in_protocol_order(tmp_path, monkeypatch):
    """What a save has done when it reaches each point: the kill tests are only as good as this order."""
    save_engine_like(str(tmp_path), "a", 2, seed=1)
    seen: list[tuple[str, dict]] = []

    def record(name, path=None):
        seen.append((name, _state(tmp_path)))

    monkeypatch.setattr(durable, "crash_point", record)
    monkeypatch.setattr(writer, "crash_point", record)
    monkeypatch.setattr(latest, "crash_point", record)
    save_engine_like(str(tmp_path), "b", 2, seed=2)
    assert [name for name, _ in seen] == PROTOCOL == list(CRASH_POINTS)
    state = dict(seen)
    files = ["objects.safetensors", "rank00000.objects.safetensors", "rank00000.safetensors"]
    unpublished = {"b": False, "latest": "a", "latest.tmp": False}
    assert state["start"] == {"tmp": None, **unpublished}
    assert state["tmp_created"] == {"tmp": [], **unpublished}
    assert (
        state["tensor_file_torn"] == state["tensor_file_written"] == {"tmp": ["rank00000.safetensors"], **unpublished}
    )
    assert state["objects_written"] == state["files_synced"] == {"tmp": files, **unpublished}
    for point in ("manifest_torn", "manifest_written", "tmp_synced"):
        assert state[point] == {"tmp": sorted([*files, "manifest.json"]), **unpublished}, point
    journal = {"tmp": sorted([*files, "manifest.json"]), "b": False, "latest": "a", "latest.tmp": True}
    assert state["latest_torn"] == state["latest_tmp_written"] == journal
    assert state["renamed"] == {"tmp": None, "b": True, "latest": "a", "latest.tmp": True}
    for point in ("latest_renamed", "done"):
        assert state[point] == {"tmp": None, "b": True, "latest": "b", "latest.tmp": False}, point


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_sigkill_during_save_leaves_a_loadable_checkpoint(tmp_path, point):
    save_engine_like(str(tmp_path), "a", 2, seed=1)
    status = _save_in_child(tmp_path, "b", seed=2, point=point)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the save did not die at {point}"

    assert open_checkpoint(tmp_path).verify() == []  # `latest` names a complete checkpoint, before any recovery
    latest.recover(tmp_path)  # what the next load (engine.load_checkpoint) or save does first
    reader = open_checkpoint(tmp_path)  # what `latest` names
    want_tag, want_seed = ("b", 2) if point in COMMITTED else ("a", 1)
    assert reader.manifest.tag == want_tag
    assert reader.verify() == []
    _assert_holds_model_of(reader, want_seed)
    _assert_holds_model_of(open_checkpoint(tmp_path, "a"), 1)  # the previous one is untouched either way
    assert reader.objects["step"] == 2 and set(reader.rank_objects(0)) == {"rng", "rank"}

    # the next save succeeds and removes the leftovers of the killed one
    save_engine_like(str(tmp_path), "c", 2, seed=3)
    names = {p.name for p in tmp_path.iterdir()}
    assert not any(n.startswith((".tmp-", ".trash-")) or n == "latest.tmp" for n in names), names
    assert (tmp_path / "latest").read_text().strip() == "c"
    _assert_holds_model_of(open_checkpoint(tmp_path), 3)


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_the_killed_saves_tag_can_be_saved_again(tmp_path, point):
    """The restart of a job whose save of ``b`` was killed reaches the same point and saves ``b`` again: it is
    replaced (``same_save`` matches, or it was never published), never refused, and the previous checkpoint
    survives until the new one is complete. A checkpoint of another point of training under the same tag is
    still refused."""
    save_engine_like(str(tmp_path), "a", 2, seed=1)
    status = _save_in_child(tmp_path, "b", seed=2, point=point)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the save did not die at {point}"
    save_engine_like(str(tmp_path), "b", 2, seed=3, same_save={"step": 2})
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"a", "b", "latest"}, names
    assert (tmp_path / "latest").read_text() == "b\n"
    _assert_holds_model_of(open_checkpoint(tmp_path), 3)
    _assert_holds_model_of(open_checkpoint(tmp_path, "a"), 1)
    with pytest.raises(CheckpointError, match=r"already exists .*another point of training"):
        save_engine_like(str(tmp_path), "b", 2, seed=4, same_save={"step": 3})


@pytest.mark.parametrize("point", ["tmp_synced", "latest_tmp_written", "renamed", "latest_renamed"])
def test_a_replacement_killed_at_any_point_keeps_a_complete_copy(tmp_path, point):
    """Saving a tag that exists (the same step, or ``overwrite=True``) moves the old copy aside only once the new
    one is committed: a crash anywhere leaves ``latest`` on a complete copy of the tag, old or new."""
    save_engine_like(str(tmp_path), "b", 2, seed=1)
    pid = os.fork()
    if pid == 0:
        try:
            os.environ[KILL_ENV] = point
            save_engine_like(str(tmp_path), "b", 2, seed=2, overwrite=True)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), point
    if point == "latest_tmp_written":  # also the state between the two renames of the swap (no kill point there)
        os.replace(tmp_path / "b", tmp_path / ".trash-b")
    latest.recover(tmp_path)
    reader = open_checkpoint(tmp_path)
    assert reader.manifest.tag == "b" and reader.verify() == []
    _assert_holds_model_of(reader, 2 if point in COMMITTED else 1)
