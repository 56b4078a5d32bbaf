"""Read a Megatron-Core ``torch_dist`` checkpoint through the interface of
:class:`~shardtrain.checkpoint.reader.CheckpointReader`, under a Hugging Face Llama / Mixtral model's names, so that
the engine loads it into any layout and ``shardtrain checkpoint consolidate`` writes what ``from_pretrained`` opens
([Note: Megatron torch_dist checkpoints] in ``megatron_format.py`` and [Note: Megatron tensor layout] in
``megatron_names.py`` say what maps to what).

A read of a Hugging Face tensor (whole, a flat range, or a slice) finds the runs of Megatron tensors it needs and
reads their bounding range from each with DCP's own reader (``dcp_reader.py``: only the chunks, and their rows,
that hold it). Memory: the result and at most one stacked layer slab of one Megatron tensor.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from shardtrain.checkpoint.foreign.dcp_format import DcpTensorEntry, _world_size
from shardtrain.checkpoint.foreign.dcp_reader import (
    ELEMENTWISE,
    PARAM_GROUPS_KEY,
    SCALAR,
    STATE_KINDS_KEY,
    DcpReader,
    ObjectsWithoutOptimizer,
)
from shardtrain.checkpoint.foreign.megatron_architecture import Architecture
from shardtrain.checkpoint.foreign.megatron_format import (
    MegatronSource,
    load_common,
    load_megatron_metadata,
    sources_of,
)
from shardtrain.checkpoint.foreign.megatron_names import MegatronManifest, MegatronTensorEntry, hf_entries
from shardtrain.checkpoint.foreign.megatron_optimizer import optimizer_entries, param_groups
from shardtrain.checkpoint.format import Slice, slice_destination
from shardtrain.checkpoint.runs import RunTable, SegmentCopier, intersect
from shardtrain.errors import CheckpointError

HF_CONFIG_KEY = "hf/config"  # consolidate.py's name: config.json is written from it


class _Chunks(DcpReader):
    """DCP's chunk reading (``DcpReader._read``) over megatron's metadata, which ``DcpReader.__init__`` would sort
    as a torchtitan checkpoint (and refuse for its save plans). It sets exactly the fields ``_read`` uses: the
    path for errors, the chunks already checked for coverage, the storage reader."""

    def __init__(self, path: Path, md: Any) -> None:
        self.path, self._md, self._covered = path, md, set()
        self._storage = FileSystemReader(path)
        self._storage.set_up_storage_reader(md, is_coordinator=True)


class MegatronReader:
    """Reads the model tensors of one Megatron ``torch_dist`` checkpoint directory (see the module docstring)."""

    format_name = "Megatron-Core torch_dist"  # for `shardtrain checkpoint inspect`

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.verify_reads = False  # torch_dist stores no checksums
        md = load_megatron_metadata(self.path)
        self.common = load_common(self.path)
        args = self.common.get("args")
        if args is None:
            raise CheckpointError(
                f"{self.path}: common.pt holds no 'args' (Megatron-LM saves them); the model's heads, query groups "
                "and experts cannot be known without them"
            )
        self._sources: dict[str, MegatronSource] = sources_of(md, self.path)
        self.arch = Architecture.from_args(args, self.path)
        embedding = self._sources.get("embedding.word_embeddings.weight")
        if not self.arch.vocab and embedding is not None:  # args without padded_vocab_size: the embedding's rows
            self.arch = dataclasses.replace(self.arch, vocab=embedding.global_shape[0])
        tensors = hf_entries(self._sources, self.arch, self.path)
        optimizer = self.common.get("optimizer") if isinstance(self.common.get("optimizer"), dict) else {}
        step = (optimizer.get("state") or {}).get("common_step")
        self._groups = optimizer.get("param_groups")
        tensors |= optimizer_entries(tensors, self._sources, None if step is None else float(step))
        self.manifest = MegatronManifest(self.path.name, _world_size(md), tensors)
        self._chunks = _Chunks(self.path, md)
        self._objects: dict[str, Any] | None = None

    # -- tensors ----------------------------------------------------------------------------------
    def entry(self, name: str) -> MegatronTensorEntry:
        return self.manifest.resolve(name)

    def read(
        self, name: str, flat_range: tuple[int, int] | None = None, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """As :meth:`CheckpointReader.read`: tensor ``name`` whole, or elements ``[a, b)`` of it flattened."""
        entry = self.manifest.resolve(name)
        a, b = (0, entry.numel) if flat_range is None else flat_range
        if not (0 <= a <= b <= entry.numel):
            raise CheckpointError(f"tensor {name!r}: range [{a}, {b}) is outside its {entry.numel} elements")
        out = self._elements(entry, a, b, dtype)
        return out.reshape(entry.global_shape) if flat_range is None else out

    def read_slice(self, name: str, slice: Slice, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """As :meth:`CheckpointReader.read_slice`: the part ``slice`` of tensor ``name``."""
        entry = self.manifest.resolve(name)
        out = slice_destination(entry, slice, dtype)
        target = slice.run_table(entry.global_shape)
        if target.count == 0:
            return out
        lo = int(target.global_start.min())
        hi = int((target.global_start + target.length).max())
        values = self._elements(entry, lo, hi, dtype)  # the slice's bounding range: at most the tensor
        SegmentCopier(out.view(-1), intersect(target, RunTable.of([lo], [0], [hi - lo])))(0, values)
        return out

    def _elements(self, entry: MegatronTensorEntry, a: int, b: int, dtype: torch.dtype | None) -> torch.Tensor:
        """Elements ``[a, b)`` of ``entry`` flattened: per Megatron tensor, one read of the runs' bounding range."""
        if entry.value is not None:
            return torch.full((b - a,), entry.value, dtype=dtype or entry.torch_dtype)
        out = torch.empty(b - a, dtype=dtype or entry.torch_dtype)
        wanted, at = [], 0  # (key, source start, length, position in out)
        for key, start, length in entry.runs:
            lo, hi = max(a, at), min(b, at + length)
            if hi > lo:
                wanted.append((key, start + lo - at, hi - lo, lo - a))
            at += length
        for key in dict.fromkeys(w[0] for w in wanted):
            mine = [w for w in wanted if w[0] == key]
            lo = min(w[1] for w in mine)
            hi = max(w[1] + w[2] for w in mine)
            values = self._read_source(key, lo, hi, dtype or entry.torch_dtype)
            for _, start, length, pos in mine:
                out[pos : pos + length] = values[start - lo : start - lo + length]
        return out

    def _read_source(self, key: str, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[lo, hi)`` of Megatron tensor ``key`` flattened."""
        return self._chunks._read(self._dcp_entry(key), (lo, hi), dtype)

    def _dcp_entry(self, key: str) -> DcpTensorEntry:
        src = self._sources[key]
        return DcpTensorEntry(key, src.global_shape, src.dtype, key, src.chunks)

    # -- objects ----------------------------------------------------------------------------------
    @property
    def objects(self) -> dict[str, Any]:
        """The transformers config of the model (``hf/config``, written as ``config.json`` by consolidation), the
        iteration as the engine's global step, an empty client state, and with optimizer state its param groups."""
        if self._objects is None:
            objects = ObjectsWithoutOptimizer(
                f"Megatron checkpoint {self.path} holds no optimizer state in model space (none saved, or the "
                "distributed optimizer's per-bucket formats, which shardtrain does not read yet); load it with "
                "load_optimizer_states=False (or consolidate it without --optimizer)"
            )
            weights = next(iter(self.manifest.tensors.values())).torch_dtype
            objects[HF_CONFIG_KEY] = json.dumps(self.arch.hf_config(weights))
            iteration = self.common.get("iteration")
            if isinstance(iteration, int):
                objects["engine/counters"] = {"global_step": iteration}
            objects["client_state"] = {}
            states = {n.rpartition("/")[2] for n in self.manifest.tensors if n.startswith("optim/")}
            if states:  # [Note: Megatron optimizer state]
                model = {n: e for n, e in self.manifest.tensors.items() if n.startswith("model/")}
                objects[PARAM_GROUPS_KEY] = param_groups(self._groups, model, self.path)
                objects[STATE_KINDS_KEY] = {k: SCALAR if k == "step" else ELEMENTWISE for k in sorted(states)}
            not_read = "" if states else "the optimizer state, "
            warnings.warn(
                f"Megatron checkpoint {self.path}: not carried over: {not_read}the learning-rate scheduler, RNG "
                "states and the data position",
                stacklevel=3,
            )
            self._objects = objects
        return self._objects

    def rank_objects(self, rank: int) -> dict[str, Any]:
        """Megatron's RNG states do not carry over to another framework's ranks."""
        return {}

    # -- full check -------------------------------------------------------------------------------
    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Read every Megatron tensor once; one message per problem (empty: all good)."""
        problems = []
        for key in self._sources:
            try:
                self._chunks._read(self._dcp_entry(key), None, None)
            except CheckpointError as err:
                problems.append(str(err))
            if progress is not None:
                progress(self._dcp_entry(key).nbytes)
        return problems
