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
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from shardtrain.checkpoint.format import MAX_DIMS, crc32
from shardtrain.checkpoint.member_files import open_regular
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
ST_ITEMSIZE = {name: dtype.itemsize for dtype, name in ST_DTYPES.items()}
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


GLOBAL_SHAPES_KEY = "shardtrain.global_shapes"
"""In a tensor file's ``__metadata__``: JSON of each piece's key -> the shape of the whole tensor it is a piece of.
A piece stored flat (1-D) says nothing of that shape by itself; with it, a manifest whose shape was permuted (the
same element count) is contradicted by the file. Files written before it have none and are read as before."""


class TensorInfo(NamedTuple):
    """One validated entry of a safetensors header; offsets count from the start of the data section.
    ``global_shape``: the whole tensor's shape the writer recorded for this piece (:data:`GLOBAL_SHAPES_KEY`)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    global_shape: tuple[int, ...] | None = None


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def validate_header(path: Path | str, header: Any, data_size: int) -> dict[str, TensorInfo]:
    """The entries of a parsed safetensors header, checked as the ``safetensors`` package checks them
    (``Metadata::validate``): each names a dtype (a string), a shape (a list of non-negative integers) and
    ``data_offsets`` (two integers ``0 <= begin <= end``) whose length is the shape times the dtype's size (for the
    dtypes this project stores), inside the data section, no two overlapping. The error names the file, the key and
    the field. (The package itself is not used to parse it because it opens the file by name again, see
    ``docs/checkpoint-format.md``.)"""
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: damaged safetensors header (not a JSON object)")
    out: dict[str, TensorInfo] = {}
    global_shapes = _global_shapes(path, header.get("__metadata__", {}))
    for key, info in header.items():
        if key == "__metadata__":
            continue
        where = f"{path}: damaged safetensors header: tensor {key!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str):
            raise CheckpointError(f"{where}: field 'dtype' is {_short(dtype)}, not a string")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
            raise CheckpointError(
                f"{where}: field 'shape' is {_short(shape)}, not a list of at most {MAX_DIMS} non-negative integers"
            )
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            raise CheckpointError(f"{where}: field 'data_offsets' is {_short(offsets)}, not two non-negative integers")
        begin, end = offsets
        if begin > end or end > data_size:
            raise CheckpointError(
                f"{where}: field 'data_offsets' [{begin}, {end}) is not a range inside the {data_size} bytes of data"
            )
        if dtype in ST_ITEMSIZE:
            nbytes = ST_ITEMSIZE[dtype]
            for d in shape:
                nbytes *= d
            if nbytes != end - begin:
                raise CheckpointError(
                    f"{where}: field 'data_offsets' [{begin}, {end}) holds {end - begin} bytes, its shape {shape} "
                    f"of {dtype} needs {nbytes}"
                )
        out[key] = TensorInfo(dtype, tuple(shape), begin, end, global_shapes.get(key))
    previous_end, previous = 0, None
    for key, info in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin < previous_end:
            raise CheckpointError(
                f"{path}: damaged safetensors header: tensors {previous!r} and {key!r} overlap in 'data_offsets'"
            )
        if info.end > info.begin:  # empty tensors occupy no bytes
            previous_end, previous = info.end, key
    return out


def _global_shapes(path: Path | str, metadata: Any) -> dict[str, tuple[int, ...]]:
    """The :data:`GLOBAL_SHAPES_KEY` record of a header's ``__metadata__`` (empty when there is none)."""
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: damaged safetensors header: '__metadata__' is not an object")
    text = metadata.get(GLOBAL_SHAPES_KEY)
    if text is None:
        return {}
    where = f"{path}: damaged safetensors header: __metadata__ {GLOBAL_SHAPES_KEY!r}"
    try:
        shapes = json.loads(text) if isinstance(text, str) else None
    except (RecursionError, ValueError):
        shapes = None
    if not isinstance(shapes, dict) or not all(
        isinstance(s, list) and len(s) <= MAX_DIMS and all(_is_count(d) for d in s) for s in shapes.values()
    ):
        raise CheckpointError(f"{where} is not an object of shapes (lists of non-negative integers)")
    return {key: tuple(s) for key, s in shapes.items()}


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# validated headers by (path, device, inode, size, mtime): a file is parsed once while it is unchanged
_HEADERS: OrderedDict[tuple, tuple[int, dict[str, TensorInfo]]] = OrderedDict()
_HEADERS_KEPT = 64


