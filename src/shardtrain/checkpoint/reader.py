"""Read a checkpoint in any layout: whole tensors, elements ``[a, b)`` of a flattened tensor, or any slice (a ZeRO
fragment, a tensor-parallel block, a fragment of a block) of a tensor, from whatever pieces were saved.

Integrity, and what it costs (``docs/checkpoint-format.md`` has the full discussion):

* always: the manifest must parse and carry a known version; every file a read touches must exist and have the size
  the manifest records (one ``stat``, catches truncation); the safetensors header must parse and hold the key with
  the manifest's dtype and shape;
* with ``verify=True`` (the default) every piece a read touches is read whole and its CRC-32 compared with the
  manifest (ISA-L's CRC-32, about 29 GB/s on one core here), so a read of a sub-range reads the whole overlapping
  pieces; with ``verify=False`` only the overlapping elements are read;
* :meth:`CheckpointReader.verify` checks every file and piece (``shardtrain checkpoint inspect --verify``).

Every error names the file and the tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardtrain.checkpoint.format import (
    LATEST_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FlatSlice,
    Manifest,
    ObjectRecord,
    Piece,
    Slice,
    TensorEntry,
    crc32_of_bytes,
    numel,
    slice_destination,
    state_shape_problems,
)
from shardtrain.checkpoint.latest import JOURNAL_NAME, read_latest
from shardtrain.checkpoint.member_files import confined_path, read_regular, stat_regular
from shardtrain.checkpoint.objects import decode, decode_tensor_file, load_v1_pickle
from shardtrain.checkpoint.runs import SegmentCopier, Segments, intersect
from shardtrain.checkpoint.safetensors_io import header_entry, read_header, stream_tensor
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
        tag = read_latest(path)  # [Note: latest names a tag inside the save directory] (latest.py)
        if tag is None:
            journal = " (latest.tmp: a save was interrupted; a load through the engine finishes it)"
            raise CheckpointError(
                f"no complete checkpoint in {path}: {LATEST_NAME!r} does not exist (a save that never finished "
                f"leaves none{journal if (path / JOURNAL_NAME).exists() else ''}); pass a tag to open a specific "
                "checkpoint"
            )
        if not (path / tag / MANIFEST_NAME).is_file():
            raise CheckpointError(f"{latest} names checkpoint {tag!r}, which has no {MANIFEST_NAME}")
    ckpt = path / tag
    if not (ckpt / MANIFEST_NAME).is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no {MANIFEST_NAME}; it is incomplete or not a checkpoint")
    return ckpt


def open_checkpoint(path: str | os.PathLike, tag: str | None = None, *, verify: bool = True) -> CheckpointReader:
    """Open a checkpoint for reading; see :func:`resolve_checkpoint_dir` for ``path`` and ``tag``."""
    # checkpoints written by other systems, read through the same interface (each finder returns None for ours)
    from shardtrain.checkpoint.foreign.deepspeed_reader import (  # DeepSpeed's own saves
        DeepSpeedReader,
        find_deepspeed_dir,
    )

    if (ds_dir := find_deepspeed_dir(path, tag)) is not None:
        return DeepSpeedReader(ds_dir)  # type: ignore[return-value]  # the same reading interface
    from shardtrain.checkpoint.foreign.megatron_format import find_megatron_checkpoint  # Megatron torch_dist, legacy

    if (megatron_dir := find_megatron_checkpoint(path, tag)) is not None:  # before DCP: it is a DCP directory too
        from shardtrain.checkpoint.foreign.megatron_format import is_legacy_checkpoint
        from shardtrain.checkpoint.foreign.megatron_legacy import LegacyMegatronReader
        from shardtrain.checkpoint.foreign.megatron_reader import MegatronReader

        if is_legacy_checkpoint(megatron_dir):  # mp_rank_*/model_optim_rng.pt (Megatron-LM's --ckpt-format torch)
            return LegacyMegatronReader(megatron_dir)  # type: ignore[return-value]
        return MegatronReader(megatron_dir)  # type: ignore[return-value]  # the same reading interface
    from shardtrain.checkpoint.foreign.dcp_format import find_dcp_checkpoint  # torch DCP (FSDP2, torchtitan)

    if (dcp_dir := find_dcp_checkpoint(path, tag)) is not None:
        from shardtrain.checkpoint.foreign.dcp_reader import DcpReader

        return DcpReader(dcp_dir)  # type: ignore[return-value]  # the same reading interface
    ckpt = resolve_checkpoint_dir(path, tag)
    return CheckpointReader(ckpt, read_manifest(ckpt), verify=verify)


def read_manifest(ckpt: Path) -> Manifest:
    """The manifest of checkpoint directory ``ckpt``: a regular file inside it, read without blocking, of at most
    ``MAX_MANIFEST_BYTES`` ([Note: checkpoint member files] in ``member_files.py``)."""
    path = confined_path(ckpt, MANIFEST_NAME, "the manifest")
    data = read_regular(path, "the manifest", MAX_MANIFEST_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(
            f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); the file is damaged"
        ) from None
    return Manifest.from_json(text, str(path))


class CheckpointReader:
    """Reads tensors and objects of one checkpoint directory. Holds no open files between calls."""

    def __init__(self, path: Path, manifest: Manifest, *, verify: bool = True) -> None:
        self.path = path
        self.manifest = manifest
        self.verify_reads = verify
        self._sizes_checked: set[str] = set()
        self._objects: dict[str, Any] | None = None
        self._object_files: dict[tuple[str, str], dict[str, Any]] = {}
        # tensors whose shape disagrees with another's (format.state_shape_problems), from the manifest alone: a
        # read of one is refused, verify and consolidate report them
        kinds = manifest.objects.get("optimizer/state_kinds")
        kinds_value = kinds.value if kinds is not None and kinds.encoding == "json" else None
        self._shape_problems = state_shape_problems(manifest, kinds_value)

    def _resolve(self, name: str) -> TensorEntry:
        """The entry of tensor ``name`` (or an alias), refused by name when its shape disagrees with another's."""
        try:
            entry = self.manifest.resolve(name)
        except CheckpointError as err:
            raise CheckpointError(f"{self.path}: {err}") from None
        if entry.name in self._shape_problems:
            raise CheckpointError(f"{self.path / MANIFEST_NAME}: {self._shape_problems[entry.name]}")
        return entry

    # -- tensors ----------------------------------------------------------------------------------
    def entry(self, name: str) -> TensorEntry:
        return self.manifest.resolve(name)

    def _check_file(self, file: str, what: str) -> Path:
        """``what`` names the tensor or object the file is needed for (it goes into the error). The file must be a
        regular file inside the checkpoint ([Note: checkpoint member files]) of the size the manifest records."""
        if file in self._sizes_checked:
            return self.path / file
        path = confined_path(self.path, file, what)
        want = self.manifest.files[file].size
        size = stat_regular(path, what).st_size
        if size != want:
            raise CheckpointError(
                f"{path}: file has {size} bytes, the manifest says {want} (truncated or replaced; needed for {what})"
            )
        self._sizes_checked.add(file)
        return path

    def check_pieces(self, name: str) -> None:
        """Without reading data: every file tensor ``name`` is stored in exists as a regular file inside the
        checkpoint with its recorded size, and each piece's key has the dtype and shape the manifest gives it in
        its file's safetensors header (one cached header parse per file)."""
        entry = self._resolve(name)
        for piece in entry.pieces:
            what = f"tensor {entry.name!r}"
            path = self._check_file(piece.file, what)
            try:
                _, header = read_header(path, what)
                shape = piece.slice.piece_shape(entry.global_shape)
                header_entry(path, header, piece.key, entry.torch_dtype, shape, entry.global_shape)
            except CheckpointError as err:
                raise CheckpointError(f"{err} (tensor {entry.name!r})") from None

    def _stream_piece(
        self, entry: TensorEntry, piece: Piece, elems: tuple[int, int], sink: Callable[[int, torch.Tensor], None]
    ) -> None:
        """Feed elements ``elems`` of the flattened piece to ``sink`` chunk by chunk; with verify (or when the whole
        piece is asked for) the whole piece is read and its checksum compared."""
        path = self._check_file(piece.file, f"tensor {entry.name!r}")
        shape = piece.slice.piece_shape(entry.global_shape)
        whole = (0, numel(shape))
        check = self.verify_reads or elems == whole
        # a copier into host memory of the stored dtype can take long segments read straight into the result
        direct = (
            sink.direct
            if isinstance(sink, SegmentCopier) and sink.out.device.type == "cpu" and sink.out.dtype == entry.torch_dtype
            else None
        )
        try:
            crc = stream_tensor(
                path, piece.key, entry.torch_dtype, shape, whole if check else elems, sink, direct, entry.global_shape
            )
        except CheckpointError as err:
            raise CheckpointError(f"{err} (reading tensor {entry.name!r})") from None
        except OSError as err:
            raise CheckpointError(f"{path}: cannot read tensor {entry.name!r} (key {piece.key!r}): {err}") from None
        if check and f"crc32:{crc:08x}" != piece.checksum:
            raise CheckpointError(
                f"{path}: checksum mismatch in tensor {entry.name!r} (key {piece.key!r}, {piece.slice}): the file is "
                "corrupted"
            )

    def read(
        self,
        name: str,
        flat_range: tuple[int, int] | None = None,
        *,
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tensor ``name`` (or an alias), whole in its global shape, or elements ``[a, b)`` of it flattened (1-D).

        The same as :meth:`read_slice` with ``FlatSlice(a, b - a)`` (reshaped to the global shape when whole);
        ``out``: a contiguous host tensor of ``b - a`` elements to read into.
        """
        entry = self._resolve(name)
        total = entry.numel
        a, b = (0, total) if flat_range is None else flat_range
        if not (0 <= a <= b <= total):
            raise CheckpointError(f"tensor {entry.name!r}: range [{a}, {b}) is outside its {total} elements")
        result = self.read_slice(name, FlatSlice(a, b - a), dtype=dtype, out=None if out is None else out.view(-1))
        if out is not None:
            return out
        return result.reshape(entry.global_shape) if flat_range is None else result

    def read_slice(
        self, name: str, slice: Slice, *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The part ``slice`` of tensor ``name`` (or an alias), of shape ``slice.piece_shape(global shape)``: what a
        rank of another layout owns, whatever layout the checkpoint was saved at (any mix of slice kinds).

        Only stored pieces sharing elements with ``slice`` are read, each once, sequentially in chunks of a few MiB
        (whole when verifying its checksum), and every byte read is checksummed right after its read, once. Long
        contiguous segments (a ZeRO fragment, a whole tensor, a row block: one per piece) are read straight into the
        result; the rest goes through one chunk buffer and is copied into the result with strided views or one
        gather (``runs.py``), never a Python step per run. The element map of each piece is computed from the runs
        of both slices as tensors, or with plain integers for a flat range of a flat piece. Memory: the result, one
        chunk, the run tables. ``dtype`` converts while copying (never read directly).

        ``out``: read into this contiguous host tensor of the result's shape and dtype instead of a new one (the
        engine reads weights straight into their place: no allocation, no page faults of new memory, no copy).
        """
        entry = self._resolve(name)
        shape = entry.global_shape
        try:
            slice.validate(shape)
        except CheckpointError as err:
            raise CheckpointError(f"tensor {entry.name!r}: cannot read {slice}: {err}") from None
        # which elements each stored piece gives; its files are checked before the result is allocated, so that a
        # manifest claiming more than the files hold fails by name rather than by allocating it
        plan: list[tuple[Piece, tuple[int, int, int] | Segments]] = []
        target = None  # run table, built only when a piece needs it
        for piece in entry.pieces:
            stored = piece.slice
            if isinstance(slice, FlatSlice) and isinstance(stored, FlatSlice):
                # one run each (a ZeRO fragment read by a flat range): plain integers, no run tables
                lo = max(slice.start, stored.start)
                hi = min(slice.start + slice.length, stored.start + stored.length)
                if hi > lo:
                    plan.append((piece, (lo - slice.start, lo - stored.start, hi - lo)))
            else:
                target = slice.run_table(shape) if target is None else target
                segments = intersect(target, stored.run_table(shape))
                if segments.count:
                    plan.append((piece, segments))
        for piece, _ in plan:
            self._check_file(piece.file, f"tensor {entry.name!r}")
        out = slice_destination(entry, slice, dtype, out)
        if out.numel() == 0:
            return out
        flat = out.view(-1)
        for piece, where in plan:
            if isinstance(where, Segments):
                copier = SegmentCopier(flat, where)
                first = int(where.piece_start[0])
                last = int(where.piece_start[-1] + where.length[-1])
            else:
                target_start, piece_start, length = where
                copier = SegmentCopier.one_run(flat, target_start, piece_start, length)
                first, last = piece_start, piece_start + length
            self._stream_piece(entry, piece, (first, last), copier)
        return out

    # -- objects ----------------------------------------------------------------------------------
    def _object_file(self, file: str, encoding: str, key: str, cached: bool = True) -> dict[str, Any]:
        """The contents of an object file: tensors by key (``"tagged"``) or objects by key (``"pickle"``, format
        version 1, through the allow-list of ``objects.py``). Size and checksum are checked first."""
        if cached and (file, encoding) in self._object_files:
            return self._object_files[(file, encoding)]
        path = self._check_file(file, f"object {key!r}")
        data = read_regular(path, f"object {key!r}", self.manifest.files[file].size)
        want = self.manifest.files[file].checksum
        if want is not None and crc32_of_bytes(data) != want:
            raise CheckpointError(f"{path}: checksum mismatch (object {key!r}); the file is corrupted")
        if encoding == "pickle":
            contents = load_v1_pickle(data, str(path))
        else:
            contents = decode_tensor_file(data, str(path))
        self._object_files[(file, encoding)] = contents
        return contents

    def _decode(self, records: dict[str, ObjectRecord]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, rec in records.items():
            if rec.encoding == "json":
                out[key] = rec.value
                continue
            contents = self._object_file(rec.file, rec.encoding, key) if rec.file is not None else {}
            if rec.encoding == "tagged":
                out[key] = decode(rec.value, contents, f"{self.path / (rec.file or MANIFEST_NAME)}: object {key!r}")
            elif key not in contents:
                raise CheckpointError(f"{self.path / rec.file}: holds no object {key!r}; the file is damaged")
            else:
                out[key] = contents[key]
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
    def shape_problems(self) -> list[str]:
        """Shapes of the manifest that disagree with each other (``format.state_shape_problems``): a permuted
        shape of a tensor stored in flat pieces, which no file can contradict. One message per tensor."""
        return [f"{self.path / MANIFEST_NAME}: {p}" for p in dict.fromkeys(self._shape_problems.values())]

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Check every file's size and every checksum, each piece's dtype and shape against its file's safetensors
        header, and the shapes of the manifest against each other; returns one message per problem (empty: all
        good)."""
        problems: list[str] = self.shape_problems()
        saved, self.verify_reads = self.verify_reads, True
        try:
            records = [*self.manifest.objects.values()]
            records += [r for objs in self.manifest.rank_objects.values() for r in objs.values()]
            for file, fe in self.manifest.files.items():
                if fe.checksum is None:
                    continue
                mine = [r for r in records if r.file == file]
                encoding = mine[0].encoding if mine else "tagged"  # a file no object names: it must still parse
                try:
                    self._object_file(file, encoding, ", ".join(r.key for r in mine), cached=False)
                except CheckpointError as err:
                    problems.append(str(err))
            for entry in self.manifest.tensors.values():
                for piece in entry.pieces:
                    try:
                        whole = (0, numel(piece.slice.piece_shape(entry.global_shape)))
                        self._stream_piece(entry, piece, whole, lambda offset, chunk: None)
                    except CheckpointError as err:
                        problems.append(str(err))
                    if progress is not None:
                        progress(numel(piece.slice.piece_shape(entry.global_shape)) * entry.torch_dtype.itemsize)
        finally:
            self.verify_reads = saved
        return problems
