"""The checkpoint manifest as plain data: frozen dataclasses that validate themselves on construction.

A checkpoint directory holds ``manifest.json`` and the files it lists. The manifest names every logical tensor
(global shape, dtype) and every stored *piece* of it: which file, which safetensors key, which part of the global
tensor (a :class:`FlatSlice` for ZeRO fragments, a :class:`BlockSlice` for tensor-parallel blocks, a
:class:`BlockFlatSlice` for a ZeRO fragment inside a tensor-parallel block) and a CRC-32 of the piece's bytes.
Loading into another layout is "read the elements I now own"; nothing is re-derived from padding rules. The schema
is documented in ``docs/checkpoint-format.md``.

Every slice kind reduces to runs ([Note: runs] in ``runs.py``): coverage checks and reads use only its
``run_table``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from isal import isal_zlib

from shardtrain.checkpoint.runs import RunTable, block_runs, coverage_problem, flat_index, spans_coverage_problem
from shardtrain.errors import CheckpointError

# Version 2 stores objects as JSON and safetensors (version 1 pickled some); both are read.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
# Bounds on what a manifest may claim, so that a damaged or hostile one is refused before anything is computed from
# it: dimensions per tensor, bytes per tensor (keeps element arithmetic inside int64), runs per tensor (the run
# tables of its pieces, built by the coverage check: 24 bytes each; a column block of an (R, C) matrix is R runs), and
# the manifest file itself.
MAX_DIMS = 64
MAX_TENSOR_BYTES = 1 << 60
MAX_RUNS_PER_TENSOR = 1 << 26
MAX_MANIFEST_BYTES = 1 << 30

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


class SizedTensor:
    """What a logical tensor's ``global_shape`` and ``dtype`` (a :data:`DTYPES` name) give: its element count, torch
    dtype and bytes. Shared by this format's :class:`TensorEntry` and the foreign formats' entries."""

    global_shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return numel(self.global_shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


def crc32(data: Any, running: int = 0) -> int:
    """zlib's CRC-32 (the same polynomial and values) of a buffer, continuing from ``running``.

    ISA-L's (the ``isal`` package): it folds with carry-less multiplication, 29 GB/s on one core of this machine
    against zlib's 4.3, and releases the GIL as zlib does. Checkpoints written with either read with either.
    """
    return isal_zlib.crc32(data, running)


def crc32_of(t: torch.Tensor) -> str:
    """CRC-32 of a tensor's raw bytes (row-major), as ``crc32:xxxxxxxx``."""
    data = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
    running = 0
    for start in range(0, len(data), 64 << 20):  # zlib's interface takes at most 4 GiB per call on some builds
        running = crc32(data[start : start + (64 << 20)], running)
    return f"crc32:{running:08x}"


def crc32_of_bytes(data: bytes) -> str:
    return f"crc32:{crc32(data) & 0xFFFFFFFF:08x}"


