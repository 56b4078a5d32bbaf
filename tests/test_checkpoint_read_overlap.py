"""Direct reads into new memory (issue 22, load speed): the result's pages are populated in one call before each
direct read and the CRC-32 of each direct chunk is computed on a helper thread while the next one is read
([Note: direct reads into new memory] in safetensors_io.py). The values are bitwise those stored, a corrupted byte in
any deferred chunk still fails the read, and a read into place gives the same."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from shardtrain.checkpoint import FlatSlice, SavePiece, open_checkpoint, safetensors_io, save
from shardtrain.errors import CheckpointError

BIG = torch.randn(3 << 20, generator=torch.Generator().manual_seed(5))  # 12 MiB: several 4 MiB direct chunks
CUTS = [(0, 1 << 20), (1 << 20, 2 << 20)]  # two ZeRO fragments of 4 and 8 MiB


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_io, "_DIRECT_CHUNK", 4 << 20)
    pieces = [SavePiece("w", tuple(BIG.shape), FlatSlice(a, n), BIG[a : a + n].clone()) for a, n in CUTS]
    save(tmp_path / "c", "s", None, pieces)
    return tmp_path / "c"


def _spy(monkeypatch) -> dict:
    seen = {"deferred": 0, "populated": 0}
    add, populate = safetensors_io._RunningCrc.add, safetensors_io._populate

    def counting_add(self, data, later):
        seen["deferred"] += later and len(data) >= safetensors_io._DEFER_MIN
        return add(self, data, later)

    def counting_populate(into):
        seen["populated"] += 1
        return populate(into)

    monkeypatch.setattr(safetensors_io._RunningCrc, "add", counting_add)
    monkeypatch.setattr(safetensors_io, "_populate", counting_populate)
    return seen


def test_direct_reads_into_new_and_given_memory_are_bitwise(ckpt, monkeypatch):
    seen = _spy(monkeypatch)
    reader = open_checkpoint(ckpt)
    assert torch.equal(reader.read("w"), BIG)
    assert torch.equal(reader.read("w", (100, (2 << 20) + 100)), BIG[100 : (2 << 20) + 100])
    out = torch.full((3 << 20,), -1.0)
    assert reader.read("w", out=out) is out and torch.equal(out, BIG)
    assert seen["deferred"] >= 6 and seen["populated"] >= 6  # the new paths ran, several chunks per piece


@pytest.mark.parametrize("element", [10, (1 << 20) + 5, (3 << 20) - 1], ids=["first", "middle", "last"])
def test_a_corrupted_byte_in_a_deferred_chunk_fails_the_read(ckpt, monkeypatch, element):
    seen = _spy(monkeypatch)
    path = ckpt / "s" / "rank0.safetensors"
    if not path.exists():
        (path,) = sorted((ckpt / "s").glob("*.safetensors"))
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    piece = 0 if element < CUTS[1][0] else 1
    key = sorted(k for k in header if k != "__metadata__")[piece]
    at = 8 + n + header[key]["data_offsets"][0] + (element - CUTS[piece][0]) * 4
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        open_checkpoint(ckpt).read("w")
    assert seen["deferred"] > 0