def _header_of(path: Path, fd: int, st: os.stat_result) -> tuple[int, dict[str, TensorInfo]]:
    """(offset of the data section, validated header) of the open file ``fd``."""
    cache_key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if (hit := _HEADERS.get(cache_key)) is not None:
        return hit
    size = st.st_size
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise CheckpointError(f"{path}: too short for a safetensors file ({size} bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER or 8 + n > size:
        raise CheckpointError(f"{path}: safetensors header length {n} does not fit the file ({size} bytes)")
    text = bytearray(n)
    if _pread_into(fd, memoryview(text), 8) != n:
        raise CheckpointError(f"{path}: ends inside its safetensors header")
    try:
        header = json.loads(text)
    except RecursionError:
        raise CheckpointError(f"{path}: damaged safetensors header (JSON nested too deeply)") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise CheckpointError(f"{path}: damaged safetensors header ({err})") from None
    result = 8 + n, validate_header(path, header, size - 8 - n)
    _HEADERS[cache_key] = result
    while len(_HEADERS) > _HEADERS_KEPT:
        _HEADERS.popitem(last=False)
    return result


def read_header(path: Path, what: str = "its header") -> tuple[int, dict[str, TensorInfo]]:
    """(offset of the data section, validated header) of a safetensors file (a regular file, opened without
    blocking: ``member_files.open_regular``); cached while the file is unchanged."""
    fd, st = open_regular(path, what)
    try:
        return _header_of(path, fd, st)
    finally:
        os.close(fd)


def header_entry(
    path: Path,
    header: dict[str, TensorInfo],
    key: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    global_shape: tuple[int, ...] | None = None,
) -> TensorInfo:
    """The entry ``key`` of a validated header, which must have ``dtype`` and ``shape`` (what the manifest says),
    and be a piece of a tensor of ``global_shape`` where the writer recorded one; its offsets then hold exactly those
    bytes, inside the file."""
    info = header.get(key)
    if info is None:
        raise CheckpointError(f"{path}: has no tensor {key!r}")
    if info.dtype != ST_DTYPES[dtype] or info.shape != tuple(shape):
        raise CheckpointError(
            f"{path}: {key!r} is {info.dtype!r} {list(info.shape)} in the file's header, the manifest says "
            f"{ST_DTYPES[dtype]!r} {list(shape)}"
        )
    if global_shape is not None and info.global_shape is not None and info.global_shape != tuple(global_shape):
        raise CheckpointError(
            f"{path}: {key!r} is a piece of a tensor of shape {list(info.global_shape)} as written, the manifest "
            f"says {list(global_shape)}"
        )
    return info


def stream_tensor(
    path: Path,
    key: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    elems: tuple[int, int],
    sink: Callable[[int, torch.Tensor], None],
    direct: Callable[[int, int], tuple[int, memoryview | None]] | None = None,
    global_shape: tuple[int, ...] | None = None,
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
    fd, st = open_regular(path, f"tensor {key!r}")
    try:
        data_start, header = _header_of(path, fd, st)
        begin = header_entry(path, header, key, dtype, shape, global_shape).begin
        a, b = elems
        size = dtype.itemsize
        per_chunk, per_direct = max(1, _CHUNK // size), max(1, _DIRECT_CHUNK // size)
        buf: torch.Tensor | None = None  # allocated on first use: direct reads need none
        running = 0
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