def _unsupported_version(version: Any) -> str:
    return (
        f"checkpoint format version {version!r} is not supported (this shardtrain reads versions "
        f"{', '.join(map(str, READABLE_VERSIONS))}); use the shardtrain release that wrote it"
    )


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckpointError(msg)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def member_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a file of a checkpoint, or ``None``: it must be a normalised relative path inside
    the checkpoint directory (``rank00000.safetensors``; [Note: checkpoint member files] in ``member_files.py``)."""
    if not isinstance(name, str) or not name:
        return "is not a non-empty string"
    if "\x00" in name:
        return "holds a NUL character"
    if name.startswith("/"):
        return "is an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "has a '..' component"
    if any(part in ("", ".") for part in parts):
        return "is not a normalised path (an empty or '.' component)"
    return None


@dataclass(frozen=True)
class FlatSlice:
    """Elements ``[start, start + length)`` of the flattened global tensor, stored as a 1-D piece (ZeRO)."""

    start: int
    length: int

    def __post_init__(self) -> None:
        _check(
            _is_int(self.start) and _is_int(self.length) and self.start >= 0 and self.length >= 0,
            f"FlatSlice needs integers start >= 0 and length >= 0, got start={self.start!r} length={self.length!r}",
        )

    def validate(self, shape: tuple[int, ...]) -> None:
        _check(
            self.start + self.length <= numel(shape),
            f"FlatSlice [{self.start}, {self.start + self.length}) exceeds the {numel(shape)} elements of {shape}",
        )

    def piece_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (self.length,)

    def run_table(self, shape: tuple[int, ...]) -> RunTable:
        return RunTable.of(*([[self.start], [0], [self.length]] if self.length else [[], [], []]))

    def runs(self, shape: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
        return _iter_runs(self.run_table(shape))

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
        ok = all(_is_int(v) for v in (self.dim, self.index, self.count, self.stride))
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

    def run_table(self, shape: tuple[int, ...]) -> RunTable:
        """``outer * stride`` runs of ``rows * inner`` elements (``block_runs`` in ``runs.py``)."""
        return block_runs(shape, self.dim, self.index, self.count, self.stride, 0, None)

    def runs(self, shape: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
        return _iter_runs(self.run_table(shape))

    def to_json(self) -> dict[str, Any]:
        return {"kind": "block", "dim": self.dim, "index": self.index, "count": self.count, "stride": self.stride}


@dataclass(frozen=True)
class BlockFlatSlice:
    """Elements ``[start, start + length)`` of the row-major flattening of tensor-parallel block ``block``, stored
    as a 1-D piece: ZeRO inside tensor parallelism (each data-parallel rank holds a fragment of its block).

    ``BlockFlatSlice(BlockSlice(0, 1, 2, stride=3), 12, 36)`` of a (24, 4) fused QKV weight: tensor-parallel rank
    1's block is rows 4-7, 12-15 and 20-23 (its part of Q, K and V), flattened to 48 elements; the piece is elements
    12-47 of those: row 7, rows 12-15 and rows 20-23, three runs.
    """

    block: BlockSlice
    start: int
    length: int

    def __post_init__(self) -> None:
        _check(
            isinstance(self.block, BlockSlice),
            f"BlockFlatSlice needs a BlockSlice as its block, got {self.block!r}",
        )
        _check(
            _is_int(self.start) and _is_int(self.length) and self.start >= 0 and self.length >= 0,
            f"BlockFlatSlice needs integers start >= 0 and length >= 0, got start={self.start!r} "
            f"length={self.length!r}",
        )

    def validate(self, shape: tuple[int, ...]) -> None:
        self.block.validate(shape)
        block_numel = numel(self.block.piece_shape(shape))
        _check(
            self.start + self.length <= block_numel,
            f"BlockFlatSlice [{self.start}, {self.start + self.length}) exceeds the {block_numel} elements of "
            f"{self.block} of a tensor of shape {shape}",
        )

    def piece_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (self.length,)

    def run_table(self, shape: tuple[int, ...]) -> RunTable:
        b = self.block
        return block_runs(shape, b.dim, b.index, b.count, b.stride, self.start, self.start + self.length)

    def runs(self, shape: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
        return _iter_runs(self.run_table(shape))

    def to_json(self) -> dict[str, Any]:
        b = self.block
        return {
            "kind": "block_flat",
            "dim": b.dim,
            "index": b.index,
            "count": b.count,
            "stride": b.stride,
            "start": self.start,
            "length": self.length,
        }


Slice = FlatSlice | BlockSlice | BlockFlatSlice
SLICE_KINDS = ("flat", "block", "block_flat")


def _iter_runs(table: RunTable) -> Iterator[tuple[int, int, int]]:
    return zip(*(t.tolist() for t in table))


def slice_from_json(d: dict[str, Any]) -> Slice:
    kind = d.get("kind")
    if kind == "flat":
        return FlatSlice(d["start"], d["length"])
    if kind == "block":
        return BlockSlice(d["dim"], d["index"], d["count"], d.get("stride", 1))
    if kind == "block_flat":
        return BlockFlatSlice(BlockSlice(d["dim"], d["index"], d["count"], d["stride"]), d["start"], d["length"])
    raise CheckpointError(
        f"unknown slice kind {kind!r} (known: {', '.join(map(repr, SLICE_KINDS))}); the checkpoint was written by a "
        "newer shardtrain"
    )


@dataclass(frozen=True)
class Piece:
    """One stored part of a logical tensor: safetensors ``key`` in ``file`` holding ``slice``."""

    file: str
    key: str
    slice: Slice
    checksum: str

    def __post_init__(self) -> None:
        problem = member_name_problem(self.file)
        _check(
            problem is None,
            f"piece {self.key!r}: file {self.file!r} {problem}; a piece names a file inside the checkpoint directory",
        )
        _check(isinstance(self.key, str), f"piece key {self.key!r} is not a string")
        _check(isinstance(self.checksum, str), f"piece {self.key!r}: checksum {self.checksum!r} is not a string")

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "key": self.key, "slice": self.slice.to_json(), "checksum": self.checksum}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Piece:
        return Piece(d["file"], d["key"], slice_from_json(d["slice"]), d["checksum"])


@dataclass(frozen=True)
class TensorEntry(SizedTensor):
    """A logical tensor: global shape and dtype, the pieces that together cover it, and alias names (tied)."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check(isinstance(self.name, str) and bool(self.name), "a tensor entry needs a non-empty name")
        _check(
            len(self.global_shape) <= MAX_DIMS and all(_is_int(s) and s >= 0 for s in self.global_shape),
            f"tensor {self.name!r}: field 'shape' must be at most {MAX_DIMS} non-negative integers, got "
            f"{_short(self.global_shape)}",
        )
        _check(
            isinstance(self.dtype, str) and self.dtype in DTYPES,
            f"tensor {self.name!r}: unknown dtype {_short(self.dtype)}; known: {sorted(DTYPES)}",
        )
        _check(
            self.nbytes <= MAX_TENSOR_BYTES,
            f"tensor {self.name!r}: field 'shape' {list(self.global_shape)} of {self.dtype} is {self.nbytes} bytes, "
            f"more than the {MAX_TENSOR_BYTES} a checkpoint tensor may hold",
        )
        runs = 0
        for p in self.pieces:
            try:
                p.slice.validate(self.global_shape)
            except CheckpointError as err:
                raise CheckpointError(f"tensor {self.name!r}, piece {p.key!r} in {p.file}: {err}") from None
            runs += run_count(p.slice, self.global_shape)
        # the coverage check builds every piece's run table: bounded before it is built
        _check(
            runs <= MAX_RUNS_PER_TENSOR,
            f"tensor {self.name!r}: its pieces are {runs} runs of elements, more than the {MAX_RUNS_PER_TENSOR} "
            "a tensor may have",
        )
        check_coverage(self.name, self.global_shape, [p.slice for p in self.pieces])

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"shape": list(self.global_shape), "dtype": self.dtype}
        if self.aliases:
            d["aliases"] = list(self.aliases)
        d["pieces"] = [p.to_json() for p in self.pieces]
        return d

    @staticmethod
    def from_json(name: str, d: dict[str, Any]) -> TensorEntry:
        for key in ("shape", "pieces", "aliases"):
            _check(
                isinstance(d.get(key, []), list),
                f"tensor {name!r}: field {key!r} is {_short(d.get(key))}, not a list",
            )
        pieces = []
        for i, p in enumerate(d["pieces"]):
            try:
                pieces.append(Piece.from_json(p))
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                raise CheckpointError(
                    f"tensor {name!r}: piece {i} is malformed ({type(err).__name__}: {err})"
                ) from None
            except CheckpointError as err:
                raise CheckpointError(f"tensor {name!r}: {err}") from None
        return TensorEntry(name, tuple(d["shape"]), d["dtype"], tuple(pieces), tuple(d.get("aliases", ())))


