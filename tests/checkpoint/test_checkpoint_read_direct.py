"""Reads straight into the result (issue 22: loading at the speed of the disk): long segments of a stored piece are
read into the result tensor without a buffer, the rest through the chunk buffer; both give bitwise the tensor cut
with torch, and every byte read is still checksummed (corruption in a directly read part, or in a part read only
for the checksum, fails the read)."""

from __future__ import annotations

import json

import pytest
import torch

from shardtrain.checkpoint import BlockSlice, FlatSlice, SavePiece, open_checkpoint, safetensors_io, save
from shardtrain.checkpoint.runs import SegmentCopier
from shardtrain.errors import CheckpointError

_gen = torch.Generator().manual_seed(3)
# a matrix stored as 3 ZeRO fragments (uneven cuts), a bf16 vector as 2, a bool mask whole
MAT = torch.randn(12, 10, generator=_gen)
VEC = torch.randn(50, generator=_gen).to(torch.bfloat16)
MASK = torch.rand(7, 3, generator=_gen) > 0.5
CUTS = {"m": (MAT, [(0, 37), (37, 50), (87, 33)]), "v": (VEC, [(0, 26), (26, 24)]), "b": (MASK, [(0, 21)])}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("direct")
    pieces = [
        SavePiece(name, tuple(t.shape), FlatSlice(a, n), t.reshape(-1)[a : a + n].clone())
        for name, (t, cuts) in CUTS.items()
        for a, n in cuts
    ]
    save(d, "s", None, pieces)
    return d


@pytest.fixture(params=[8, 0], ids=["segments-as-lists", "segments-as-tensors"])
def paths(monkeypatch, request):
    """Counts chunks read directly and through the buffer; small chunks and a small direct threshold (in elements
    of a few bytes) so that the tiny tensors take every path: direct, buffered, chunks cut at a segment start,
    direct reads of a segment in several chunks; the copier's segments as lists and as tensors."""
    seen = {"direct": 0, "buffered": 0}
    original = SegmentCopier.direct

    def counting(self, offset, n):
        m, into = original(self, offset, n)
        seen["buffered" if into is None else "direct"] += 1
        return m, into

    monkeypatch.setattr(SegmentCopier, "direct", counting)
    monkeypatch.setattr(SegmentCopier, "DIRECT_MIN_BYTES", 24)
    monkeypatch.setattr(SegmentCopier, "_LISTS", request.param)
    monkeypatch.setattr(safetensors_io, "_CHUNK", 28)
    monkeypatch.setattr(safetensors_io, "_DIRECT_CHUNK", 36)
    return seen


@pytest.mark.parametrize("verify", [True, False])
def test_reads_bitwise_through_both_paths(ckpt, paths, verify):
    reader = open_checkpoint(ckpt, verify=verify)
    for name, (t, _) in CUTS.items():
        flat = t.reshape(-1)
        assert torch.equal(reader.read(name), t), name
        for a, b in [(0, flat.numel()), (5, 31), (36, 38), (20, 95), (flat.numel() - 1, flat.numel())]:
            if b <= flat.numel():
                assert torch.equal(reader.read(name, (a, b)), flat[a:b]), (name, a, b)
    # column blocks of the matrix: rows of 5 elements (20 bytes), shorter than the direct threshold: buffered
    for i in range(2):
        assert torch.equal(reader.read_slice("m", BlockSlice(1, i, 2)), MAT.chunk(2, 1)[i])
    assert torch.equal(reader.read_slice("m", BlockSlice(0, 1, 3)), MAT.chunk(3, 0)[1])  # rows 4-7: one run
    assert paths["direct"] and paths["buffered"]


def test_a_stored_fragment_is_read_without_the_buffer(ckpt, monkeypatch):
    """A rank reading what it saved (the usual resume): every chunk lands in the result, no chunk goes to a copier."""
    copies = []
    monkeypatch.setattr(SegmentCopier, "__call__", lambda self, offset, chunk: copies.append(offset))
    monkeypatch.setattr(safetensors_io, "_CHUNK", 40)
    reader = open_checkpoint(ckpt)
    for name, (t, cuts) in CUTS.items():
        for a, n in cuts:
            assert torch.equal(reader.read(name, (a, a + n)), t.reshape(-1)[a : a + n])
    assert copies == []


def test_dtype_conversion_reads_through_the_buffer(ckpt, paths):
    reader = open_checkpoint(ckpt)
    assert torch.equal(reader.read("v", dtype=torch.float32), VEC.float())
    assert torch.equal(reader.read("m", (3, 90), dtype=torch.float64), MAT.reshape(-1)[3:90].double())
    assert paths["direct"] == 0


def _flip(ckpt, name, piece_index, element):
    reader = open_checkpoint(ckpt)
    piece = reader.entry(name).pieces[piece_index]
    path = reader.path / piece.file
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8 : 8 + header_len])[piece.key]["data_offsets"][0]
    raw[8 + header_len + begin + element * 4 + 1] ^= 0x10
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize(
    "element, read_range, verify_only",
    [(3, (38, 86), False), (45, (38, 86), False), (45, (37, 50), True)],
    ids=["read-directly", "read-directly-late-chunk", "read-only-for-the-checksum"],
)
def test_corruption_fails_the_read(ckpt, tmp_path, paths, element, read_range, verify_only):
    """Piece 1 of ``m`` holds elements 37-86. A flipped byte inside the asked range arrives in the result before
    the checksum is known; outside it, only the checksum sees it. Either way the read fails naming file and tensor.
    Without verification (and short of the whole piece, which is always checked) only the asked range is read."""
    import shutil

    copy = tmp_path / "c"
    shutil.copytree(ckpt, copy)
    path = _flip(copy, "m", 1, element)
    with pytest.raises(CheckpointError, match="checksum mismatch") as info:
        open_checkpoint(copy).read("m", read_range)
    assert str(path) in str(info.value) and "'m'" in str(info.value)
    got = open_checkpoint(copy, verify=False).read("m", read_range)
    want = MAT.reshape(-1)[read_range[0] : read_range[1]]
    assert torch.equal(got, want) == verify_only


def test_read_into_a_given_tensor(ckpt, paths):
    """``out=``: the values land in the caller's tensor (the engine reads weights into place), bitwise what a read
    into a new tensor gives, across fragment boundaries; a tensor of the wrong shape, dtype or layout is refused
    before anything is read."""
    reader = open_checkpoint(ckpt)
    out = torch.full((60,), -1.0)
    got = reader.read("m", (30, 90), out=out)
    assert got is out and torch.equal(out, MAT.reshape(-1)[30:90])
    whole = torch.empty(12, 10)
    assert reader.read("m", out=whole) is whole and torch.equal(whole, MAT)
    block = torch.empty(12, 5)
    assert torch.equal(reader.read_slice("m", BlockSlice(1, 1, 2), out=block), MAT[:, 5:])
    for bad in (torch.empty(59), torch.empty(60, dtype=torch.float64), torch.empty(120)[::2]):
        with pytest.raises(ValueError, match="expected a contiguous host tensor of shape"):
            reader.read("m", (30, 90), out=bad)
