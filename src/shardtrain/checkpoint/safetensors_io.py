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

import ctypes
import errno
import json
import mmap
import os
import struct
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
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
# Reads around the page cache in flight at once, each on a reader thread (``os.preadv`` releases the GIL): without
# the kernel's readahead, one synchronous reader would leave the disk idle while it takes the page faults of the
# result and checksums; here one waits for the disk, another faults in its part of the result, and the calling
# thread checksums the chunk before.
_READERS = 2
_HAS_PREADV = hasattr(os, "preadv")
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _reader_pool() -> ThreadPoolExecutor:
    """The reader threads of this process (made again after a fork: a forked child has none of the parent's)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(_READERS, thread_name_prefix="shardtrain-read"))
    return _pool[1]


def _pread_into(fd: int, into: memoryview, pos: int) -> int:
    """Fill ``into`` from file offset ``pos``; returns the bytes read (fewer only at the end of the file)."""
    got = 0
    while got < len(into):
        if _HAS_PREADV:
            r = os.preadv(fd, [into[got:]], pos + got)
        else:  # macOS before 11: only the calling thread reads this descriptor there (no O_DIRECT, no reader threads)
            os.lseek(fd, pos + got, os.SEEK_SET)
            r = os.readv(fd, [into[got:]])
        if not r:
            break
        got += r
    return got


# Reads that bypass the page cache (O_DIRECT), for new results only. A buffered read of a cold file takes new memory
# for the page cache (on a virtual machine whose host reclaims freed guest memory, each new page costs a fault on
# the host too), and a read into a new result takes the result's as well; reading from the disk straight into the
# result takes only the result's. Only where no byte of the range is cached (a cached file is served from memory by
# a buffered read), the read is long, and the result is in phase with the file: the file offset, length and address
# of an O_DIRECT request must be whole blocks (512 B or 4 KiB), and ``empty_at_phase`` in ``format.py`` places a new
# result at its file position's offset within a block, so that it can be read into directly. A tensor given to read
# into takes no new memory of the process either way, and is read through the page cache (``_Uncached.usable``).
_BLOCK = 4096
_UNCACHED_MIN = 1 << 20


@lru_cache(maxsize=1)
def _libc() -> Any:
    """The C library's ``mmap``, ``munmap`` and ``mincore`` (``None`` where they cannot be loaded)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


