"""``latest`` names a tag inside its save directory and nothing else ([Note: latest names a tag inside the save
directory] in checkpoint/latest.py): every other value is refused by name, by our reader, by the DeepSpeed reader's
probe (which then leaves it to ours) and by the engine's load; and the publish journal's recovery in isolation."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardtrain.checkpoint import FlatSlice, SavePiece, latest, open_checkpoint, save, writer
from shardtrain.checkpoint.foreign.deepspeed_format import find_deepspeed_dir
from shardtrain.checkpoint.latest import LatestError, PublishError, read_latest, recover
from shardtrain.distributed.communicator import Communicator
from shardtrain.errors import CheckpointError, ShardtrainError
from shardtrain.testing import run_distributed

PIECE = [SavePiece("model/w", (2, 3), FlatSlice(0, 6), torch.arange(6.0))]


@pytest.fixture
def save_dir(tmp_path):
    """``tmp_path/run`` with one checkpoint ``a``, and ``tmp_path/outside``: a complete checkpoint that is not in it."""
    save(tmp_path / "outside", "elsewhere", None, [SavePiece("model/w", (2, 3), FlatSlice(0, 6), torch.ones(6))])
    save(tmp_path / "run", "a", None, PIECE)
    return tmp_path / "run"


def _bad_values(save_dir):
    outside = save_dir.parent / "outside" / "elsewhere"
    os.symlink(outside, save_dir / "link-out")
    (save_dir / ".tmp-b").mkdir()
    shutil.copytree(save_dir / "a", save_dir / ".tmp-c")  # complete, but a temporary directory
    return {
        "absolute": (str(outside), "an absolute path"),
        "parent": ("../outside/elsewhere", "a path leading out of the save directory"),
        "dotdot": ("..", "a path leading out of the save directory"),
        "separator": ("a/b", "a path, not a tag"),
        "backslash": ("a\\b", "a path, not a tag"),
        "symlink out": ("link-out", f"a symbolic link to {outside.resolve()}, outside the save directory"),
        "tmp dir": (".tmp-c", "the temporary directory of a save that never finished"),
        "hidden": (".trash-a", "not a checkpoint tag (tags do not start with '.')"),
        "empty": ("", "which is empty"),
    }


CASES = ["absolute", "parent", "dotdot", "separator", "backslash", "symlink out", "tmp dir", "hidden", "empty"]


@pytest.mark.parametrize("case", CASES)
def test_a_latest_naming_anything_but_a_tag_inside_is_refused_by_name(save_dir, case):
    value, why = _bad_values(save_dir)[case]
    (save_dir / "latest").write_text(value + "\n")
    for read in (read_latest, open_checkpoint):
        with pytest.raises(LatestError) as err:
            read(save_dir)
        message = str(err.value)
        assert message.startswith(f"{save_dir / 'latest'} names {value!r}, {why}; "), message
        assert isinstance(err.value, CheckpointError) and isinstance(err.value, ShardtrainError)
    assert find_deepspeed_dir(save_dir) is None  # the DeepSpeed probe does not follow it either


def test_a_latest_that_is_a_link_out_or_no_regular_file_is_refused(save_dir, tmp_path):
    (tmp_path / "other-latest").write_text("a\n")
    (save_dir / "latest").unlink()
    os.symlink(tmp_path / "other-latest", save_dir / "latest")
    with pytest.raises(LatestError, match=r"latest is a symbolic link to .*other-latest, outside"):
        open_checkpoint(save_dir)
    (save_dir / "latest").unlink()
    os.mkfifo(save_dir / "latest")  # reading it would block forever
    with pytest.raises(LatestError, match="latest is not a regular file"):
        open_checkpoint(save_dir)
    (save_dir / "latest").unlink()
    (save_dir / "latest").write_text("a" * 5000)
    with pytest.raises(LatestError, match="holds 5000 bytes, not one tag"):
        open_checkpoint(save_dir)


def test_what_stays_allowed(save_dir):
    """A tag, with or without its newline; a link to a checkpoint inside the directory; a `latest` linked inside."""
    assert open_checkpoint(save_dir).manifest.tag == "a"
    (save_dir / "latest").write_text("a")
    assert read_latest(save_dir) == "a"
    os.symlink(save_dir / "a", save_dir / "alias")
    (save_dir / "latest").write_text("alias\n")
    assert open_checkpoint(save_dir).path == save_dir / "alias"
    (save_dir / "pointer").write_text("a\n")
    (save_dir / "latest").unlink()
    os.symlink("pointer", save_dir / "latest")
    assert read_latest(save_dir) == "a"
    (save_dir / "latest").unlink()
    assert read_latest(save_dir) is None


def _engine_load(save_dir: str) -> str:
    import shardtrain

    engine = shardtrain.initialize(
        torch.nn.Linear(3, 2), config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD"}}
    )
    try:
        engine.load_checkpoint(save_dir)
    except CheckpointError as err:
        return str(err)
    return "loaded"


def test_the_engine_refuses_it_too(save_dir):
    (save_dir / "latest").write_text("../outside/elsewhere\n")
    message = run_distributed(_engine_load, 1, str(save_dir), timeout=120)[0]
    assert f"rank 0 failed to load checkpoint {save_dir}: {save_dir / 'latest'} names '../outside/elsewhere'" in (
        message
    )


# -- the journal's recovery alone (the kill tests are in test_checkpoint_crash.py) --------------------------------


def test_recover_rolls_a_committed_save_forward_and_drops_a_torn_one(save_dir):
    shutil.copytree(save_dir / "a", save_dir / ".tmp-b")  # complete and committed: the journal names it
    (save_dir / "latest.tmp").write_text("b\n")
    assert recover(save_dir) == [
        f"finished the save of {save_dir / 'b'} that a crash interrupted after it was committed: 'latest' names it now"
    ]
    assert sorted(p.name for p in save_dir.iterdir()) == ["a", "b", "latest"]
    assert read_latest(save_dir) == "b"
    assert recover(save_dir) == []  # nothing more to do, nothing written

    shutil.copytree(save_dir / "a", save_dir / ".tmp-c")
    (save_dir / "latest.tmp").write_text("c")  # torn: no newline
    assert recover(save_dir) == [f"removed {save_dir / 'latest.tmp'} (torn): that save was never committed"]
    (save_dir / "latest.tmp").write_text("../outside/elsewhere\n")  # never followed, even from the journal
    assert "(torn)" in recover(save_dir)[0]
    (save_dir / ".tmp-c" / "rank00000.safetensors").write_bytes(b"short")
    (save_dir / "latest.tmp").write_text("c\n")  # names a copy whose file has the wrong size: not complete
    assert "which is not complete" in recover(save_dir)[0]
    assert read_latest(save_dir) == "b"


def test_recover_moves_back_what_an_interrupted_overwrite_moved_aside(save_dir):
    os.replace(save_dir / "a", save_dir / ".trash-a")  # an older version's overwrite, killed between its renames
    assert recover(save_dir) == [
        f"moved {save_dir / '.trash-a'} back to {save_dir / 'a'}: an interrupted overwrite had moved it aside"
    ]
    assert open_checkpoint(save_dir).manifest.tag == "a"


# -- publish what exists ([Note: publish what exists] in checkpoint/latest.py) ---------------------------------------


def _vanish_at(point: str, save_dir):
    """A crash-point hook that removes the save's temporary directory when the save reaches ``point`` (as a user's
    ``rm`` or another job's clean-up would)."""

    def hook(name, path=None):
        if name == point:
            shutil.rmtree(save_dir / ".tmp-b")

    return hook


