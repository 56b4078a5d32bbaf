"""Damaged checkpoints fail with errors that name the file and the tensor; unknown versions are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shardtrain.checkpoint import FlatSlice, Manifest, open_checkpoint
from shardtrain.checkpoint.format import BlockSlice, check_coverage
from shardtrain.errors import CheckpointError

from helpers.checkpoint import save_engine_like

TAG = "global_step2"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    d = tmp_path_factory.mktemp("pristine")
    save_engine_like(str(d), TAG, 2, 0)  # one process writing a world-2 layout: two ranks' fragments, one file
    return d


@pytest.fixture
def ckpt(pristine, tmp_path):
    shutil.copytree(pristine, tmp_path / "c")
    return tmp_path / "c"


def _file_and_piece(ckpt, name="model/block.weight"):
    reader = open_checkpoint(ckpt)
    entry = reader.entry(name)
    return reader.path / entry.pieces[0].file, entry


def _data_offset(path, key):
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    return 8 + header_len + header[key]["data_offsets"][0]


def test_flipped_byte_names_file_and_tensor(ckpt):
    path, entry = _file_and_piece(ckpt)
    raw = bytearray(path.read_bytes())
    raw[_data_offset(path, entry.pieces[0].key) + 5] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch") as info:
        open_checkpoint(ckpt).read("model/block.weight")
    assert str(path) in str(info.value) and "'model/block.weight'" in str(info.value)
    # other tensors are still readable; the full check lists exactly the damaged piece
    open_checkpoint(ckpt).read("model/norm.weight")
    problems = open_checkpoint(ckpt).verify()
    assert len(problems) == 1 and "'model/block.weight'" in problems[0] and path.name in problems[0]


def test_truncated_file(ckpt):
    path, _ = _file_and_piece(ckpt)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="truncated") as info:
        open_checkpoint(ckpt).read("model/block.weight")
    assert str(path) in str(info.value) and "'model/block.weight'" in str(info.value)


def test_deleted_file(ckpt):
    path, _ = _file_and_piece(ckpt)
    path.unlink()
    with pytest.raises(CheckpointError, match="missing") as info:
        open_checkpoint(ckpt).read("optim/block.weight/exp_avg")
    assert str(path) in str(info.value) and "'optim/block.weight/exp_avg'" in str(info.value)


def test_corrupted_object_file(ckpt):
    path = ckpt / TAG / "objects.safetensors"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"objects\.safetensors: checksum mismatch"):
        open_checkpoint(ckpt).objects  # noqa: B018
    assert open_checkpoint(ckpt).manifest.objects["step"].value == 2  # inline objects do not depend on the file


def test_bad_manifest_json(ckpt):
    m = ckpt / TAG / "manifest.json"
    m.write_text(m.read_text()[:-40])
    with pytest.raises(CheckpointError, match="not valid JSON") as info:
        open_checkpoint(ckpt)
    assert str(m) in str(info.value)


def test_unknown_version_refused(ckpt):
    m = ckpt / TAG / "manifest.json"
    d = json.loads(m.read_text())
    d["version"] = 99
    m.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="format version 99 is not supported"):
        open_checkpoint(ckpt)


def test_manifest_json_round_trip(pristine):
    reader = open_checkpoint(pristine)
    again = Manifest.from_json(reader.manifest.to_json())
    assert again == reader.manifest


def test_malformed_manifest_entries(ckpt):
    m = ckpt / TAG / "manifest.json"
    d = json.loads(m.read_text())
    d["tensors"]["model/block.weight"]["pieces"][0]["slice"]["length"] += 1
    m.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"'model/block\.weight'"):
        open_checkpoint(ckpt)


def test_object_file_missing_from_the_file_list(ckpt):
    m = ckpt / TAG / "manifest.json"
    d = json.loads(m.read_text())
    d["objects"]["client_state"]["file"] = "elsewhere.safetensors"
    m.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"object 'client_state': file 'elsewhere\.safetensors' is not in the"):
        open_checkpoint(ckpt)


def test_slice_validation():
    with pytest.raises(CheckpointError):
        FlatSlice(-1, 3)
    with pytest.raises(CheckpointError):
        BlockSlice(0, 2, 2)
    with pytest.raises(CheckpointError, match="does not split"):
        BlockSlice(0, 0, 2, stride=3).validate((8, 4))
    with pytest.raises(CheckpointError, match="does not exist"):
        BlockSlice(2, 0, 2).validate((8, 4))
    check_coverage("x", (6, 4), [BlockSlice(0, i, 2, stride=3) for i in range(2)])
    with pytest.raises(CheckpointError, match="no stored piece"):
        check_coverage("x", (6, 4), [BlockSlice(1, 0, 2)])


@pytest.mark.parametrize(("dim", "count", "stride"), [(1, 2, 3), (0, 2, 1), (1, 3, 1), (2, 2, 2), (1, 1, 1)])
def test_block_runs_locate_the_piece(dim, count, stride):
    """The runs of a block slice map each piece element to the global element torch's chunking puts there."""
    g = torch.arange(4 * 12 * 8).reshape(4, 12, 8)
    for index in range(count):
        s = BlockSlice(dim, index, count, stride)
        s.validate(tuple(g.shape))
        piece = torch.cat([grp.chunk(count, dim)[index] for grp in g.chunk(stride, dim)], dim)
        assert tuple(piece.shape) == s.piece_shape(tuple(g.shape))
        flat_g, flat_p = g.reshape(-1), piece.reshape(-1)
        covered = 0
        for gs, ps, n in s.runs(tuple(g.shape)):
            assert torch.equal(flat_g[gs : gs + n], flat_p[ps : ps + n])
            covered += n
        assert covered == piece.numel()


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 65537, (3 << 20) + 5])
def test_checksums_are_zlibs_crc32(size):
    """Checkpoints written before the checksum moved to ISA-L (and by other tools) carry zlib's CRC-32: the values,
    chained over chunks as the reader computes them, must be zlib's bit for bit."""
    import zlib

    from shardtrain.checkpoint.format import crc32, crc32_of, crc32_of_bytes

    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    raw = data.numpy().tobytes()
    assert crc32_of_bytes(raw) == f"crc32:{zlib.crc32(raw):08x}"
    assert crc32_of(data) == crc32_of_bytes(raw)
    running = 0
    for start in range(0, size, 1000):
        running = crc32(memoryview(raw)[start : start + 1000], running)
    assert running == zlib.crc32(raw)
