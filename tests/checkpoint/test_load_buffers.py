"""Loads of a checkpoint evicted from the page cache (issue 22: loading at the speed of the disk), into new tensors
and into given ones, in chunks read straight into the result: the tensors must be bitwise those saved, outlive the
reader, a given tensor must be written only in the asked range, and a corrupted byte in any chunk must fail the read
with the checksum error naming file and tensor."""

from __future__ import annotations

import gc
import json
import shutil

import pytest
import torch

from shardtrain.checkpoint import FlatSlice, SavePiece, open_checkpoint, safetensors_io, save
from shardtrain.errors import CheckpointError
from shardtrain.testing import drop_cache

_gen = torch.Generator().manual_seed(5)
# 1.5 Mi float32 in 3 uneven ZeRO fragments (none starts on a block boundary of its file), a bf16 vector in 2
W = torch.randn(3 << 19, generator=_gen)
V = torch.randn(3 << 19, generator=_gen).to(torch.bfloat16)
CUTS = {"w": (W, [(0, 600_001), (600_001, 700_003)]), "v": (V, [(0, 1_000_001)])}
for _name, (_t, _cuts) in CUTS.items():
    _a, _n = _cuts[-1]
    _cuts.append((_a + _n, _t.numel() - _a - _n))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("buffers")
    pieces = [
        SavePiece(name, tuple(t.shape), FlatSlice(a, n), t[a : a + n].clone())
        for name, (t, cuts) in CUTS.items()
        for a, n in cuts
    ]
    save(d, "s", None, pieces)
    return d


@pytest.fixture
def chunks(monkeypatch):
    """Chunks of 256 KiB, so that each fragment is read in several, straight into the result."""
    monkeypatch.setattr(safetensors_io, "_DIRECT_CHUNK", 256 << 10)


def _cold_reader(directory):
    drop_cache(directory)
    return open_checkpoint(directory)


def test_new_tensors_read_cold_are_bitwise_and_outlive_the_reader(ckpt, chunks):
    reader = _cold_reader(ckpt)
    got = {name: reader.read(name) for name in CUTS}
    fragments = {(name, a): reader.read(name, (a, a + n)) for name, (_, cuts) in CUTS.items() for a, n in cuts}
    across = reader.read("w", (599_000, 1_400_000))  # over both fragment boundaries
    del reader
    gc.collect()
    junk = [torch.full((1 << 18,), 7.0) for _ in range(16)]  # reuse any memory that was freed
    for name, (t, cuts) in CUTS.items():
        assert got[name].is_contiguous() and torch.equal(got[name], t), name
        for a, n in cuts:
            assert torch.equal(fragments[(name, a)], t[a : a + n]), (name, a)
    assert torch.equal(across, W[599_000:1_400_000])
    del junk


def test_reads_into_given_tensors_write_only_the_asked_range(ckpt, chunks):
    """``out=`` (the engine's weights): bitwise, and nothing outside the asked range of ``out`` is written."""
    reader = _cold_reader(ckpt)
    out = torch.full((W.numel() + 2,), -2.0)  # W[1:-1] lands in out[1:-3]
    reader.read("w", (1, W.numel() - 1), out=out[1:-3])
    assert torch.equal(out[1:-3], W[1:-1])
    assert out[0].item() == -2.0 and torch.equal(out[-3:], torch.full((3,), -2.0))
    whole = torch.empty_like(V)
    assert torch.equal(reader.read("v", out=whole), V)


@pytest.mark.parametrize("element", [3, 300_000, 699_999], ids=["first-chunk", "middle-chunk", "last-chunk"])
def test_corruption_read_cold_fails_the_read(ckpt, tmp_path, chunks, element):
    copy = tmp_path / "c"
    shutil.copytree(ckpt, copy)
    reader = open_checkpoint(copy)
    piece = reader.entry("w").pieces[1]
    path = reader.path / piece.file
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8 : 8 + header_len])[piece.key]["data_offsets"][0]
    raw[8 + header_len + begin + element * 4 + 2] ^= 0x04
    path.write_bytes(bytes(raw))
    reader = _cold_reader(copy)
    with pytest.raises(CheckpointError, match="checksum mismatch") as info:
        reader.read("w", (600_001, 1_300_004))
    assert str(path) in str(info.value) and "'w'" in str(info.value)