@pytest.mark.parametrize(
    ("module", "point"),
    [(writer, "tmp_synced"), (latest, "latest_tmp_written")],  # before the journal, between journal and rename
)
def test_a_save_whose_directory_vanished_before_publish_fails_and_latest_keeps_the_previous(
    save_dir, monkeypatch, module, point
):
    monkeypatch.setattr(module, "crash_point", _vanish_at(point, save_dir))
    with pytest.raises(PublishError, match=r"vanished before it was published .*'latest' still names 'a'"):
        save(save_dir, "b", None, PIECE)
    monkeypatch.undo()
    assert read_latest(save_dir) == "a"
    assert sorted(p.name for p in save_dir.iterdir()) == ["a", "latest"]  # no journal, no half-published tag
    torch.testing.assert_close(open_checkpoint(save_dir).read("model/w").reshape(-1), PIECE[0].tensor, rtol=0, atol=0)
    save(save_dir, "b", None, PIECE)  # the tag can be saved again
    assert read_latest(save_dir) == "b"


def _vanish_on_every_rank(root: str) -> str:
    comm = Communicator(dist.group.WORLD, 60.0)
    save(root, "a", comm, [SavePiece("model/w", (2, 4), FlatSlice(4 * comm.rank, 4), torch.ones(4))])
    if comm.rank == 0:
        writer.crash_point = _vanish_at("tmp_synced", Path(root))
    try:
        save(root, "b", comm, [SavePiece("model/w", (2, 4), FlatSlice(4 * comm.rank, 4), torch.ones(4))])
    except PublishError as err:
        return f"{type(err).__name__}: {err}"
    return "saved"


def test_every_rank_raises_the_publish_error(tmp_path):
    for rank, message in enumerate(run_distributed(_vanish_on_every_rank, 2, str(tmp_path), timeout=60)):
        assert message.startswith("PublishError: rank 0 failed to save checkpoint"), (rank, message)
    assert read_latest(tmp_path) == "a"