def run_count(slice: Slice, shape: tuple[int, ...]) -> int:
    """How many runs ``slice.run_table(shape)`` has at most, without building it (``slice`` valid for ``shape``)."""
    if isinstance(slice, FlatSlice):
        return 1
    block = slice.block if isinstance(slice, BlockFlatSlice) else slice
    return math.prod(shape[: block.dim]) * block.stride


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about values read from a damaged file."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def state_shape_problems(manifest: Manifest, state_kinds: Any = None) -> dict[str, str]:
    """Tensors whose shape disagrees with another tensor's that must have the same: an element-wise optimizer state
    ``optim/<P>/<k>`` and its parameter ``model/<P>`` (the naming convention of ``docs/checkpoint-format.md``).

    A flat piece is stored 1-D, so its safetensors header cannot tell a manifest whose shape was permuted (the same
    element count) from the one that was saved; this cross-check can, unless every such tensor was changed alike.
    ``state_kinds``: the global object ``optimizer/state_kinds`` (``{key: "elementwise" | "scalar"}``); without it a
    state of the parameter's element count but another shape (both at least 1-D) is the disagreement.

    Returns the message by tensor name (the state's and its parameter's: both are suspect)."""
    kinds = state_kinds if isinstance(state_kinds, dict) else {}
    problems: dict[str, str] = {}
    for name, entry in manifest.tensors.items():
        if not name.startswith("optim/"):
            continue
        param, _, key = name[len("optim/") :].rpartition("/")
        model = manifest.tensors.get(f"model/{param}")
        if model is None or entry.global_shape == model.global_shape:
            continue
        if key in kinds:
            wrong = kinds[key] == "elementwise"
        else:
            wrong = entry.numel == model.numel and min(len(entry.global_shape), len(model.global_shape)) >= 1
        if wrong:
            message = (
                f"tensor {name!r} has shape {list(entry.global_shape)}, its parameter {model.name!r} "
                f"{list(model.global_shape)}; an element-wise state has its parameter's shape (the manifest is "
                "damaged)"
            )
            problems[name] = message
            problems.setdefault(model.name, message)
    return problems


