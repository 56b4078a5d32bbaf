"""Loads into new tensors read around the page cache (issue 22: loading at the speed of the disk): a new result is
placed at the file position's offset within a block (``empty_at_phase``) and the uncached parts of its file are read
with O_DIRECT on reader threads. The tensors must be bitwise those saved, outlive the reader, and a corrupted byte
read that way must still fail the read with the checksum error."""

from __future__ import annotations

import gc
import json
import os
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
def uncached(monkeypatch):
    """Counts reads around the page cache; chunks of 256 KiB and a 64 KiB minimum, so that each fragment is
    several chunks, more than the reader threads, in flight at once."""
    seen = []
    original = safetensors_io._Uncached.read

    def counting(self, buffered_fd, into, pos):
        seen.append(len(into))
        return original(self, buffered_fd, into, pos)

    monkeypatch.setattr(safetensors_io._Uncached, "read", counting)
    monkeypatch.setattr(safetensors_io, "_DIRECT_CHUNK", 256 << 10)
    monkeypatch.setattr(safetensors_io, "_UNCACHED_MIN", 64 << 10)
    return seen


def _cold_reader(directory):
    drop_cache(directory)
    reader = open_checkpoint(directory)
    path = reader.path / reader.entry("w").pieces[0].file
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = safetensors_io._resident_pages(fd, 0, path.stat().st_size)
    finally:
        os.close(fd)
    if pages is None or not hasattr(os, "O_DIRECT") or pages.strip(b"\0") == pages:
        pytest.skip("this file system keeps the checkpoint in memory (no eviction) or has no O_DIRECT")
    return reader


def test_new_tensors_read_around_the_cache_are_bitwise_and_outlive_the_reader(ckpt, uncached):
    reader = _cold_reader(ckpt)
    got = {name: reader.read(name) for name in CUTS}
    fragments = {(name, a): reader.read(name, (a, a + n)) for name, (_, cuts) in CUTS.items() for a, n in cuts}
    across = reader.read("w", (599_000, 1_400_000))  # over both fragment boundaries
    assert uncached, "no read went around the page cache"
    del reader
    gc.collect()
    junk = [torch.full((1 << 18,), 7.0) for _ in range(16)]  # reuse any memory that was freed
    for name, (t, cuts) in CUTS.items():
        assert got[name].is_contiguous() and torch.equal(got[name], t), name
        for a, n in cuts:
            assert torch.equal(fragments[(name, a)], t[a : a + n]), (name, a)
    assert torch.equal(across, W[599_000:1_400_000])
    del junk


def test_reads_into_given_tensors_go_through_the_page_cache(ckpt, uncached):
    """``out=`` (the engine's weights) is out of phase with the file: it is read through the page cache (faster
    than O_DIRECT into an aligned buffer and a copy, docs/benchmarks-loadspeed.md), bitwise, writing nothing
    outside the asked range of ``out``; a new result of the same read still goes around the cache."""
    reader = _cold_reader(ckpt)
    out = torch.full((W.numel() + 2,), -2.0)  # W[1:-1] lands in out[1:-3]
    reader.read("w", (1, W.numel() - 1), out=out[1:-3])
    assert uncached == [], "a read into a given tensor went around the page cache"
    assert torch.equal(out[1:-3], W[1:-1])
    assert out[0].item() == -2.0 and torch.equal(out[-3:], torch.full((3,), -2.0))
    whole = torch.empty_like(V)
    assert torch.equal(reader.read("v", out=whole), V)
    assert uncached == []
    reader = _cold_reader(ckpt)
    assert torch.equal(reader.read("w", (1, W.numel() - 1)), W[1:-1])
    assert uncached, "a new result was not read around the page cache"


def test_a_cached_file_is_read_through_the_cache(ckpt, uncached):
    """Right after a save (or a first read) the file is in memory: a buffered read serves it without the disk."""
    reader = open_checkpoint(ckpt)
    reader.read("w")  # now cached, whatever it was before
    uncached.clear()
    assert torch.equal(reader.read("w"), W)
    assert uncached == []


@pytest.mark.parametrize("element", [3, 300_000, 699_999], ids=["first-chunk", "middle-chunk", "last-chunk"])
def test_corruption_read_around_the_cache_fails_the_read(ckpt, tmp_path, uncached, element):
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
    assert uncached, "the corrupted piece was not read around the page cache"