def _resident_pages(fd: int, start: int, length: int) -> bytes | None:
    """One byte per page of ``[start, start + length)`` (``start`` page-aligned) of the file, odd where the page
    is in the page cache (``mincore`` of a read-only mapping, which reads nothing); ``None`` where not possible."""
    libc = _libc()
    if libc is None:
        return None
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = ctypes.create_string_buffer(-(-length // mmap.PAGESIZE))
        return vec.raw if libc.mincore(addr, length, vec) == 0 else None
    finally:
        libc.munmap(addr, length)


class _Uncached:
    """Where one ``stream_tensor`` call may read around the page cache: an O_DIRECT descriptor of the file, and
    which pages of the range it reads were cached when the call began."""

    def __init__(self, path: Path, fd: int, start: int, end: int) -> None:
        self.fd: int | None = None
        self.base = start - start % mmap.PAGESIZE
        # shorter reads never go around the cache: no mapping, no descriptor for them
        long = hasattr(os, "O_DIRECT") and _HAS_PREADV and end - start >= _UNCACHED_MIN
        resident = _resident_pages(fd, self.base, end - self.base) if long else None
        if resident is None:
            return
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:  # a file system without O_DIRECT: every read goes through the page cache
            return
        self.resident = resident

    def usable(self, into: memoryview, pos: int) -> bool:
        """Whether ``into`` (``len(into)`` bytes from file position ``pos``) is long, in phase with the file (at
        ``pos``'s offset within a block, as ``empty_at_phase`` places a new result) and none of it was cached.
        Memory out of phase (a tensor given to read into: the engine's weights and masters) is read through the
        page cache: there a buffered read, with the kernel's readahead, measured 1.5-2.2x faster than O_DIRECT
        into a reused aligned buffer and a copy (docs/benchmarks-loadspeed.md, stop 30), and it takes no new
        memory of the process either."""
        lo, hi = pos - pos % _BLOCK, pos + len(into)
        if self.fd is None or len(into) < _UNCACHED_MIN:
            return False
        if (ctypes.addressof(ctypes.c_char.from_buffer(into)) - pos) % _BLOCK:
            return False
        page = mmap.PAGESIZE
        return not self.resident[(lo - self.base) // page : -(-(hi - self.base) // page)].strip(b"\0")

    def read(self, buffered_fd: int, into: memoryview, pos: int) -> int:
        """Like ``_pread_into``, into a result placed in phase with the file (``usable``): the whole blocks go
        straight from the disk into it, the unaligned head and tail (under a block each) through the page cache."""
        try:
            return self._read_in_phase(buffered_fd, into, pos)
        except OSError as err:  # a device with larger blocks than assumed: read it through the page cache
            if err.errno != errno.EINVAL:
                raise
            return _pread_into(buffered_fd, into, pos)

    def _read_in_phase(self, buffered_fd: int, into: memoryview, pos: int) -> int:
        head, tail = -pos % _BLOCK, len(into) - (pos + len(into)) % _BLOCK
        got = _pread_into(buffered_fd, into[:head], pos)
        if got < head:
            return got
        middle = _pread_into(self.fd, into[head:tail], pos + head)
        if middle < tail - head:
            return head + middle
        return tail + _pread_into(buffered_fd, into[tail:], pos + tail)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def data_position(path: Path, key: str) -> int | None:
    """The file offset of the first byte of tensor ``key``'s data (``None`` if the header does not say: the read
    itself reports why)."""
    try:
        data_start, header = read_header(path)
        return data_start + int(header[key]["data_offsets"][0])
    except (OSError, CheckpointError, KeyError, TypeError, ValueError, IndexError):
        return None


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

    Direct chunks of a range none of whose pages is cached are read around the page cache (``_Uncached``: O_DIRECT,
    on up to ``_READERS`` reader threads, checksummed in file order by the calling thread); every reader thread is
    done with the result before this returns or raises."""
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
    # direct reads in flight, in file order: (future, bytes of the result); checksummed in that order
    pending: deque[tuple[Future[int], memoryview]] = deque()

    def ends_inside() -> CheckpointError:
        return CheckpointError(f"{path}: ends inside tensor {key!r}")

    def checksum_oldest() -> None:
        nonlocal running
        future, into = pending.popleft()
        if future.result() != len(into):
            raise ends_inside()
        running = crc32(into, running)

    fd = os.open(path, os.O_RDONLY)
    uncached: _Uncached | None = None
    try:
        pos = data_start + begin + a * size
        if direct is not None:
            uncached = _Uncached(path, fd, pos, data_start + begin + b * size)
        offset = a
        while offset < b:
            n, into = direct(offset, min(per_direct, b - offset)) if direct else (b - offset, None)
            if into is not None and uncached is not None and uncached.usable(into, pos):
                # straight from the disk into the result, on a reader thread
                pending.append((_reader_pool().submit(uncached.read, fd, into, pos), into))
                if len(pending) > _READERS:
                    checksum_oldest()
                pos += n * size
                offset += n
                continue
            while pending:  # the checksum runs in file order
                checksum_oldest()
            buffered = into is None
            if buffered:
                n = min(n, per_chunk)
                if buf is None:
                    buf = torch.empty(min(per_chunk, b - a), dtype=dtype)
                    scratch = memoryview(buf.view(torch.uint8).numpy())
                into = scratch[: n * size]
            # through the page cache, on this thread: concurrent buffered reads of one file were slower here (they
            # interleave the kernel's sequential readahead)
            if _pread_into(fd, into, pos) != len(into):
                raise ends_inside()
            running = crc32(into, running)
            if buffered:
                sink(offset, buf[:n])
            pos += n * size
            offset += n
        while pending:
            checksum_oldest()
    finally:
        # no reader thread may still write into the result (or use the descriptor) once this returns or raises
        for future, _ in pending:
            future.cancel() or future.exception()
        if uncached is not None:
            uncached.close()
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
