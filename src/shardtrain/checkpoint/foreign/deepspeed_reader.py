"""Read a checkpoint directory written by DeepSpeed's ``save_checkpoint`` as if it were one of ours.

What each file holds and the manifest it becomes: [Note: DeepSpeed checkpoints as a manifest] in
``deepspeed_format.py``.

Reading: every file is opened through :func:`~shardtrain.checkpoint.foreign.deepspeed_pickle.load_deepspeed_file`
(allow-listed, memory-mapped) and kept open; a read copies only the elements asked for, so a rank's memory grows by
the tensors it asks for. Tensor-parallel checkpoints (``mp_rank_01`` and up, ZeRO stages 0-3) are read where
AutoTP recorded how each parameter was split ([Note: DeepSpeed tensor parallelism]).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardtrain.checkpoint.foreign.deepspeed_format import DeepSpeedLayout, _Source, find_deepspeed_dir
from shardtrain.checkpoint.format import FlatSlice, Piece, Slice, TensorEntry, numel, slice_destination
from shardtrain.checkpoint.resume_needs import optimizer_state_problems
from shardtrain.checkpoint.runs import SegmentCopier, intersect
from shardtrain.errors import CheckpointError

__all__ = ["DeepSpeedReader", "find_deepspeed_dir"]

_CHUNK = 4 << 20  # elements per copy: bounds the index tensors of an irregular copy


class DeepSpeedReader(DeepSpeedLayout):
    """A DeepSpeed checkpoint (one tag directory) behind the interface of ``CheckpointReader``."""

    format_name = "written by DeepSpeed"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.verify_reads = False  # DeepSpeed's files carry no checksums
        self._files: dict[str, dict[str, Any]] = {}
        self._sources: dict[str, _Source] = {}
        self._objects: dict[str, Any] = {}
        self.manifest = self._build()

    # -- the reader interface ---------------------------------------------------------------------
    def entry(self, name: str) -> TensorEntry:
        return self.manifest.resolve(name)

    @property
    def objects(self) -> dict[str, Any]:
        return self._objects

    def rank_objects(self, rank: int) -> dict[str, Any]:
        """DeepSpeed saves no per-rank objects (its RNG states are not in the checkpoint)."""
        if not 0 <= rank < self.manifest.world_size:
            raise CheckpointError(f"rank {rank} does not exist in a checkpoint saved by {self.manifest.world_size}")
        return {}

    def _stream_piece(
        self, entry: TensorEntry, piece: Piece, elems: tuple[int, int], sink: Callable[[int, torch.Tensor], None]
    ) -> None:
        src = self._sources[piece.key]
        t = self._tensor(src).reshape(-1)
        length = numel(piece.slice.piece_shape(entry.global_shape))
        if src.offset + length > t.numel():
            raise CheckpointError(
                f"{self.path / src.file}: {'/'.join(map(str, src.keys))} holds {t.numel()} elements, tensor "
                f"{entry.name!r} needs elements up to {src.offset + length}; the file is damaged"
            )
        a, b = elems
        for lo in range(a, b, _CHUNK):
            hi = min(b, lo + _CHUNK)
            sink(lo, t[src.offset + lo : src.offset + hi])

    def read(
        self, name: str, flat_range: tuple[int, int] | None = None, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """As ``CheckpointReader.read``: tensor ``name`` whole in its global shape, or elements ``[a, b)`` of it."""
        entry = self.manifest.resolve(name)
        total = entry.numel
        a, b = (0, total) if flat_range is None else flat_range
        if not (0 <= a <= b <= total):
            raise CheckpointError(f"tensor {entry.name!r}: range [{a}, {b}) is outside its {total} elements")
        out = self.read_slice(name, FlatSlice(a, b - a), dtype=dtype)
        return out.reshape(entry.global_shape) if flat_range is None else out

    def read_slice(self, name: str, slice: Slice, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """As ``CheckpointReader.read_slice``: the part ``slice`` of tensor ``name``, copied from the memory-mapped
        files (only the pieces that share elements with it, only those elements)."""
        entry = self.manifest.resolve(name)
        shape = entry.global_shape
        out = slice_destination(entry, slice, dtype)
        target = slice.run_table(shape)
        if target.count == 0:
            return out
        flat = out.view(-1)
        for piece in entry.pieces:
            segments = intersect(target, piece.slice.run_table(shape))
            if segments.count == 0:
                continue
            first = int(segments.piece_start[0])
            last = int(segments.piece_start[-1] + segments.length[-1])
            self._stream_piece(entry, piece, (first, last), SegmentCopier(flat, segments))
        return out

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Open every file (through the allow-list), check that every piece lies inside its tensor and that the
        optimizer state holds what a resume needs (``resume_needs.py``: Adam's step counts with its moments);
        DeepSpeed writes no checksums, so the values themselves cannot be checked."""
        problems: list[str] = []
        for entry in self.manifest.tensors.values():
            for piece in entry.pieces:
                try:  # opens the file and checks that the piece's elements lie inside its tensor
                    self._stream_piece(entry, piece, (0, 0), lambda o, c: None)
                except CheckpointError as err:
                    problems.append(str(err))
                if progress is not None:  # a tensor-parallel block's elements, not its first dimension's
                    progress(numel(piece.slice.piece_shape(entry.global_shape)) * entry.torch_dtype.itemsize)
        return problems + optimizer_state_problems(self.manifest, self.objects)
