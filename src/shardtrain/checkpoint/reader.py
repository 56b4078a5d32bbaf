"""Read a checkpoint in any layout: whole tensors, or elements ``[a, b)`` of a flattened tensor, from the pieces saved.

Integrity, and what it costs (``docs/checkpoint-format.md`` has the full discussion):

* always: the manifest must parse and carry a known version; every file a read touches must exist and have the size
  the manifest records (one ``stat``, catches truncation); the safetensors header must parse and hold the key with
  the manifest's dtype and shape;
* with ``verify=True`` (the default) every piece a read touches is read whole and its CRC-32 compared with the
  manifest (zlib, about 3 GB/s on one core), so a read of a sub-range reads the whole overlapping pieces; with
  ``verify=False`` only the overlapping elements are read;
* :meth:`CheckpointReader.verify` checks every file and piece (``shardtrain checkpoint inspect --verify``).

Every error names the file and the tensor.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardtrain.checkpoint.format import (
    LATEST_NAME,
    MANIFEST_NAME,
    Manifest,
    ObjectRecord,
    Piece,
    TensorEntry,
    crc32_of,
    crc32_of_bytes,
    numel,
)
from shardtrain.checkpoint.safetensors_io import read_tensor
from shardtrain.errors import CheckpointError


def resolve_checkpoint_dir(path: str | os.PathLike, tag: str | None = None) -> Path:
    """``path`` is a save directory (then ``tag``, or the one ``latest`` names) or a checkpoint directory itself."""
    path = Path(path)
    if tag is None and (path / MANIFEST_NAME).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    if tag is None:
        latest = path / LATEST_NAME
        if not latest.is_file():
            raise CheckpointError(
                f"no complete checkpoint in {path}: {LATEST_NAME!r} does not exist (a save that never finished "
                "leaves none); pass a tag to open a specific checkpoint"
            )
        tag = latest.read_text().strip()
        if not tag or not (path / tag / MANIFEST_NAME).is_file():
            raise CheckpointError(f"{latest} names checkpoint {tag!r}, which has no {MANIFEST_NAME}")
    ckpt = path / tag
    if not (ckpt / MANIFEST_NAME).is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no {MANIFEST_NAME}; it is incomplete or not a checkpoint")
    return ckpt


def open_checkpoint(path: str | os.PathLike, tag: str | None = None, *, verify: bool = True) -> CheckpointReader:
    """Open a checkpoint for reading; see :func:`resolve_checkpoint_dir` for ``path`` and ``tag``."""
    ckpt = resolve_checkpoint_dir(path, tag)
    text = (ckpt / MANIFEST_NAME).read_text()
    return CheckpointReader(ckpt, Manifest.from_json(text, str(ckpt / MANIFEST_NAME)), verify=verify)


class CheckpointReader:
    """Reads tensors and objects of one checkpoint directory. Holds no open files between calls."""

    def __init__(self, path: Path, manifest: Manifest, *, verify: bool = True) -> None:
        self.path = path
        self.manifest = manifest
        self.verify_reads = verify
        self._sizes_checked: set[str] = set()
        self._objects: dict[str, Any] | None = None

    # -- tensors ----------------------------------------------------------------------------------
    def entry(self, name: str) -> TensorEntry:
        return self.manifest.resolve(name)

    def _check_file(self, file: str, tensor: str) -> Path:
        path = self.path / file
        if file in self._sizes_checked:
            return path
        want = self.manifest.files[file].size
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file is missing (needed for tensor {tensor!r})") from None
        if size != want:
            raise CheckpointError(
                f"{path}: file has {size} bytes, the manifest says {want} (truncated or replaced; "
                f"needed for tensor {tensor!r})"
            )
        self._sizes_checked.add(file)
        return path

    def _load_piece(self, entry: TensorEntry, piece: Piece, elems: tuple[int, int] | None = None) -> torch.Tensor:
        """The piece, flattened; ``elems`` limits it to a range of the piece's elements (read alone without verify)."""
        path = self._check_file(piece.file, entry.name)
        partial = elems is not None and not self.verify_reads
        shape = piece.slice.piece_shape(entry.global_shape)
        try:
            t = read_tensor(path, piece.key, entry.torch_dtype, shape, elems if partial else None)
        except CheckpointError as err:
            raise CheckpointError(f"{err} (reading tensor {entry.name!r})") from None
        except OSError as err:
            raise CheckpointError(f"{path}: cannot read tensor {entry.name!r} (key {piece.key!r}): {err}") from None
        if partial:
            return t
        if self.verify_reads and crc32_of(t) != piece.checksum:
            raise CheckpointError(
                f"{path}: checksum mismatch in tensor {entry.name!r} (key {piece.key!r}, {piece.slice}): the file is "
                "corrupted"
            )
        t = t.reshape(-1)
        return t if elems is None else t[elems[0] : elems[1]]

    def read(
        self, name: str, flat_range: tuple[int, int] | None = None, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Tensor ``name`` (or an alias), whole in its global shape, or elements ``[a, b)`` of it flattened (1-D).

        Only pieces overlapping the range are read. ``dtype`` converts while copying (no second full-size copy).
        """
        entry = self.manifest.resolve(name)
        total = entry.numel
        a, b = (0, total) if flat_range is None else flat_range
        if not (0 <= a <= b <= total):
            raise CheckpointError(f"tensor {entry.name!r}: range [{a}, {b}) is outside its {total} elements")
        want_dtype = dtype or entry.torch_dtype
        out: torch.Tensor | None = None
        for piece in entry.pieces:
            runs = [
                (g, p, n) for g, p, n in piece.slice.runs(entry.global_shape) if g < b and g + n > a
            ]  # [Note: runs] in format.py
            if not runs:
                continue
            lo = min(p + max(a - g, 0) for g, p, n in runs)
            hi = max(p + min(b, g + n) - g for g, p, n in runs)
            data = self._load_piece(entry, piece, (lo, hi))
            if out is None and len(runs) == 1 and data.numel() == b - a and data.dtype == want_dtype:
                out = data  # one piece holds exactly the range: no second buffer, no copy
                continue
            if out is None:
                out = torch.empty(b - a, dtype=want_dtype)
            for g, p, n in runs:
                s, e = max(a, g), min(b, g + n)
                out[s - a : e - a].copy_(data[p + s - g - lo : p + e - g - lo])
            del data
        if out is None:  # an empty range or tensor
            out = torch.empty(b - a, dtype=want_dtype)
        return out.reshape(entry.global_shape) if flat_range is None else out

    # -- objects ----------------------------------------------------------------------------------
    def _load_pickle(self, file: str, key: str) -> dict[str, Any]:
        path = self._check_file(file, key)
        data = path.read_bytes()
        want = self.manifest.files[file].checksum
        if want is not None and crc32_of_bytes(data) != want:
            raise CheckpointError(f"{path}: checksum mismatch (object {key!r}); the file is corrupted")
        return pickle.loads(data)

    def _decode(self, records: dict[str, ObjectRecord]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        files: dict[str, dict[str, Any]] = {}
        for key, rec in records.items():
            if rec.encoding == "json":
                out[key] = rec.value
            else:
                if rec.file not in files:
                    files[rec.file] = self._load_pickle(rec.file, key)
                out[key] = files[rec.file][key]
        return out

    @property
    def objects(self) -> dict[str, Any]:
        """The global objects (scheduler, scaler, counters, ...)."""
        if self._objects is None:
            self._objects = self._decode(self.manifest.objects)
        return self._objects

    def rank_objects(self, rank: int) -> dict[str, Any]:
        """The objects rank ``rank`` of the saving run passed (e.g. its RNG states)."""
        if not 0 <= rank < self.manifest.world_size:
            raise CheckpointError(f"rank {rank} does not exist in a checkpoint saved by {self.manifest.world_size}")
        return self._decode(self.manifest.rank_objects.get(rank, {}))

    # -- full check -------------------------------------------------------------------------------
    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Check every file's size and every checksum; returns one message per problem (empty: all good)."""
        problems: list[str] = []
        saved, self.verify_reads = self.verify_reads, True
        try:
            for file, fe in self.manifest.files.items():
                if fe.checksum is None:
                    continue
                try:
                    self._load_pickle(file, "objects")
                except CheckpointError as err:
                    problems.append(str(err))
            for entry in self.manifest.tensors.values():
                for piece in entry.pieces:
                    try:
                        self._load_piece(entry, piece)
                    except CheckpointError as err:
                        problems.append(str(err))
                    if progress is not None:
                        progress(numel(piece.slice.piece_shape(entry.global_shape)) * entry.torch_dtype.itemsize)
        finally:
            self.verify_reads = saved
        return problems
