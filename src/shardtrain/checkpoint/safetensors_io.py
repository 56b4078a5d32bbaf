"""The two safetensors operations the ``safetensors`` package does not offer: streamed writing and direct reads.

``safetensors.torch.save_file`` (used for the per-rank files) needs every tensor of a file in memory at once, and
``safe_open`` returns memory-mapped tensors whose page faults make cold reads several times slower than plain
sequential reads into the destination. The file format is small and fixed: 8 bytes little-endian header length,
a JSON header ``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` padded with spaces
to 8-byte alignment, then the data. Files written here are read back with ``safetensors`` itself in the tests.
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


def read_tensor(
    path: Path, key: str, dtype: torch.dtype, shape: tuple[int, ...], elems: tuple[int, int] | None = None
) -> torch.Tensor:
    """Tensor ``key`` (checked against ``dtype`` and ``shape``), or elements ``[a, b)`` of it flattened."""
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
    a, b = (0, numel) if elems is None else elems
    out = torch.empty(b - a, dtype=dtype)
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        f.seek(data_start + begin + a * dtype.itemsize)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{path}: ends inside tensor {key!r}")
            got += n
    return out if elems is not None else out.reshape(shape)


def write_streaming(
    path: Path,
    tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    load: Callable[[int], torch.Tensor],
    metadata: dict[str, str],
    advance: Callable[[int], None] = lambda n: None,
) -> None:
    """Write ``path`` (via ``path.partial``, fsynced) with header from ``tensors``; data of the i-th is ``load(i)``.

    Only one tensor is in memory at a time.
    """
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
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i, (name, dtype, shape) in enumerate(specs):
            t = load(i)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{path}: tensor {name!r} came as {t.dtype} {tuple(t.shape)}")
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B"))
            advance(t.numel() * t.element_size())
            del t
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
