"""The two safetensors operations the ``safetensors`` package does not offer: streamed writing and direct reads.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once (consolidation produces them one at a
time) and fsyncs nothing (the checkpoint writer wants to overlap the fsync with its checksums); ``safe_open`` returns
memory-mapped tensors whose page faults make cold reads several times slower than plain sequential reads, and whose
pages count towards the resident set. The file
format is small and fixed: 8 bytes little-endian header length, a JSON header ``{key: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`` padded with spaces to 8-byte alignment, then the data.
Files written here are read back with ``safetensors`` itself in the tests.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from shardtrain.checkpoint.format import crc32
from shardtrain.errors import CheckpointError

ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_MAX_HEADER = 100 << 20
_CHUNK = 4 << 20  # read, write and checksum in pieces that fit the CPU cache
_DIRECT_CHUNK = 16 << 20  # reads straight into a result: no buffer to bound, fewer and larger requests
_HAS_PREADV = hasattr(os, "preadv")


def _pread_into(fd: int, into: memoryview, pos: int) -> int:
    """Fill ``into`` from file offset ``pos``; returns the bytes read (fewer only at the end of the file)."""
    got = 0
    while got < len(into):
        if _HAS_PREADV:
            r = os.preadv(fd, [into[got:]], pos + got)
        else:  # macOS before 11
            os.lseek(fd, pos + got, os.SEEK_SET)
            r = os.readv(fd, [into[got:]])
        if not r:
            break
        got += r
    return got


@lru_cache(maxsize=64)
def _read_header_cached(path: str, size: int, mtime_ns: int) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: too short for a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: safetensors header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: damaged safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: damaged safetensors header (not a JSON object)")
    return 8 + n, header


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, header dict) of a safetensors file; cached while the file is unchanged."""
    st = path.stat()
    return _read_header_cached(str(path), st.st_size, st.st_mtime_ns)


def stream_tensor(
    path: Path,
    key: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    elems: tuple[int, int],
    sink: Callable[[int, torch.Tensor], None],
    direct: Callable[[int, int], tuple[int, memoryview | None]] | None = None,
) -> int:
    """Read elements ``[a, b)`` of tensor ``key`` (checked against ``dtype`` and ``shape``) sequentially, in chunks
    of a few MiB; returns the CRC-32 of the bytes read, computed on each chunk right after it is read (while it is
    in the CPU cache: every byte is read from the file and checksummed once).

    Each chunk goes where ``direct(offset, n)`` says: it returns how many of the next ``n`` elements to read and
    the bytes to read them into (the caller's result: no buffer, no copy), or ``None``: then they are read into one
    reused buffer and ``sink(offset, chunk)`` gets them (a 1-D view valid only during the call; ``offset`` counts
    elements from the start of the tensor). Without ``direct`` every chunk goes to ``sink``. Memory: one chunk.

    Every read goes through the page cache, on the calling thread, in file order (the kernel's readahead keeps the
    disk busy while the chunk before is checksummed). Reading around the cache (O_DIRECT, reader threads) was
    measured slower here once the checksum became cheap: docs/benchmarks-loadspeed.md, "Stop 30"."""
    data_start, header = read_header(path)
    info = header.get(key)
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: has no tensor {key!r}")
    numel = 1
    for s in shape:
        numel *= s
    begin, end = info.get("data_offsets", (0, -1))
    if info.get("dtype") != ST_DTYPES[dtype] or list(info.get("shape", ())) != list(shape):
        raise CheckpointError(
            f"{path}: {key!r} is {info.get('dtype')} {info.get('shape')}, expected {ST_DTYPES[dtype]} {list(shape)}"
        )
    if end - begin != numel * dtype.itemsize or data_start + end > path.stat().st_size:
        raise CheckpointError(f"{path}: data offsets of {key!r} do not fit its shape or the file")
    a, b = elems
    size = dtype.itemsize
    per_chunk, per_direct = max(1, _CHUNK // size), max(1, _DIRECT_CHUNK // size)
    buf: torch.Tensor | None = None  # allocated on first use: direct reads need none
    running = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = data_start + begin + a * size
        offset = a
        while offset < b:
            n, into = direct(offset, min(per_direct, b - offset)) if direct else (b - offset, None)
            buffered = into is None
            if buffered:
                n = min(n, per_chunk)
                if buf is None:
                    buf = torch.empty(min(per_chunk, b - a), dtype=dtype)
                    scratch = memoryview(buf.view(torch.uint8).numpy())
                into = scratch[: n * size]
            if _pread_into(fd, into, pos) != len(into):
                raise CheckpointError(f"{path}: ends inside tensor {key!r}")
            running = crc32(into, running)
            if buffered:
                sink(offset, buf[:n])
            pos += n * size
            offset += n
    finally:
        os.close(fd)
    return running


def write_streaming(
    path: Path,
    tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    load: Callable[[int], torch.Tensor],
    metadata: dict[str, str],
    advance: Callable[[int], None] = lambda n: None,
    *,
    via_partial: bool = True,
    fsync: bool = True,
) -> None:
    """Write ``path`` with the header from ``tensors``; the data of the i-th is ``load(i)``. Only one tensor is in
    memory at a time. With ``via_partial`` the file is written as ``path.partial`` and renamed, so that ``path``
    never exists half-written; with ``fsync`` it is fsynced before."""
    specs = list(tensors)
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned
    target = path.with_name(path.name + ".partial") if via_partial else path
    with open(target, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for i, (name, dtype, shape) in enumerate(specs):
            t = load(i)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{path}: tensor {name!r} came as {t.dtype} {tuple(t.shape)}")
            view = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
            for start in range(0, len(view), _CHUNK):
                chunk = view[start : start + _CHUNK]
                done = 0
                while done < len(chunk):
                    done += f.write(chunk[done:])
            advance(len(view))
            chunk = view = t = None  # free this tensor before the next one is loaded
        if fsync:
            os.fsync(f.fileno())
    if via_partial:
        os.replace(target, path)