def check_coverage(name: str, shape: tuple[int, ...], slices: list[Slice]) -> None:
    """The slices (any mix of kinds, each valid for ``shape``) must cover every element of the tensor exactly once;
    the error names the first element covered twice (and the two slices) or the first range covered by none."""
    if all(isinstance(s, FlatSlice) for s in slices):
        problem = spans_coverage_problem(numel(shape), [(s.start, s.length) for s in slices])
    else:
        problem = coverage_problem(numel(shape), [s.run_table(shape) for s in slices])
    if problem is None:
        return
    kind, first, end, a, b = problem
    where = f"element {first} is at index {flat_index(first, shape)} of shape {shape}"
    if kind == "overlap":
        raise CheckpointError(
            f"tensor {name!r}: stored pieces overlap at element {first} ({where}): {slices[a]} and {slices[b]} "
            "both hold it"
        )
    after = f"; the piece before it is {slices[a]}" if a >= 0 else ""
    raise CheckpointError(f"tensor {name!r}: elements [{first}, {end}) are in no stored piece ({where}{after})")


class DescribedTensor(Protocol):
    """What :func:`slice_destination` needs of a tensor entry (ours, or a DCP or DeepSpeed reader's)."""

    @property
    def name(self) -> str: ...
    @property
    def global_shape(self) -> tuple[int, ...]: ...
    @property
    def torch_dtype(self) -> torch.dtype: ...


def slice_destination(
    entry: DescribedTensor,
    slice: Slice,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tensor a ``read_slice`` of ``slice`` of ``entry`` fills, checked before any byte is read (the preamble
    every reader shares): ``slice`` must fit the entry's global shape (else a ``CheckpointError`` naming the
    tensor); ``out``, when given, must be a contiguous host tensor of the slice's shape and of ``dtype`` (default:
    the entry's), else a new one of those is allocated."""
    shape = entry.global_shape
    try:
        slice.validate(shape)
    except CheckpointError as err:
        raise CheckpointError(f"tensor {entry.name!r}: cannot read {slice}: {err}") from None
    want = (tuple(slice.piece_shape(shape)), dtype or entry.torch_dtype)
    if out is None:
        return torch.empty(want[0], dtype=want[1])
    if (tuple(out.shape), out.dtype) != want or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(
            f"read_slice({entry.name!r}, out=...): expected a contiguous host tensor of shape {want[0]} and "
            f"dtype {want[1]}, got shape {tuple(out.shape)}, dtype {out.dtype} on {out.device}"
        )
    return out


@dataclass(frozen=True)
class FileEntry:
    """A file of the checkpoint: who wrote it, its size (truncation check) and, for object files, a checksum."""

    name: str
    rank: int
    size: int
    checksum: str | None = None

    def __post_init__(self) -> None:
        problem = member_name_problem(self.name)
        _check(problem is None, f"file name {_short(self.name)} {problem}; files are named inside the checkpoint")
        _check(_is_int(self.rank) and self.rank >= 0, f"file {self.name!r}: rank {_short(self.rank)} is not a rank")
        _check(
            _is_int(self.size) and 0 <= self.size <= MAX_TENSOR_BYTES,
            f"file {self.name!r}: size {_short(self.size)} is not a number of bytes",
        )
        _check(
            self.checksum is None or isinstance(self.checksum, str),
            f"file {self.name!r}: checksum {_short(self.checksum)} is not a string",
        )

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rank": self.rank, "size": self.size}
        if self.checksum is not None:
            d["checksum"] = self.checksum
        return d


