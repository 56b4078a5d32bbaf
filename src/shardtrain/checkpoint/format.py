"""The checkpoint manifest as plain data: frozen dataclasses that validate themselves on construction.

A checkpoint directory holds ``manifest.json`` and the files it lists. The manifest names every logical tensor
(global shape, dtype) and every stored *piece* of it: which file, which safetensors key, which part of the global
tensor (a :class:`FlatSlice` for ZeRO fragments, a :class:`BlockSlice` for tensor-parallel blocks) and a CRC-32 of
the piece's bytes. Loading into another layout is "read the elements I now own"; nothing is re-derived from padding
rules. The schema is documented in ``docs/checkpoint-format.md``.

[Note: runs] Every slice kind reduces to *runs*: ``(global_start, piece_start, length)`` triples in flattened
(row-major) element indices of the global tensor and of the piece. Coverage checks and range reads use only runs,
so a new slice kind needs only a ``runs`` method.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from shardtrain.errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"

# Names in the manifest are torch's dtype names without the "torch." prefix.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in a checkpoint; supported: {sorted(DTYPES)}")
    return DTYPE_NAMES[dtype]


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def crc32_of(t: torch.Tensor) -> str:
    """CRC-32 of a tensor's raw bytes (row-major), as ``crc32:xxxxxxxx``."""
    data = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
    running = 0
    for start in range(0, len(data), 64 << 20):  # zlib takes at most 4 GiB per call on some builds
        running = zlib.crc32(data[start : start + (64 << 20)], running)
    return f"crc32:{running:08x}"


def crc32_of_bytes(data: bytes) -> str:
    return f"crc32:{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckpointError(msg)


@dataclass(frozen=True)
class FlatSlice:
    """Elements ``[start, start + length)`` of the flattened global tensor, stored as a 1-D piece (ZeRO)."""

    start: int
    length: int

    def __post_init__(self) -> None:
        _check(
            isinstance(self.start, int) and isinstance(self.length, int) and self.start >= 0 and self.length >= 0,
            f"FlatSlice needs integers start >= 0 and length >= 0, got start={self.start!r} length={self.length!r}",
        )

    def validate(self, shape: tuple[int, ...]) -> None:
        _check(
            self.start + self.length <= numel(shape),
            f"FlatSlice [{self.start}, {self.start + self.length}) exceeds the {numel(shape)} elements of {shape}",
        )

    def piece_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (self.length,)

    def runs(self, shape: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
        if self.length:
            yield (self.start, 0, self.length)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "flat", "start": self.start, "length": self.length}


