"""A checkpoint directory is untrusted input: piece paths that leave it, files that are not regular files, malformed
safetensors headers and manifests are refused by name (the file and the field) in bounded time, by the reader and
by ``shardtrain checkpoint inspect|consolidate`` (exit status 2), before anything outside the directory is opened."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from contextlib import contextmanager

import pytest

from shardtrain.checkpoint import open_checkpoint
from shardtrain.checkpoint.consolidate import consolidate
from shardtrain.cli import main as cli_main
from shardtrain.errors import CheckpointError

from helpers.checkpoint import save_engine_like

TAG = "t"
FILE = "rank00000.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    d = tmp_path_factory.mktemp("pristine")
    save_engine_like(str(d), TAG, 2, 0)
    return d


@pytest.fixture
def ckpt(pristine, tmp_path):
    shutil.copytree(pristine, tmp_path / "c")
    return tmp_path / "c"


@contextmanager
def deadline(seconds: float = 10.0):
    """Fail instead of hanging: a blocking open or read is interrupted by the alarm."""

    def expired(signum, frame):
        raise AssertionError(f"still running after {seconds} s (a read that blocks?)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _manifest(ckpt):
    return json.loads((ckpt / TAG / "manifest.json").read_text())


def _write_manifest(ckpt, m):
    (ckpt / TAG / "manifest.json").write_text(json.dumps(m))


def _rename_piece_file(ckpt, new_name, tensor="model/block.weight"):
    m = _manifest(ckpt)
    for p in m["tensors"][tensor]["pieces"]:
        p["file"] = new_name
    m["files"][new_name] = m["files"][FILE]
    _write_manifest(ckpt, m)


def _cli(capsys, *args) -> tuple[int, str]:
    code = cli_main(["checkpoint", *map(str, args)])
    return code, capsys.readouterr().err


def _all_tools_refuse(ckpt, tmp_path, capsys, *fragments):
    """open + verify + consolidate raise a CheckpointError (or verify lists the problem), and the CLI exits 2 (1 for
    damage ``--verify`` found), each message holding every fragment."""
    with deadline():
        try:
            problems = open_checkpoint(ckpt).verify()
        except CheckpointError as err:
            problems = [str(err)]
        assert problems and any(all(f in p for f in fragments) for p in problems), problems
        with pytest.raises(CheckpointError) as info:
            consolidate(open_checkpoint(ckpt), tmp_path / "out", progress=False)
        assert all(f in str(info.value) for f in fragments), str(info.value)
        code, err = _cli(capsys, "consolidate", "--no-progress", ckpt, tmp_path / "out2")
        assert code == 2 and all(f in err for f in fragments) and len(err.strip().splitlines()) == 1, err
        code, err = _cli(capsys, "inspect", "--verify", ckpt)
        assert code in (1, 2), err


# -- piece paths -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../rank00000.safetensors", "'..'"),
        ("sub/../../rank00000.safetensors", "'..'"),
        ("/etc/passwd", "absolute path"),
        ("./rank00000.safetensors", "normalised"),
        ("a//b.safetensors", "normalised"),
    ],
)
def test_piece_paths_outside_the_directory_are_refused_at_open(ckpt, tmp_path, capsys, name, why):
    shutil.copy(ckpt / TAG / FILE, ckpt / FILE)  # a valid file where '../' points: it must not be read
    _rename_piece_file(ckpt, name)
    with pytest.raises(CheckpointError, match=why) as info:
        open_checkpoint(ckpt)
    message = str(info.value)
    assert str(ckpt / TAG / "manifest.json") in message and "'model/block.weight'" in message and name in message
    for command in ("inspect", "consolidate"):
        code, err = _cli(capsys, command, ckpt, *([tmp_path / "out"] if command == "consolidate" else []))
        assert code == 2 and name in err and len(err.strip().splitlines()) == 1, err


def test_object_file_path_outside_is_refused(ckpt):
    m = _manifest(ckpt)
    m["files"]["../objects.safetensors"] = m["files"].pop("objects.safetensors")
    for rec in m["objects"].values():
        if rec.get("file") == "objects.safetensors":
            rec["file"] = "../objects.safetensors"
    _write_manifest(ckpt, m)
    with pytest.raises(CheckpointError, match=r"'\.\./objects\.safetensors' has a '\.\.' component"):
        open_checkpoint(ckpt)


def test_symlink_out_of_the_directory_is_refused(ckpt, tmp_path, capsys):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(ckpt / TAG / FILE, outside)  # identical bytes: only the path gives it away
    (ckpt / TAG / FILE).unlink()
    (ckpt / TAG / FILE).symlink_to(outside)
    _all_tools_refuse(ckpt, tmp_path, capsys, "outside the checkpoint directory", FILE)


def test_symlink_inside_the_directory_is_followed(ckpt):
    (ckpt / TAG / FILE).rename(ckpt / TAG / "real.safetensors")
    (ckpt / TAG / FILE).symlink_to("real.safetensors")
    assert open_checkpoint(ckpt).verify() == []


def test_writer_names_files_relative_and_normalised(pristine):
    m = _manifest(pristine)
    names = {*m["files"], *(p["file"] for t in m["tensors"].values() for p in t["pieces"])}
    assert names and all("/" not in n and n not in (".", "..") and not n.startswith(".") for n in names), names


# -- files that are not regular files ----------------------------------------------------------------------------
def _replace(path, kind):
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink loop":
        path.symlink_to(path.name)
    elif kind == "device":
        path.symlink_to("/dev/zero")  # also outside the directory: refused either way, never read


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink loop", "device"])
@pytest.mark.parametrize("victim", [FILE, "objects.safetensors"])
def test_non_regular_files_are_refused_without_blocking(ckpt, tmp_path, capsys, kind, victim):
    _replace(ckpt / TAG / victim, kind)
    why = {
        "fifo": "is a FIFO",
        "directory": "is a directory",
        "symlink loop": "symbolic links",
        "device": "outside the checkpoint directory",
    }[kind]
    _all_tools_refuse(ckpt, tmp_path, capsys, str(ckpt / TAG / victim), why)


def test_fifo_manifest_is_refused_without_blocking(ckpt, capsys):
    _replace(ckpt / TAG / "manifest.json", "fifo")
    with deadline():
        with pytest.raises(CheckpointError, match=r"manifest\.json"):
            open_checkpoint(ckpt, TAG)
        with pytest.raises(CheckpointError, match=r"manifest\.json"):
            open_checkpoint(ckpt)
        code, err = _cli(capsys, "inspect", ckpt)
    assert code == 2 and "manifest.json" in err


# -- malformed safetensors headers ------------------------------------------------------------------------------
def _edit_header(ckpt, edit, key="model/block.weight"):
    """Rewrite the header of the tensor file with ``edit(header)`` (or ``edit(header, key)``) and record the new
    size in the manifest, so that only the header is wrong."""
    path = ckpt / TAG / FILE
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header[key])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    m = _manifest(ckpt)
    m["files"][FILE]["size"] = path.stat().st_size
    _write_manifest(ckpt, m)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda h: h.update(shape=432), "'shape'"),
        (lambda h: h.update(shape=[36, "12"]), "'shape'"),
        (lambda h: h.update(shape=[-36, -12]), "'shape'"),
        (lambda h: h.update(data_offsets=["0", "16"]), "'data_offsets'"),
        (lambda h: h.update(data_offsets=[-8, h["data_offsets"][1]]), "'data_offsets'"),
        (lambda h: h.update(data_offsets=[h["data_offsets"][1], h["data_offsets"][0]]), "'data_offsets'"),
        (lambda h: h.update(data_offsets=[0, 10**15]), "'data_offsets'"),
        (lambda h: h.update(data_offsets=[h["data_offsets"][0] + 4, h["data_offsets"][1] + 4]), "overlap"),
        (lambda h: h.update(shape=[10**12, 10**12]), "'data_offsets'"),
        (lambda h: h.update(dtype=7), "'dtype'"),
        (lambda h: h.update(dtype="F16"), "holds"),  # half the bytes of the offsets
    ],
)
def test_malformed_safetensors_header_is_named(ckpt, tmp_path, capsys, edit, field):
    _edit_header(ckpt, edit)
    _all_tools_refuse(ckpt, tmp_path, capsys, str(ckpt / TAG / FILE), "model/block.weight", field)


def test_header_length_beyond_the_file(ckpt, tmp_path, capsys):
    path = ckpt / TAG / FILE
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", 2**63)
    path.write_bytes(bytes(raw))
    _all_tools_refuse(ckpt, tmp_path, capsys, str(path), "header length")


def test_deep_safetensors_header(ckpt, tmp_path, capsys):
    path = ckpt / TAG / FILE
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    deep = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path.write_bytes(struct.pack("<Q", len(deep)) + deep + raw[8 + n :])
    m = _manifest(ckpt)
    m["files"][FILE]["size"] = path.stat().st_size
    _write_manifest(ckpt, m)
    _all_tools_refuse(ckpt, tmp_path, capsys, str(path), "nested too deeply")


# -- malformed manifests ----------------------------------------------------------------------------------------
def test_deep_manifest(ckpt, capsys):
    (ckpt / TAG / "manifest.json").write_text(
        '{"format": "shardtrain-checkpoint", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    with pytest.raises(CheckpointError, match="nested too deeply") as info:
        open_checkpoint(ckpt)
    assert str(ckpt / TAG / "manifest.json") in str(info.value)
    code, err = _cli(capsys, "inspect", ckpt)
    assert code == 2 and "nested too deeply" in err


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (lambda t: t.update(shape=[10**12, 10**12]), ("'shape'", "bytes")),
        (lambda t: t.update(shape=432), ("'shape'", "not a list")),
        (lambda t: t.update(shape=[True, 432]), ("'shape'",)),
        (lambda t: t.update(shape=[1] * 65 + [432]), ("'shape'",)),
        (lambda t: t.update(pieces=5), ("'pieces'",)),
        (lambda t: t["pieces"][0].update(slice=7), ("piece 0",)),
        (lambda t: t["pieces"][0].update(key=["k"]), ("key",)),
        (lambda t: t.update(dtype=["float32"]), ("dtype",)),
        # a piece claiming more bytes than its file holds: refused before a read allocates room for it
        (
            lambda t: t.update(
                shape=[10**6, 10**3],
                pieces=[{**t["pieces"][0], "slice": {"kind": "flat", "start": 0, "length": 10**9}}],
            ),
            ("more than its file",),
        ),
        # a column split of a huge tensor: runs bounded before any run table is built
        (
            lambda t: t.update(
                shape=[2**40, 2],
                pieces=[
                    {**t["pieces"][0], "slice": {"kind": "block", "dim": 1, "index": i, "count": 2}} for i in range(2)
                ],
            ),
            ("runs",),
        ),
    ],
)
def test_malformed_manifest_fields_are_named(ckpt, capsys, edit, fragments):
    m = _manifest(ckpt)
    edit(m["tensors"]["model/block.weight"])
    _write_manifest(ckpt, m)
    with deadline():
        with pytest.raises(CheckpointError) as info:
            open_checkpoint(ckpt)
        code, err = _cli(capsys, "inspect", ckpt)
    message = str(info.value)
    assert str(ckpt / TAG / "manifest.json") in message and "'model/block.weight'" in message, message
    assert all(f in message for f in fragments), message
    assert code == 2 and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(tensors=[]),
        lambda m: m.update(files={"a": 5}),
        lambda m: m["files"][FILE].update(size=-1),
        lambda m: m["files"][FILE].update(size="19312"),
        lambda m: m.update(world_size=True),
        lambda m: m.update(version=1.0),
        lambda m: m.update(rank_objects={"x": {}}),
        lambda m: m.update(objects={"step": 3}),
        lambda m: m.update(tag=["t"]),
    ],
)
def test_malformed_manifest_sections_are_named(ckpt, capsys, edit):
    m = _manifest(ckpt)
    edit(m)
    _write_manifest(ckpt, m)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(ckpt)
    assert str(ckpt / TAG / "manifest.json") in str(info.value)
    code, _ = _cli(capsys, "inspect", ckpt)
    assert code == 2


def test_huge_integer_in_manifest(ckpt):
    text = (ckpt / TAG / "manifest.json").read_text().replace('"world_size": 2', '"world_size": ' + "9" * 5000, 1)
    (ckpt / TAG / "manifest.json").write_text(text)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        open_checkpoint(ckpt)


def test_manifest_that_is_not_a_regular_file_is_refused_by_the_reader(ckpt):
    """``read_manifest`` checks by itself, whatever found the directory (a FIFO swapped in after the lookup)."""
    from shardtrain.checkpoint.reader import read_manifest

    _replace(ckpt / TAG / "manifest.json", "fifo")
    with deadline(), pytest.raises(CheckpointError, match="is a FIFO, not a regular file"):
        read_manifest(ckpt / TAG)
    (ckpt / TAG / "manifest.json").unlink()
    (ckpt / TAG / "manifest.json").symlink_to(ckpt.parent / "elsewhere.json")
    (ckpt.parent / "elsewhere.json").write_text("{}")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        read_manifest(ckpt / TAG)


# -- shapes checked against the files and each other ----------------------------------------------------------
def _transpose(ckpt, name):
    m = _manifest(ckpt)
    m["tensors"][name]["shape"] = m["tensors"][name]["shape"][::-1]
    _write_manifest(ckpt, m)


def test_transposed_shape_of_flat_pieces_fails_verify_and_consolidate(ckpt, tmp_path, capsys):
    """ZeRO fragments are stored 1-D: the element count matches, and the parameter's optimizer states tell."""
    _transpose(ckpt, "model/block.weight")  # (36, 12) -> (12, 36), same 432 elements
    problems = open_checkpoint(ckpt).verify()
    assert problems and all("'model/block.weight'" in p and "[12, 36]" in p for p in problems), problems
    code, _ = _cli(capsys, "inspect", "--verify", ckpt)
    assert code == 1
    code, err = _cli(capsys, "consolidate", "--no-progress", ckpt, tmp_path / "out")
    assert code == 2 and "'model/block.weight'" in err and "nothing was written" in err, err
    assert not (tmp_path / "out").exists()


