"""Checkpoints as data: a JSON manifest of logical tensors and the slices of them stored in safetensors files.

* :mod:`~shardtrain.checkpoint.format`: the manifest dataclasses;
* :mod:`~shardtrain.checkpoint.writer`: the collective, crash-safe :func:`save` (its two halves, ``stage`` and
  ``commit``);
* :mod:`~shardtrain.checkpoint.async_save`: the commit in a background thread, over a checkpoint process group;
* :mod:`~shardtrain.checkpoint.reader`: :func:`open_checkpoint`, reads of whole tensors, element ranges or any slice;
* :mod:`~shardtrain.checkpoint.runs`: the element maps between slices (run tables, vectorized);
* :mod:`~shardtrain.checkpoint.consolidate`: Hugging Face-style safetensors (and optimizer state dict) output;
* :mod:`~shardtrain.cli.checkpoint`: ``shardtrain checkpoint inspect|consolidate``.
"""

from shardtrain.checkpoint.format import (
    FORMAT_VERSION,
    BlockFlatSlice,
    BlockSlice,
    FileEntry,
    FlatSlice,
    Manifest,
    ObjectRecord,
    Piece,
    TensorEntry,
)
from shardtrain.checkpoint.reader import CheckpointReader, open_checkpoint
from shardtrain.checkpoint.writer import SavePiece, SaveResult, save

__all__ = [
    "FORMAT_VERSION",
    "BlockFlatSlice",
    "BlockSlice",
    "CheckpointReader",
    "FileEntry",
    "FlatSlice",
    "Manifest",
    "ObjectRecord",
    "Piece",
    "SavePiece",
    "SaveResult",
    "TensorEntry",
    "open_checkpoint",
    "save",
]