@dataclass(frozen=True)
class BlockSlice:
    """Block ``index`` of ``count`` equal blocks along dimension ``dim`` (tensor parallelism).

    With ``stride`` > 1 the dimension is first cut into ``stride`` equal groups (e.g. Q, K and V of a fused weight)
    and the piece holds block ``index`` of every group, concatenated along ``dim`` in group order. The piece's shape
    is the global shape with ``dim`` divided by ``count``.
    """

    dim: int
    index: int
    count: int
    stride: int = 1

    def __post_init__(self) -> None:
        ok = all(isinstance(v, int) for v in (self.dim, self.index, self.count, self.stride))
        _check(
            ok and self.dim >= 0 and self.count >= 1 and 0 <= self.index < self.count and self.stride >= 1,
            f"BlockSlice needs dim >= 0, count >= 1, 0 <= index < count, stride >= 1; got {self}",
        )

    def validate(self, shape: tuple[int, ...]) -> None:
        _check(self.dim < len(shape), f"BlockSlice dim {self.dim} does not exist in shape {shape}")
        size = shape[self.dim]
        _check(
            size % (self.count * self.stride) == 0,
            f"BlockSlice: dimension {self.dim} of size {size} does not split into {self.stride} group(s) "
            f"of {self.count} equal blocks",
        )

    def piece_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[: self.dim] + (shape[self.dim] // self.count,) + shape[self.dim + 1 :]

    def runs(self, shape: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
        outer, size, inner = numel(shape[: self.dim]), shape[self.dim], numel(shape[self.dim + 1 :])
        block = size // (self.count * self.stride)  # rows of one block of one group
        if block * inner == 0:
            return
        piece_rows = size // self.count
        for o in range(outer):
            for g in range(self.stride):
                global_row = g * (size // self.stride) + self.index * block
                yield (
                    (o * size + global_row) * inner,
                    (o * piece_rows + g * block) * inner,
                    block * inner,
                )

    def to_json(self) -> dict[str, Any]:
        return {"kind": "block", "dim": self.dim, "index": self.index, "count": self.count, "stride": self.stride}


Slice = FlatSlice | BlockSlice


def slice_from_json(d: dict[str, Any]) -> Slice:
    kind = d.get("kind")
    if kind == "flat":
        return FlatSlice(d["start"], d["length"])
    if kind == "block":
        return BlockSlice(d["dim"], d["index"], d["count"], d.get("stride", 1))
    raise CheckpointError(f"unknown slice kind {kind!r} (known: 'flat', 'block')")


@dataclass(frozen=True)
class Piece:
    """One stored part of a logical tensor: safetensors ``key`` in ``file`` holding ``slice``."""

    file: str
    key: str
    slice: Slice
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "key": self.key, "slice": self.slice.to_json(), "checksum": self.checksum}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Piece:
        return Piece(d["file"], d["key"], slice_from_json(d["slice"]), d["checksum"])


@dataclass(frozen=True)
class TensorEntry:
    """A logical tensor: global shape and dtype, the pieces that together cover it, and alias names (tied)."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check(bool(self.name), "a tensor entry needs a non-empty name")
        _check(
            all(isinstance(s, int) and s >= 0 for s in self.global_shape),
            f"tensor {self.name!r}: shape must be non-negative integers, got {self.global_shape}",
        )
        _check(self.dtype in DTYPES, f"tensor {self.name!r}: unknown dtype {self.dtype!r}; known: {sorted(DTYPES)}")
        for p in self.pieces:
            try:
                p.slice.validate(self.global_shape)
            except CheckpointError as err:
                raise CheckpointError(f"tensor {self.name!r}, piece {p.key!r} in {p.file}: {err}") from None
        check_coverage(self.name, self.global_shape, [p.slice for p in self.pieces])

    @property
    def numel(self) -> int:
        return numel(self.global_shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"shape": list(self.global_shape), "dtype": self.dtype}
        if self.aliases:
            d["aliases"] = list(self.aliases)
        d["pieces"] = [p.to_json() for p in self.pieces]
        return d

    @staticmethod
    def from_json(name: str, d: dict[str, Any]) -> TensorEntry:
        return TensorEntry(
            name,
            tuple(d["shape"]),
            d["dtype"],
            tuple(Piece.from_json(p) for p in d["pieces"]),
            tuple(d.get("aliases", ())),
        )


def check_coverage(name: str, shape: tuple[int, ...], slices: list[Slice]) -> None:
    """The slices must cover every element of the tensor exactly once."""
    runs = sorted((g, n) for s in slices for g, _, n in s.runs(shape))
    pos = 0
    for start, length in runs:
        if start < pos:
            raise CheckpointError(f"tensor {name!r}: stored pieces overlap at element {start}")
        if start > pos:
            raise CheckpointError(f"tensor {name!r}: elements [{pos}, {start}) are in no stored piece")
        pos = start + length
    if pos != numel(shape):
        raise CheckpointError(f"tensor {name!r}: elements [{pos}, {numel(shape)}) are in no stored piece")


@dataclass(frozen=True)
class FileEntry:
    """A file of the checkpoint: who wrote it, its size (truncation check) and, for object files, a checksum."""

    name: str
    rank: int
    size: int
    checksum: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rank": self.rank, "size": self.size}
        if self.checksum is not None:
            d["checksum"] = self.checksum
        return d


@dataclass(frozen=True)
class ObjectRecord:
    """A small non-tensor object: inline JSON when it round-trips through JSON, otherwise a key in a pickle file."""

    key: str
    encoding: str  # "json" or "pickle"
    value: Any = None
    file: str | None = None

    def __post_init__(self) -> None:
        _check(self.encoding in ("json", "pickle"), f"object {self.key!r}: unknown encoding {self.encoding!r}")
        _check(
            (self.encoding == "pickle") == (self.file is not None),
            f"object {self.key!r}: a pickled object names its file, an inline one does not",
        )

    def to_json(self) -> dict[str, Any]:
        if self.encoding == "json":
            return {"encoding": "json", "value": self.value}
        return {"encoding": "pickle", "file": self.file}

    @staticmethod
    def from_json(key: str, d: dict[str, Any]) -> ObjectRecord:
        return ObjectRecord(key, d["encoding"], d.get("value"), d.get("file"))


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to know about one checkpoint."""

    version: int
    tag: str
    world_size: int
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    objects: dict[str, ObjectRecord] = field(default_factory=dict)
    rank_objects: dict[int, dict[str, ObjectRecord]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(
            self.version == FORMAT_VERSION,
            f"checkpoint format version {self.version!r} is not supported (this shardtrain reads version "
            f"{FORMAT_VERSION}); use the shardtrain release that wrote it",
        )
        _check(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        names: dict[str, str] = {}
        for entry in self.tensors.values():
            for n in (entry.name, *entry.aliases):
                _check(n not in names, f"tensor name {n!r} is used twice (by {names.get(n)!r} and {entry.name!r})")
                names[n] = entry.name
            for p in entry.pieces:
                _check(p.file in self.files, f"tensor {entry.name!r}: piece file {p.file!r} is not in the file list")
        object.__setattr__(self, "_names", names)

    def resolve(self, name: str) -> TensorEntry:
        """The entry for a tensor name or one of its aliases."""
        primary = self._names.get(name)  # type: ignore[attr-defined]
        if primary is None:
            raise CheckpointError(f"tensor {name!r} is not in checkpoint {self.tag!r} ({len(self.tensors)} tensors)")
        return self.tensors[primary]

    def to_json(self) -> str:
        d = {
            "format": "shardtrain-checkpoint",
            "version": self.version,
            "tag": self.tag,
            "world_size": self.world_size,
            "files": {n: f.to_json() for n, f in self.files.items()},
            "objects": {k: o.to_json() for k, o in self.objects.items()},
            "rank_objects": {
                str(r): {k: o.to_json() for k, o in objs.items()} for r, objs in self.rank_objects.items()
            },
            "tensors": {n: t.to_json() for n, t in self.tensors.items()},
        }
        return json.dumps(d, indent=1)

    @staticmethod
    def from_json(text: str, source: str = MANIFEST_NAME) -> Manifest:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{source}: not valid JSON ({err}); the checkpoint is damaged") from None
        if not isinstance(d, dict) or d.get("format") != "shardtrain-checkpoint":
            raise CheckpointError(f"{source}: not a shardtrain checkpoint manifest")
        version = d.get("version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{source}: checkpoint format version {version!r} is not supported (this shardtrain reads version "
                f"{FORMAT_VERSION}); use the shardtrain release that wrote it"
            )
        try:
            return Manifest(
                version=version,
                tag=d["tag"],
                world_size=d["world_size"],
                tensors={n: TensorEntry.from_json(n, t) for n, t in d["tensors"].items()},
                files={n: FileEntry(n, f["rank"], f["size"], f.get("checksum")) for n, f in d["files"].items()},
                objects={k: ObjectRecord.from_json(k, o) for k, o in d["objects"].items()},
                rank_objects={
                    int(r): {k: ObjectRecord.from_json(k, o) for k, o in objs.items()}
                    for r, objs in d["rank_objects"].items()
                },
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{source}: malformed manifest ({type(err).__name__}: {err})") from None