def test_transposed_shape_of_block_pieces_fails_verify_and_consolidate(tmp_path, capsys):
    """Tensor-parallel blocks are stored in their shape: the safetensors header contradicts the manifest."""
    import torch

    from shardtrain.checkpoint import BlockSlice, SavePiece, save

    w = torch.arange(24.0).reshape(4, 6)
    pieces = [SavePiece("model/w", (4, 6), BlockSlice(0, i, 2), w[2 * i : 2 * i + 2]) for i in range(2)]
    save(tmp_path / "s", TAG, None, pieces)
    _transpose(tmp_path / "s", "model/w")  # (6, 4): blocks of (3, 4), the files hold (2, 6)
    problems = open_checkpoint(tmp_path / "s").verify()
    assert len(problems) == 2 and all("[2, 6] in the file's header" in p and "[3, 4]" in p for p in problems)
    code, err = _cli(capsys, "consolidate", "--no-progress", tmp_path / "s", tmp_path / "out")
    assert code == 2 and "'model/w'" in err and FILE in err, err
    assert not (tmp_path / "out").exists()  # refused before the output file was begun


def test_a_flat_piece_without_optimizer_state_is_contradicted_by_the_shape_its_file_records(tmp_path, capsys):
    """A buffer stored flat, or a parameter permuted together with every state: only the global shape the writer
    recorded in the file (``safetensors_io.GLOBAL_SHAPES_KEY``) contradicts the edited manifest."""
    import torch

    from shardtrain.checkpoint import FlatSlice, SavePiece, save

    b = torch.arange(24.0).reshape(4, 6)
    pieces = [
        SavePiece("model/buffer", (4, 6), FlatSlice(12 * i, 12), b.reshape(-1)[12 * i : 12 * i + 12]) for i in (0, 1)
    ]
    save(tmp_path / "s", TAG, None, pieces)
    assert open_checkpoint(tmp_path / "s").verify() == []
    _transpose(tmp_path / "s", "model/buffer")  # (6, 4): the same 24 elements
    problems = open_checkpoint(tmp_path / "s").verify()
    assert problems and all("a piece of a tensor of shape [4, 6] as written" in p and "[6, 4]" in p for p in problems)
    with pytest.raises(CheckpointError, match=r"shape \[4, 6\] as written, the manifest says \[6, 4\]"):
        open_checkpoint(tmp_path / "s").read("model/buffer")
    code, err = _cli(capsys, "consolidate", "--no-progress", tmp_path / "s", tmp_path / "out")
    assert code == 2 and "'model/buffer'" in err, err
    assert not (tmp_path / "out").exists()