@dataclass(frozen=True)
class ObjectRecord:
    """A small non-tensor object ([Note: checkpoint objects] in ``objects.py``): inline JSON (``"json"``), a tagged
    JSON tree whose tensors are in ``file``, a safetensors file (``"tagged"``; no file when it holds none), or a key
    in the pickle file ``file`` (``"pickle"``: written only by format version 1, read through an allow-list)."""

    key: str
    encoding: str  # "json", "tagged" or "pickle"
    value: Any = None
    file: str | None = None

    def __post_init__(self) -> None:
        _check(
            self.encoding in ("json", "tagged", "pickle"), f"object {self.key!r}: unknown encoding {self.encoding!r}"
        )
        _check(
            self.file is None or isinstance(self.file, str), f"object {self.key!r}: file {self.file!r} is not a name"
        )
        _check(
            self.encoding != "pickle" or self.file is not None, f"object {self.key!r}: a pickled object names its file"
        )
        _check(self.encoding != "json" or self.file is None, f"object {self.key!r}: an inline one names no file")

    def to_json(self) -> dict[str, Any]:
        if self.encoding == "pickle":
            return {"encoding": "pickle", "file": self.file}
        d = {"encoding": self.encoding, "value": self.value}
        return d if self.file is None else {**d, "file": self.file}

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
        _check(self.version in READABLE_VERSIONS, _unsupported_version(self.version))
        _check(
            _is_int(self.world_size) and self.world_size >= 1, f"world_size must be >= 1, got {_short(self.world_size)}"
        )
        _check(isinstance(self.tag, str), f"tag {_short(self.tag)} is not a string")
        names: dict[str, str] = {}
        for entry in self.tensors.values():
            for n in (entry.name, *entry.aliases):
                _check(isinstance(n, str), f"tensor {entry.name!r}: alias {_short(n)} is not a string")
                _check(n not in names, f"tensor name {n!r} is used twice (by {names.get(n)!r} and {entry.name!r})")
                names[n] = entry.name
            for p in entry.pieces:
                _check(p.file in self.files, f"tensor {entry.name!r}: piece file {p.file!r} is not in the file list")
                # a piece larger than its file: refused before a read would allocate room for it
                nbytes = numel(p.slice.piece_shape(entry.global_shape)) * entry.torch_dtype.itemsize
                _check(
                    nbytes <= self.files[p.file].size,
                    f"tensor {entry.name!r}: piece {p.key!r} ({p.slice} of shape {list(entry.global_shape)}, "
                    f"{entry.dtype}) is {nbytes} bytes, more than its file {p.file!r} holds "
                    f"({self.files[p.file].size} bytes)",
                )
        for records in (self.objects, *self.rank_objects.values()):
            for rec in records.values():
                _check(
                    rec.file is None or rec.file in self.files,
                    f"object {rec.key!r}: file {rec.file!r} is not in the file list",
                )
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
        except RecursionError:  # nesting deeper than the interpreter's recursion limit (about 1000)
            raise CheckpointError(f"{source}: JSON nested too deeply; the checkpoint is damaged") from None
        except ValueError as err:  # JSONDecodeError, or an integer of more than 4300 digits
            raise CheckpointError(f"{source}: not valid JSON ({err}); the checkpoint is damaged") from None
        if not isinstance(d, dict) or d.get("format") != "shardtrain-checkpoint":
            raise CheckpointError(f"{source}: not a shardtrain checkpoint manifest")
        version = d.get("version")
        if not _is_int(version) or version not in READABLE_VERSIONS:
            raise CheckpointError(f"{source}: {_unsupported_version(version)}")
        where = "the manifest"
        try:
            tensors = {}
            for n, t in _section(d, "tensors").items():
                where = f"tensor {n!r}"
                tensors[n] = TensorEntry.from_json(n, t)
            files = {}
            for n, f in _section(d, "files").items():
                where = f"file {n!r}"
                files[n] = FileEntry(n, f["rank"], f["size"], f.get("checksum"))
            objects = {}
            for k, o in _section(d, "objects").items():
                where = f"object {k!r}"
                objects[k] = ObjectRecord.from_json(k, o)
            rank_objects = {}
            for r, objs in _section(d, "rank_objects").items():
                where = f"rank_objects {r!r}"
                rank_objects[int(r)] = {k: ObjectRecord.from_json(k, o) for k, o in _section({r: objs}, r).items()}
            where = "the manifest"
            return Manifest(version, d["tag"], d["world_size"], tensors, files, objects, rank_objects)
        except CheckpointError as err:  # a record that failed its own validation: name the file
            raise CheckpointError(f"{source}: {err}") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as err:  # wrong type
            raise CheckpointError(f"{source}: malformed manifest: {where} ({type(err).__name__}: {err})") from None


def _section(d: Any, key: str) -> dict[str, Any]:
    """``d[key]``, which must be a JSON object."""
    value = d[key]
    if not isinstance(value, dict):
        raise CheckpointError(f"field {key!r} is {_short(value)}, not an object")
    return value