# -- a collective load ------------------------------------------------------------------------------------------
def _load_with_fifo(root: str) -> tuple[float, str]:
    import time

    import torch.distributed as dist

    from helpers.resume import make_engine, train

    engine = make_engine(0, 2, "adamw")
    train(engine, range(1))
    engine.save_checkpoint(root, tag="t")
    dist.barrier()
    if dist.get_rank() == 1:  # only this rank's file: rank 0 may read nothing from it
        victim = f"{root}/t/rank00001.safetensors"
        os.unlink(victim)
        os.mkfifo(victim)
    dist.barrier()
    start = time.monotonic()
    try:
        engine.load_checkpoint(root)
    except CheckpointError as err:
        return time.monotonic() - start, str(err)
    return time.monotonic() - start, "no error"


def test_fifo_in_a_multi_rank_load_fails_on_every_rank_at_once(tmp_path):
    """A FIFO used to block the rank opening it, and the others waited for the collective timeout (1,800 s): now
    the rank refuses it by stat, and every rank raises its message in the outcome exchange."""
    from shardtrain.testing import run_distributed

    results = run_distributed(_load_with_fifo, 2, str(tmp_path), timeout=120)
    for elapsed, message in results:
        assert "rank00001.safetensors: is a FIFO, not a regular file" in message, message
        assert elapsed < 20, elapsed
